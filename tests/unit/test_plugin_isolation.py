"""A plugin reaches qcomm only where it is asked for: `qcomm check` survives
codecs that hang or crash it, `qcomm list` imports no plugin code, loading one
built-in codec imports its module only, and a lint rule keeps the core from
importing a plugin."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from fake_dists import GOOD_CODEC, activate, make_dist

from qcomm.cli import build_parser
from qcomm.cli import main as cli_main

ROOT = pathlib.Path(__file__).parents[2]

MISBEHAVING = (
    GOOD_CODEC
    + """

class Hangs(Codec):
    def encode(self, input_tensor, ctx=None):
        import time
        time.sleep(3600)


class HugeBlock(Codec):
    def __init__(self):
        super().__init__()
        self.info = qcomm.CodecInfo(name="huge", bits_per_element=32, error_block=2**32)


class Dies(Codec):
    def encode(self, input_tensor, ctx=None):
        import os
        os._exit(3)
"""
)


@pytest.fixture
def misbehaving(tmp_path, monkeypatch):
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(
        tmp_path,
        "bad-codecs",
        "bad_mod",
        MISBEHAVING,
        {"hangs": "Hangs", "dies": "Dies", "huge": "HugeBlock"},
    )
    activate(tmp_path, monkeypatch)


def test_check_times_out_on_a_codec_that_never_returns(misbehaving, capsys):
    started = time.monotonic()
    assert cli_main(["check", "--timeout", "2", "hangs", "dies", "noop"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL hangs: rule 'dtype' did not finish within 2 s (--timeout)")
    assert out[1].startswith("FAIL dies: the check ended (exit code 3) during rule 'dtype'")
    assert out[2].startswith("ok   noop: 12 rules passed")
    assert time.monotonic() - started < 120


def test_check_reports_what_the_kit_cannot_check(misbehaving, capsys):
    assert cli_main(["check", "huge", "int8:row_dim=4294967296"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL huge: ValueError: block 4294967296")
    assert "too large to check" in out[0]
    assert out[1].startswith("FAIL int8:row_dim=4294967296: ")
    assert not any("Traceback" in line for line in out)


@pytest.mark.parametrize("value", ["inf", "0", "nan", "1e9"])
def test_check_timeout_must_be_sensible(capsys, value):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--timeout", value, "noop"])
    assert "--timeout: expected a number from" in capsys.readouterr().err


# The core never imports a plugin: ruff enforces it (flake8-tidy-imports).


def _ruff(cwd: pathlib.Path, *paths: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed")
    args = [ruff, "check", "--no-cache", "--output-format", "concise", "--select", "TID251", *paths]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True)


def test_lint_refuses_a_plugin_import_in_the_core(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    imports = {
        "plain.py": "import qcomm_builtin\n",
        "sub.py": "from qcomm_builtin.half import FP16Codec\n",
        "example.py": "import qcomm_example_codec.codec\n",
    }
    for where in ("qcomm", "qcomm/benchmark", "plugins/qcomm_builtin", "tests"):
        (tmp_path / where).mkdir(parents=True, exist_ok=True)
        for name, line in imports.items():
            (tmp_path / where / name).write_text(line)
    out = _ruff(tmp_path, ".")
    flagged = sorted(line.split(":")[0] for line in out.stdout.splitlines() if "TID251" in line)
    core = [f"qcomm/{n}" for n in imports] + [f"qcomm/benchmark/{n}" for n in imports]
    assert flagged == sorted(core), out.stdout + out.stderr
    assert "the core never imports a plugin" in out.stdout


def test_the_core_imports_no_plugin_today():
    assert _ruff(ROOT, "qcomm").returncode == 0


# `qcomm list` and loading one codec import no other plugin code
# (tests/unit/test_discovery.py covers available_codecs, load_codec and
# QCOMM_PLUGINS in-process).

WRAPPER = textwrap.dedent(
    """
    import atexit, json, sys
    watched = ("qcomm_builtin", "qcomm_example_codec", "loud_mod", "fbgemm_gpu")

    def report():
        found = sorted(m for m in sys.modules if m.split(".")[0] in watched)
        sys.stderr.write("IMPORTED " + json.dumps(found) + "\\n")

    atexit.register(report)
    from qcomm.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run_wrapped(args: list[str], tmp_path: Any, **env: str) -> tuple[str, list[str]]:
    environ = {**os.environ, "PYTHONPATH": str(tmp_path), **env}
    out = subprocess.run(
        [sys.executable, "-c", WRAPPER, *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )
    line = next((line for line in out.stderr.splitlines() if line.startswith("IMPORTED ")), None)
    assert line is not None, f"no import report (exit {out.returncode}):\n{out.stderr}"
    return out.stdout, json.loads(line.removeprefix("IMPORTED "))


def test_qcomm_list_imports_no_plugin(tmp_path: Any) -> None:
    # A plugin whose import would end the process: listing must not touch it.
    make_dist(tmp_path, "loud-codecs", "loud_mod", "raise SystemExit('imported!')\n", {"loud": "X"})
    stdout, imported = run_wrapped(["list"], tmp_path)
    assert "loud" in stdout and "int8" in stdout, stdout
    assert imported == [], f"`qcomm list` imported plugin modules {imported}"
    # The allow-list hides the distribution, still without importing anything.
    stdout, imported = run_wrapped(["list"], tmp_path, QCOMM_PLUGINS="qcomm")
    assert "loud" not in stdout and "int8" in stdout, stdout
    assert imported == []


def test_loading_one_builtin_imports_only_its_module() -> None:
    code = textwrap.dedent(
        """
        import sys, qcomm
        qcomm.load_codec("fp16")
        print(" ".join(sorted(m for m in sys.modules if m.startswith(("qcomm_builtin", "qcomm_ex")))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported = set(out.stdout.split())
    assert "qcomm_builtin.half" in imported, imported
    others = {"qcomm_builtin.int8", "qcomm_builtin.fp8", "qcomm_builtin.mx4", "qcomm_example_codec"}
    assert not imported & others, f"loading fp16 imported {sorted(imported & others)}"
