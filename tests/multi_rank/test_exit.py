"""A process that exits with qcomm calls in flight exits cleanly on every rank.

Each rank is a process of its own running ``exit_script.py``, so that the
test sees its exit status and what it printed: before the fix, a rank whose
background thread was still inside a gloo wait when the interpreter
finalized died with SIGABRT ("terminate called without an active
exception"), and calls dropped without a wait were never finished.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from dist_utils import TRANSPORTS

from qcomm.collectives import _background

_SCRIPT = pathlib.Path(__file__).with_name("exit_script.py")
_CALLS = 4


def _run(
    form: str, transport: str, tmp_path: pathlib.Path, timeout: str = "30"
) -> list[tuple[int | None, str, str]]:
    """Runs both ranks of the script; returns each rank's (exit status, stdout, stderr)."""
    env = {
        **os.environ,
        "QCOMM_TRANSPORT": transport,
        "QCOMM_EXIT_TIMEOUT": timeout,
        "OMP_NUM_THREADS": "1",
    }
    store = tmp_path / f"store-{form}-{transport}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(_SCRIPT), str(rank), "2", form, str(store)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results: list[tuple[int | None, str, str]] = []
    try:
        for rank, proc in enumerate(procs):
            if form == "hung" and rank == 1:
                # Never sends its last call's part: it is ended once rank 0 is out.
                proc.kill()
            out, err = proc.communicate(timeout=120)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _report(out: str) -> dict[str, str]:
    found = re.search(r"^qcomm-exit (.*)$", out, re.MULTILINE)
    assert found, f"no report of the exit hook in:\n{out}"
    return dict(item.split("=") for item in found.group(1).split())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exit_with_calls_in_flight(transport: str, tmp_path: pathlib.Path) -> None:
    # One process per rank and form: each exits once.
    for form in ("exit", "destroy", "drop"):
        for rank, (code, out, err) in enumerate(_run(form, transport, tmp_path)):
            where = f"{form} on {transport}, rank {rank}"
            assert "terminate called" not in err, f"{where}:\n{err}"
            assert "Traceback" not in err and "Exception ignored" not in err, f"{where}:\n{err}"
            assert code == 0, f"{where}: exit status {code}\n{err}"
            report = _report(out)
            # Every call finished before the interpreter's teardown, and the
            # background thread stopped: on gloo's point-to-point transport
            # the calls ran in the background, and the exit hook waited for
            # each (twice as many jobs); on the all-to-all one the hook (or
            # the drop) gave each to the background thread.
            per_call = 2 if transport == "point_to_point" else 1
            assert report["completed"] == str(per_call * _CALLS), f"{where}: {report}"
            assert report["stopped"] == "True", f"{where}: {report}"
            dropped = _CALLS if form == "drop" else 0
            assert report["dropped"] == str(dropped), f"{where}: {report}"


def test_exit_gives_up_on_a_peer_that_never_sends(tmp_path: pathlib.Path) -> None:
    # Rank 1 issues three calls of four, then sleeps: rank 0 waits
    # QCOMM_EXIT_TIMEOUT for its last call, says so, and exits normally.
    code, out, err = _run("hung", "point_to_point", tmp_path, timeout="1")[0]
    assert "terminate called" not in err, err
    assert code == 0, f"exit status {code}\n{err}"
    assert "given up on" in err, err
    report = _report(out)
    assert report["completed"] == str(_CALLS - 1), report
    assert report["stopped"] == "False", report


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_exit_timeout_that_is_no_number_of_seconds_is_warned_of(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QCOMM_EXIT_TIMEOUT", value)
    with pytest.warns(UserWarning, match=rf"QCOMM_EXIT_TIMEOUT: .*got '{value}'"):
        assert _background.exit_timeout() == 10.0
    monkeypatch.setenv("QCOMM_EXIT_TIMEOUT", "2.5")
    assert _background.exit_timeout() == 2.5
