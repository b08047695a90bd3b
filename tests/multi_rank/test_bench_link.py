"""`qcomm bench --link`: local ranks over an emulated, shaped link.

Where network namespaces can be made (root, iproute2), a short run on a
1 Gbit/s link is checked: the link's measured throughput is near its rate,
no collective beats the wire's bound, and no namespace is left behind, after
a normal end, SIGTERM or Ctrl-C, or (for the next run) SIGKILL. Without the
privileges the command must stop at once with one line saying what is
missing; that is checked everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import qcomm
from qcomm.benchmark import link as qlink
from qcomm.benchmark.launch import spawn_local
from qcomm.benchmark.options import BenchConfig


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's ip and tc are not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"qcomm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


UNAVAILABLE = _namespaces_unavailable()
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def _ours(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if f"qcomm-{pid}-" in line]


def _bench(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "qcomm.cli", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@needs_namespaces
def test_a_short_run_on_a_1gbit_link(tmp_path: Any) -> None:
    out = tmp_path / "link.json"
    proc = _bench(
        "--link",
        "1gbit",
        "--quick",
        "--sizes",
        "4M",
        "--codecs",
        "int8",
        "--ops",
        "pooled",
        "--no-fbgemm",
        "--json",
        str(out),
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert _ours(proc.pid) == [], "namespaces left behind"
    assert "Emulated link: 1gbit" in stdout
    results = json.loads(out.read_text())
    link = results["link"]
    assert link["rate_bps"] == 1e9 and link["error"] is None
    # TCP over the shaped veth carries close to the rate, never more than
    # the rate plus the bucket's burst.
    for key in ("one_way_GBps", "both_ways_GBps"):
        assert 0.5 * 0.125 < link[key] < 1.1 * 0.125, (key, link)
    assert "same_host_both_ways_GBps" not in link  # a rank per host
    points = {p["label"]: p for p in results["collectives"] if p["pass"] == "fwd"}
    assert {"noop", "int8", "bare:p2p", "bare:native"} <= set(points)
    for label, p in points.items():
        assert p["status"] == "ok", (label, p["error"])
        # 4 MiB per rank, 2 MiB cross each port: 16.8 ms at 1 Gbit/s for
        # float32; nothing crosses faster than the wire (less the burst).
        assert p["link_bound_s"] > 0
        assert p["x_link_bound"] > 0.8, (label, p["x_link_bound"])
    assert points["int8"]["link_bound_s"] < points["noop"]["link_bound_s"] / 3
    # qcomm's series were timed again with the rate limit lifted: faster than
    # on the link, and the model's prediction from that is in the right range
    # (how close it comes is measured in the docs, not asserted on a busy CI).
    # (int8's 4 MiB take about as long to encode on a busy 2-core machine as
    # its wire takes on the link, so only the no-op codec is surely faster.)
    for label in ("noop", "int8"):
        p = points[label]
        assert 0 < p["unlimited_s"], (label, p["unlimited_s"])
        assert 0.5 < p["measured_over_predicted"] < 2.0, (label, p["measured_over_predicted"])
    assert points["noop"]["unlimited_s"] < points["noop"]["latency_s"]
    assert points["bare:p2p"]["unlimited_s"] is None
    assert "on the emulated 1 Gbit/s link (measured in this run)" in stdout
    assert "QCOMM_CODECS=" in stdout
    # One figure per fact: the advice's speed-up is the measured table's.
    (rate,) = results["advice"]["rates"]
    assert rate["gbit_per_s"] == 1.0
    for advice in rate["collectives"]:
        assert advice["measured"]
        measured = points[advice["forward"]]["speedup"] if advice["forward"] != "noop" else 1.0
        assert advice["forward_speedup"] == pytest.approx(measured, rel=1e-12)


def _wait_for_namespaces(proc: subprocess.Popen[str], deadline: float) -> list[str]:
    while time.monotonic() < deadline and proc.poll() is None:
        made = _ours(proc.pid)
        if len(made) == 2:
            return made
        time.sleep(0.1)
    return []


@needs_namespaces
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_namespaces_go_when_the_run_is_stopped(how: signal.Signals) -> None:
    proc = _bench("--link", "100mbit", "--sizes", "64M", "--codecs", "noop", "--no-fbgemm")
    try:
        assert _wait_for_namespaces(proc, time.monotonic() + 60), "the link never came up"
        time.sleep(1.0)  # let the ranks start
        proc.send_signal(how)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _ours(proc.pid) == []


@needs_namespaces
def test_a_killed_runs_namespaces_are_removed_by_the_next() -> None:
    stale = "qcomm-999999999-r0"  # no such pid
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with qlink.Link(2, 1e9) as made:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert stale not in names
            assert made.namespace(0) in names and made.namespace(1) in names
        assert _ours(os.getpid()) == []
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


@needs_namespaces
def test_three_ranks_meet_through_a_switch(tmp_path: Any) -> None:
    out = tmp_path / "link3.json"
    proc = _bench(
        "--link",
        "1gbit",
        "--world-size",
        "3",
        "--quick",
        "--sizes",
        "1M",
        "--codecs",
        "noop",
        "--ops",
        "seq",
        "--no-fbgemm",
        "--json",
        str(out),
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert _ours(proc.pid) == []
    results = json.loads(out.read_text())
    assert all(p["status"] == "ok" for p in results["collectives"])


@needs_namespaces
def test_two_hosts_of_two_ranks_share_a_namespace_each(tmp_path: Any) -> None:
    out = tmp_path / "hosts.json"
    proc = _bench(
        "--link", "1gbit", "--world-size", "4", "--ranks-per-host", "2", "--quick",
        "--sizes", "1M", "--codec-size", "64K", "--rounds", "2",
        "--codecs", "same_host=noop+other_host=int8", "--ops", "pooled", "--no-fbgemm",
        "--json", str(out),
    )  # fmt: skip
    try:
        # Two namespaces, one per host, and no switch between two hosts.
        made = _wait_for_namespaces(proc, time.monotonic() + 60)
        assert sorted(name.rpartition("-")[2] for name in made) == ["h0", "h1"], made
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert _ours(proc.pid) == []
    results = json.loads(out.read_text())
    assert results["meta"]["ranks_per_host"] == 2
    # Measured between hosts (ranks 0 and 2): the shaped link's rate.
    assert 0.5 * 0.125 < results["link"]["one_way_GBps"] < 1.1 * 0.125, results["link"]
    # And inside a host (ranks 0 and 1, unshaped), for the planner's profile.
    inside = results["link"]["same_host_both_ways_GBps"]
    assert inside > 1.1 * 0.125, results["link"]
    profile = qcomm.profile_from_bench(results)
    assert profile.intra_host_Bps == pytest.approx(1e9 * inside)
    assert profile.inter_host_Bps == pytest.approx(1e9 * results["link"]["both_ways_GBps"])
    points = {p["label"]: p for p in results["collectives"] if p["pass"] == "fwd"}
    for label, p in points.items():
        assert p["status"] == "ok", (label, p["error"])
    # A host's port carries its 2 ranks' blocks for the other host's 2:
    # 1 MiB at 1 Gbit/s, 8.4 ms, which no series beats.
    noop = points["noop"]
    assert noop["link_bound_s"] == pytest.approx(8 * (1 << 20) / 1e9)
    assert noop["x_link_bound"] > 0.8, noop["x_link_bound"]


def test_without_the_tools_it_stops_at_once_saying_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    started = time.monotonic()
    status = spawn_local(BenchConfig(link="1gbit", codecs=["noop"], fbgemm=False))
    assert status == 2 and time.monotonic() - started < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--link needs the ip and tc command(s)" in err[0], err


# /proc/self/status as Linux writes it, but for the capability sets.
_STATUS_TEXT = """Name:\tpython3
Umask:\t0022
State:\tR (running)
Uid:\t1000\t1000\t1000\t1000
CapInh:\t{inh:016x}
CapPrm:\t{eff:016x}
CapEff:\t{eff:016x}
CapBnd:\t000001ffffffffff
CapAmb:\t{amb:016x}
NoNewPrivs:\t0
"""
NET_ADMIN, SYS_ADMIN, DAC_OVERRIDE = 1 << 12, 1 << 21, 1 << 1


def _status(eff: int = 0, amb: int = 0) -> str:
    return _STATUS_TEXT.format(inh=amb, eff=eff | amb, amb=amb)


def test_without_root_it_stops_at_once_saying_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "access", lambda path, mode: True)  # /run/netns writable
    (tmp_path / "status").write_text(_status())
    monkeypatch.setattr(qlink, "_STATUS", str(tmp_path / "status"))
    status = spawn_local(BenchConfig(link="1gbit", codecs=["noop"], fbgemm=False))
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "--link needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN as ambient capabilities, "
        "which the ip and tc it runs inherit; this process (uid 1000) lacks CAP_NET_ADMIN "
        "and CAP_SYS_ADMIN among them (CapAmb). Run it as root, or e.g. `sudo setpriv "
        "--reuid=$(id -u) --regid=$(id -g) --init-groups --inh-caps=+net_admin,+sys_admin "
        "--ambient-caps=+net_admin,+sys_admin qcomm bench --link ...`"
    ) in err[0], err
    # With the capabilities ambient, a user other than root passes the check.
    (tmp_path / "status").write_text(_status(amb=NET_ADMIN | SYS_ADMIN))
    qlink._check_privileges()


def test_capability_sets_are_read_from_proc_status_text() -> None:
    text = _status(eff=NET_ADMIN | DAC_OVERRIDE, amb=SYS_ADMIN)
    assert qlink._capabilities(text) == NET_ADMIN | DAC_OVERRIDE | SYS_ADMIN
    assert qlink._capabilities(text, "CapEff") == 0x201002
    assert qlink._capabilities(text, "CapAmb") == SYS_ADMIN
    assert qlink._capabilities(text, "CapBnd") == 0x1FFFFFFFFFF
    # A kernel without ambient capabilities, a garbled line, no text at all.
    assert qlink._capabilities("CapEff:\t0000000000001000\n", "CapAmb") is None
    assert qlink._capabilities("CapEff:\tnot-hex\n") is None
    assert qlink._capabilities("") is None
    # The field's name is matched whole, not as a prefix.
    assert qlink._capabilities("CapEffX:\t1\nCapEff:\t2\n") == 2


@pytest.mark.parametrize(
    "euid, eff, amb, writable, lacks",
    [
        # Root: its capabilities in effect are what ip and tc get.
        (0, 0x1FFFFFFFFFF, 0, False, None),
        (0, NET_ADMIN | SYS_ADMIN, 0, False, None),
        (0, 0xA80425FB, 0, True, "without CAP_NET_ADMIN and CAP_SYS_ADMIN (CapEff)"),
        (0, NET_ADMIN, 0, True, "without CAP_SYS_ADMIN (CapEff)"),
        # Another user: ambient ones (inherited by ip and tc), and DAC_OVERRIDE
        # where /run/netns is not writable.
        (1000, 0, NET_ADMIN | SYS_ADMIN, True, None),
        (1000, 0, NET_ADMIN | SYS_ADMIN | DAC_OVERRIDE, False, None),
        (1000, 0, NET_ADMIN | SYS_ADMIN, False, "lacks CAP_DAC_OVERRIDE among them"),
        (1000, 0, NET_ADMIN, True, "lacks CAP_SYS_ADMIN among them"),
        (1000, 0, 0, True, "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN among them"),
        # setcap on the interpreter: in effect here, but not in ip and tc.
        (
            1000,
            NET_ADMIN | SYS_ADMIN,
            0,
            True,
            "it has CAP_NET_ADMIN and CAP_SYS_ADMIN only in effect (as setcap on the "
            "interpreter gives), which ip and tc do not inherit",
        ),
    ],
)
def test_privileges_are_read_from_the_capabilities(
    euid: int, eff: int, amb: int, writable: bool, lacks: str | None
) -> None:
    problem = qlink._privilege_problem(euid, _status(eff=eff, amb=amb), writable)
    if lacks is None:
        assert problem is None
        return
    assert problem is not None and lacks in problem, problem
    if euid == 0:
        assert problem.startswith("--link needs the CAP_NET_ADMIN and CAP_SYS_ADMIN capabilities")
    else:
        assert problem.startswith("--link needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN")
        assert ("CAP_DAC_OVERRIDE (/run/netns is not writable)" in problem) is not writable


def test_privileges_without_proc_status() -> None:
    # Root as before (not Linux? ip says what fails); anyone else is refused.
    assert qlink._privilege_problem(0, None, False) is None
    problem = qlink._privilege_problem(1000, None, True)
    assert problem is not None and "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in problem


def test_rates_read_like_tc() -> None:
    assert qlink.parse_rate("1gbit") == 1e9
    assert qlink.parse_rate(" 10Gbit ") == 1e10
    assert qlink.parse_rate("100mbit") == 1e8
    assert qlink.parse_rate("2.5g") == 2.5e9
    assert qlink.tc_rate(1e9) == "1000000kbit"
    for bad in ("fast", "1gbps", "0gbit", "-1gbit", "1 gigabit", ""):
        with pytest.raises(ValueError, match="--link"):
            qlink.parse_rate(bad)


def test_link_is_refused_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm.benchmark.command import config_from_args
    from qcomm.cli import build_parser

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "x")):
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["bench", "--link", "1gbit"])
    with pytest.raises(ValueError, match="--link"):
        config_from_args(args)
