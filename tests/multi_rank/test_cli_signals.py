"""No process that `qcomm check` or `qcomm bench` starts outlives the command, however
it ends: SIGTERM, SIGINT, SIGHUP, or SIGKILL to the command alone."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from fake_dists import GOOD_CODEC, make_dist

pytestmark = pytest.mark.skipif(
    not pathlib.Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)

# Says it has started (a file per rank), then spins at full CPU forever, as a
# codec stuck in a loop does.
SPINNING = (
    GOOD_CODEC
    + """

class Spins(Codec):
    def encode(self, input_tensor, ctx=None):
        import os, pathlib
        marker = pathlib.Path(os.environ["SPIN_MARKERS"]) / f"spinning-{os.getpid()}"
        marker.write_text("")
        while True:
            pass
"""
)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, or None if there is no such process."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    # A zombie has ended; whoever inherited it may just not have reaped it yet.
    return {pid for pid in pids if (stat := _stat(pid)) is not None and stat[1] != "Z"}


@pytest.fixture
def spinning(tmp_path):
    plugins, markers = tmp_path / "plugins", tmp_path / "markers"
    plugins.mkdir()
    markers.mkdir()
    make_dist(plugins, "spin-codecs", "spin_mod", SPINNING, {"spins": "Spins"})
    env = {**os.environ, "SPIN_MARKERS": str(markers), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(plugins), env.get("PYTHONPATH", "")])
    env.pop("QCOMM_PLUGINS", None)
    return env, markers


def _run_until_spinning(
    argv: list[str], env: dict[str, str], markers: pathlib.Path, spinners: int
) -> tuple[subprocess.Popen[bytes], set[int]]:
    """Starts the command; returns once ``spinners`` of its children spin in the codec."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcomm.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(list(markers.iterdir())) < spinners:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the command ended or never reached the codec (status {proc.poll()})")
        time.sleep(0.1)
    return proc, _descendants(proc.pid)


def _assert_all_end(
    proc: subprocess.Popen[bytes], children: set[int], how: signal.Signals, markers: pathlib.Path
) -> None:
    """Sends ``how`` to the command alone; every child must end within seconds."""
    spinning = {int(p.name.rpartition("-")[2]) for p in markers.iterdir()}
    try:
        os.kill(proc.pid, how)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(children)
        assert not left, f"still running after {how.name} to the command: {sorted(left)}"
    finally:
        for pid in _alive(children | spinning):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_check_leaves_no_worker_behind(spinning, how):
    env, markers = spinning
    proc, children = _run_until_spinning(
        ["check", "--timeout", "600", "spins"], env, markers, spinners=1
    )
    assert children, "the check started no worker"
    _assert_all_end(proc, children, how, markers)
    if how != signal.SIGKILL:
        assert proc.returncode == 128 + how


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_bench_leaves_no_rank_behind(spinning, how):
    env, markers = spinning
    argv = ["bench", "--codecs", "spins", "--no-fbgemm", "--ops", "pooled", "--sizes", "64K"]
    argv += ["--codec-size", "64K", "--budget", "0.01", "--rounds", "1", "--timeout", "600"]
    proc, children = _run_until_spinning(argv, env, markers, spinners=2)
    assert len(children) >= 2, "the bench started fewer than 2 ranks"
    _assert_all_end(proc, children, how, markers)
    if how != signal.SIGKILL:
        assert proc.returncode == 128 + how
