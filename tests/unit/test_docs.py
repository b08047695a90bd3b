r"""
The documentation is part of the product: it builds with warnings as errors
(every cross-reference resolves), it covers the whole public API, and every
``Examples::`` block of every docstring runs as a doctest, as do the ``>>>``
lines of the concept pages.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.machinery
import importlib.util
import io
import pkgutil
import re
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import qcomm

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Packages whose docstrings are rendered in the docs, so their examples must run.
PACKAGES = ("qcomm", "qcomm_builtin", "qcomm_example_codec")
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
EXAMPLES_HEADER = re.compile(r"^\s*Examples::\s*$", re.MULTILINE)


def _module_names() -> list[str]:
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            # __main__ would run the CLI on import; a compiled extension
            # (qcomm_builtin._kernels) has no Python source to hold examples.
            spec = importlib.util.find_spec(info.name)
            compiled = spec is not None and (spec.origin or "").endswith(
                tuple(importlib.machinery.EXTENSION_SUFFIXES)
            )
            if info.name.rpartition(".")[2] != "__main__" and not compiled:
                names.append(info.name)
    return sorted(names)


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str, Path]]:
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    cmd += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    yield proc.returncode, proc.stdout + proc.stderr, out / "html"


def test_docs_build_without_warnings(built_docs: tuple[int, str, Path]) -> None:
    returncode, output, html = built_docs
    assert returncode == 0, f"sphinx-build -W failed:\n{output}"
    pages = sorted(p.stem for p in DOCS.glob("*.rst"))
    assert [p for p in pages if not (html / f"{p}.html").is_file()] == []


def _inventory(html: Path) -> set[str]:
    # objects.inv: four header lines, then zlib-compressed lines
    # "name domain:role priority uri display-name".
    raw = (html / "objects.inv").read_bytes()
    body = raw.split(b"\n", 4)[4]
    lines = zlib.decompress(body).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.split(" ", 2)[1].startswith("py:")}


def test_every_public_name_is_documented(built_docs: tuple[int, str, Path]) -> None:
    _, output, html = built_docs
    assert (html / "objects.inv").is_file(), f"no inventory was written:\n{output}"
    documented = _inventory(html)
    missing = sorted(name for name in qcomm.__all__ if f"qcomm.{name}" not in documented)
    assert not missing, f"public names of qcomm.__all__ missing from the API reference: {missing}"


def _run_doctests(tests: list[doctest.DocTest]) -> tuple[int, int, str]:
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report = io.StringIO()
    failed = attempted = 0
    for test in tests:
        result = runner.run(test, out=report.write)
        failed, attempted = failed + result.failed, attempted + result.attempted
    return failed, attempted, report.getvalue()


@pytest.mark.parametrize("module_name", _module_names())
def test_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(exclude_empty=False).find(module, module_name)
    # An Examples:: block without ">>>" lines would render but never run.
    silent = [
        t.name
        for t in tests
        if t.docstring and EXAMPLES_HEADER.search(t.docstring) and not t.examples
    ]
    assert not silent, f"Examples:: blocks without a runnable >>> line: {silent}"
    found = sum(len(EXAMPLES_HEADER.findall(t.docstring or "")) for t in tests)
    in_source = len(EXAMPLES_HEADER.findall(Path(module.__file__ or "").read_text()))
    assert found == in_source, (
        f"{module_name} has {in_source} Examples:: blocks but doctest reaches {found}: "
        "one sits where doctest does not look (a nested function?)"
    )
    failed, attempted, report = _run_doctests(tests)
    assert failed == 0, f"{failed} of {attempted} examples failed in {module_name}:\n{report}"


@pytest.mark.parametrize(
    "page", sorted(p.name for p in DOCS.glob("*.rst") if ">>>" in p.read_text())
)
def test_page_examples_run(page: str) -> None:
    path = DOCS / page
    test = doctest.DocTestParser().get_doctest(path.read_text(), {}, page, str(path), 0)
    failed, attempted, report = _run_doctests([test])
    assert failed == 0, f"{failed} of {attempted} examples failed in docs/{page}:\n{report}"


def test_the_readme_starts_with_what_a_torchrec_user_does() -> None:
    # The two commands, then the registry in TorchRec's sharders, within the
    # first 80 lines; the DDP hook right after.
    lines = (ROOT / "README.md").read_text().splitlines()
    heads = {line: n for n, line in enumerate(lines, 1) if line.startswith("## ")}
    quick, torchrec = heads["## Quick start"], heads["## Using qcomm with TorchRec"]
    after = min(n for n in heads.values() if n > torchrec)
    assert quick < torchrec and after - 1 <= 80, f"the TorchRec section ends at line {after - 1}"
    assert lines[after - 1] == "## Dense gradients: a DDP hook"
    start = "\n".join(lines[quick:torchrec])
    assert "make bench" in start and "make test" in start
    assert "qcomm_codecs_registry=registry" in "\n".join(lines[torchrec:after])
