"""The package's habits: lazy imports, one version, typed, no import cycle."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import qcomm

ROOT = pathlib.Path(qcomm.__file__).parent


def _torch_loaded_after(statement: str) -> bool:
    code = f"import sys\n{statement}\nprint('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip() == "True"


def test_importing_qcomm_or_its_pytest_plugin_loads_no_torch() -> None:
    assert not _torch_loaded_after("import qcomm")
    assert not _torch_loaded_after("import qcomm.pytest_plugin")
    # A name brings in what it needs, and no more.
    assert _torch_loaded_after("import qcomm; qcomm.NoOpQuantizedCommCodec")
    assert not _torch_loaded_after("import qcomm; qcomm.CommOp, qcomm.CodecError")
    assert not _torch_loaded_after("import qcomm; qcomm.available_codecs()")


def test_the_command_line_front_end_loads_no_torch() -> None:
    # `qcomm list`, `--help` and argument parsing answer at once; torch loads
    # for what needs it (a bench run, `list --details`, `check`'s worker).
    assert not _torch_loaded_after("import qcomm.cli")
    run = "from qcomm.cli import main\nimport contextlib, io\n"
    quiet = "contextlib.redirect_stdout(io.StringIO())"
    assert not _torch_loaded_after(f"{run}with {quiet}: main(['list'])")
    assert _torch_loaded_after(f"{run}with {quiet}: main(['list', '--details'])")
    parse = "from qcomm.cli import build_parser; build_parser().parse_args"
    assert not _torch_loaded_after(f"{parse}(['bench', '--quick', '--link-gbps', '10'])")


def test_every_public_name_and_submodule_resolves() -> None:
    for name in qcomm.__all__:
        assert getattr(qcomm, name) is not None, name
    assert set(qcomm.__all__) <= set(dir(qcomm))
    assert qcomm.collectives.all_to_all_pooled is qcomm.all_to_all_pooled
    # Every public collective is at the top level with the others; the
    # all-reduce's module stays importable under its own name.
    assert qcomm.collectives.all_gather_pooled is qcomm.all_gather_pooled
    all_reduce_module = importlib.import_module("qcomm.collectives.all_reduce")
    assert all_reduce_module.all_reduce is qcomm.all_reduce
    try:
        qcomm.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("an unknown attribute of qcomm must raise AttributeError")


def test_the_version_has_one_source_and_the_package_is_typed() -> None:
    assert importlib.metadata.version("qcomm") == qcomm.__version__
    assert (ROOT / "py.typed").is_file()


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    # Every import of a qcomm module, at any depth (a function-level import
    # hides a cycle as well as it hides the cost), except typing-only ones.
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from package import module` imports the module; anything else, the base.
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.add(whole if whole in modules else base)
    return {name for name in found if name in modules}


def test_no_import_cycle_between_modules() -> None:
    modules = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }
    # The package faces (__init__.py) only hand names on; edges go to modules.
    names = set(modules)
    graph = {
        name: _imports(path, names) - {name, "qcomm"}
        for name, path in modules.items()
        if path.name != "__init__.py"
    }
    for name, path in modules.items():
        if path.name == "__init__.py":
            for deps in graph.values():
                if name in deps:
                    deps.discard(name)
                    deps |= _imports(path, names) - {name}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = trail[trail.index(name) :] + [name]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        visit(name, [])
    assert len(graph) > 30, "the walk must see the package"


def _collected(suites: list[str], env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *suites],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT.parent,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_a_broken_third_party_plugin_does_not_void_the_suites(tmp_path: pathlib.Path) -> None:
    # A plugin installed beside qcomm whose codec cannot even be imported:
    # the suites run on the built-in codecs and the example plugin's, the
    # same cases with it as without; QCOMM_TEST_PLUGINS=1 tests it too.
    from fake_dists import make_dist

    make_dist(tmp_path, "acme-broken", "acme_broken", "raise ImportError('no')\n", {"acme": "X"})
    suites = [f"tests/multi_rank/test_{name}.py" for name in ("collectives", "pipeline", "ddp")]
    env = {k: v for k, v in os.environ.items() if k != "QCOMM_TEST_PLUGINS"}
    plain = _collected(suites, env)
    path = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    broken = _collected(suites, {**env, "PYTHONPATH": path})
    assert broken == plain and not [case for case in plain if "acme" in case]
    opted = _collected(suites, {**env, "PYTHONPATH": path, "QCOMM_TEST_PLUGINS": "1"})
    assert [case for case in opted if "[acme]" in case or "acme]" in case]
