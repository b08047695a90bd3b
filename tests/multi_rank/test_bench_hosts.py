"""`qcomm bench --ranks-per-host K`: emulated hosts, and codecs by host as candidates.

The option is checked against the world size before any rank starts; the
emulated link's plan puts a host's ranks in one namespace (checked without
root: the plan is a list of commands); the figures of codecs by host follow
what crosses hosts (their ratio on the all-reduce, which they make
hierarchical, is not taken for noise); and one real run on 4 local ranks as
2 hosts of 2 measures a host candidate beside its codec alone.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest
import torch

from qcomm import config
from qcomm.benchmark.advice import is_noise, pair_spec
from qcomm.benchmark.candidates import crossing_elements, measure_codec, measure_host_codecs
from qcomm.benchmark.command import config_from_args
from qcomm.benchmark.figures import add_comparisons, series_ratio
from qcomm.benchmark.link import Link
from qcomm.benchmark.options import BenchConfig, host_parts, split_codec_list
from qcomm.benchmark.rows import CodecRow, Point
from qcomm.benchmark.session import RANKS_PER_HOST_ENV
from qcomm.cli import build_parser
from qcomm.cli import main as cli_main
from qcomm.errors import CodecError
from qcomm.registry import load_pair
from qcomm.types import HostCodecs

POLICY = "same_host=noop+other_host=int8"


def _config(*argv: str) -> BenchConfig:
    # The tests change the environment between calls; a process reads it once.
    from qcomm import config

    config._reread()
    return config_from_args(build_parser().parse_args(["bench", *argv]))


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", RANKS_PER_HOST_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_per_host_must_leave_hosts_of_equal_size(no_launcher: pytest.MonkeyPatch) -> None:
    assert _config("--world-size", "4", "--ranks-per-host", "2").ranks_per_host == 2
    assert _config("--world-size", "6", "--ranks-per-host", "3").ranks_per_host == 3
    assert _config("--world-size", "4").ranks_per_host is None
    expected = "--ranks-per-host: expected a divisor of the world size 4 that leaves at least 2"
    for bad in ("3", "4"):
        with pytest.raises(ValueError, match=expected) as info:
            _config("--world-size", "4", "--ranks-per-host", bad)
        assert str(info.value).endswith(f"hosts (1, 2), got {bad}")
    with pytest.raises(ValueError, match="world size 2 that leaves at least 2 hosts"):
        _config("--ranks-per-host", "2")  # the default world size is 2
    config = _config("--world-size", "4", "--ranks-per-host", "2")
    assert BenchConfig.from_json(config.to_json()).ranks_per_host == 2


def test_a_bad_ranks_per_host_is_a_usage_error(
    no_launcher: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--ranks-per-host", "0"])
    assert exit_info.value.code == 2
    assert "--ranks-per-host: expected a whole number from 1 to 1024" in capsys.readouterr().err
    assert cli_main(["bench", "--world-size", "3", "--ranks-per-host", "2"]) == 2
    assert "--ranks-per-host: expected a divisor of the world size 3" in capsys.readouterr().err


def test_under_a_launcher_its_layout_is_read_as_qcomm_reads_it(
    no_launcher: pytest.MonkeyPatch,
) -> None:
    monkeypatch = no_launcher
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "x")):
        monkeypatch.setenv(name, value)
    assert _config().ranks_per_host is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _config().ranks_per_host == 4
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    assert _config().ranks_per_host == 2
    assert _config("--ranks-per-host", "1").ranks_per_host == 1
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "8")  # one host: nothing crosses, no host model
    assert _config().ranks_per_host is None
    # The variable the ranks are told is the one qcomm's collectives read.
    assert RANKS_PER_HOST_ENV == config.VARIABLES["ranks_per_host"]


def test_codecs_by_host_are_one_candidate_each(no_launcher: pytest.MonkeyPatch) -> None:
    assert split_codec_list(f"noop,int8,{POLICY},mx4") == ["noop", "int8", POLICY, "mx4"]
    spec = "same_host=noop+other_host=mx4:group_size=16,rounding=floor/bf16"
    assert split_codec_list(spec) == [spec]
    assert _config("--codec", spec).codecs == [spec]
    assert _config("--codecs", f"int8,{POLICY}").codecs == ["int8", POLICY]
    with pytest.raises(CodecError, match="--codecs: 'other=int8' in"):
        split_codec_list("same_host=noop+other=int8")
    with pytest.raises(ValueError, match=r"--codecs: 'same_host=noop\+other_host=nosuch' cannot"):
        _config("--codecs", "same_host=noop+other_host=nosuch")
    assert host_parts("other_host=int8/bf16+ranks_per_host=2") == {
        "same_host": "noop",
        "other_host": "int8",
        "ranks_per_host": "2",
    }


def _added(plan: list[list[str]]) -> list[str]:
    return [argv[3] for argv in plan if argv[:3] == ["ip", "netns", "add"]]


def _shaped(plan: list[list[str]]) -> list[tuple[str, str]]:
    return [(argv[3], argv[8]) for argv in plan if argv[4:6] == ["tc", "qdisc"]]


def test_a_hosts_ranks_share_its_namespace_and_address() -> None:
    link = Link(4, 1e9, ranks_per_host=2)
    names = [link.namespace(r) for r in range(4)]
    assert names[0] == names[1] != names[2] == names[3]
    assert names[0].endswith("-h0") and names[2].endswith("-h1")
    assert [link.address(r) for r in range(4)] == ["10.213.0.1"] * 2 + ["10.213.0.2"] * 2
    assert link.command(1, ["python"]) == ["ip", "netns", "exec", names[0], "python"]
    plan = link.plan()
    # Two namespaces joined by one veth pair, no switch; each host one
    # address; the shaped link is between the hosts only.
    assert _added(plan) == [names[0], names[2]]
    veth = [argv for argv in plan if "veth" in argv]
    assert veth == [
        ["ip", "-n", names[0], "link", "add", "eth0", "type", "veth",
         "peer", "name", "eth0", "netns", names[2]]
    ]  # fmt: skip
    addresses = [(argv[2], argv[5]) for argv in plan if argv[3:5] == ["addr", "add"]]
    assert addresses == [(names[0], "10.213.0.1/24"), (names[2], "10.213.0.2/24")]
    assert _shaped(plan) == [(names[0], "eth0"), (names[2], "eth0")] == link._shaped()


def test_three_hosts_meet_through_a_switch() -> None:
    link = Link(6, 1e9, ranks_per_host=2)
    hosts = [link.namespace(r) for r in (0, 2, 4)]
    switch = link._switch()
    assert switch is not None and _added(link.plan()) == [*hosts, switch]
    shaped = _shaped(link.plan())
    assert sorted(shaped) == sorted(link._shaped())
    assert sorted(shaped) == sorted(
        [(h, "eth0") for h in hosts] + [(switch, f"port{h}") for h in range(3)]
    )
    assert link.address(5) == "10.213.0.3"


def test_one_rank_per_host_is_the_layout_it_always_was() -> None:
    pair = Link(2, 1e9)
    assert [pair.namespace(r)[-3:] for r in range(2)] == ["-r0", "-r1"]
    assert _added(pair.plan()) == [pair.namespace(0), pair.namespace(1)]
    four = Link(4, 1e9)
    assert _added(four.plan())[:4] == [four.namespace(r) for r in range(4)]
    assert len(set(four.address(r) for r in range(4))) == 4
    with pytest.raises(ValueError, match="ranks_per_host: expected a divisor of the world size 4"):
        Link(4, 1e9, ranks_per_host=3)


def test_codecs_by_host_measured_on_their_own() -> None:
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    crossing = crossing_elements(x.numel(), 4, 2)
    assert crossing == x.numel() // 2
    codecs = load_pair(f"{POLICY}/bf16")
    assert isinstance(codecs, HostCodecs)
    policy = measure_host_codecs(codecs, x, crossing=crossing, budget=0.0, max_calls=1)
    alone = measure_codec(load_pair("int8").forward, x, budget=0.0, max_calls=1)
    # Half of the data crosses hosts, through int8: its wire is int8's on
    # that half; the error is int8's on half the elements, the rest exact.
    assert policy["crossing_elements"] == crossing
    assert policy["wire_bytes"] * 2 == pytest.approx(alone["wire_bytes"], rel=1e-3)
    assert policy["backward_wire_bytes"] == 2 * crossing  # bf16
    assert policy["rms_rel_error"] == pytest.approx(alone["rms_rel_error"] / math.sqrt(2), rel=0.1)
    assert 0 < policy["max_rel_error"] <= alone["max_rel_error"]


def _row(codec: str, ratio: float, **extra: Any) -> CodecRow:
    return CodecRow(codec=codec, source="qcomm", status="ok", compression_ratio=ratio, **extra)


def _point(op: str, label: str, latency: float, passes: str = "fwd") -> Point:
    return Point(
        op=op, impl="qcomm", codec=label, label=label, passes=passes, size_bytes=1 << 20,
        status="ok", latency_s=latency,
    )  # fmt: skip


def test_a_host_policys_ratio_is_what_crosses_hosts() -> None:
    int8 = _row("int8", 3.2)
    policy = _row(POLICY, 3.2, crossing_share=0.5)
    mixed = _row("other_host=int8/fp16", 4.0, crossing_share=0.5, backward_compression_ratio=2.0)
    a2a, ar = "pooled_embeddings_all_to_all", "all_reduce"
    assert series_ratio(_point(a2a, "int8", 1.0), int8, 2) == 3.2
    assert series_ratio(_point(ar, "int8", 1.0), int8, 2) == 3.2  # flat: not by host
    assert series_ratio(_point(a2a, POLICY, 1.0), policy, 2) == 3.2
    assert series_ratio(_point(ar, POLICY, 1.0), policy, 2) == 6.4  # hierarchical
    assert series_ratio(_point(ar, POLICY, 1.0), policy, 1) == 3.2  # a host per rank: flat
    assert series_ratio(_point(a2a, mixed.codec, 1.0, "fwd+bwd"), mixed, 2) == pytest.approx(8 / 3)
    assert series_ratio(_point(a2a, "noop", 1.0), None, 2) == 1.0
    # noop by host on 2 hosts of 2: the hierarchical all-reduce sends half of
    # what noop's flat one sends between hosts; a speed-up of 1.9 is no noise.
    noop_by_host = _row("same_host=noop+other_host=noop", 1.0, crossing_share=0.5)
    points = [_point(ar, "noop", 1.9), _point(ar, noop_by_host.codec, 1.0)]
    add_comparisons(points, [_row("noop", 1.0), noop_by_host], None, 4, None, ranks_per_host=2)
    assert points[1].compression_ratio == 2.0 and not is_noise(1.9, points[1].compression_ratio)
    # A host's port carries its 2 ranks' blocks for the other host's 2 ranks.
    crossing = 2 * (1 << 20) * 2 * 2 / 4  # a reduce-scatter and an all-gather
    assert points[0].link_bytes == pytest.approx(crossing / 0.95)
    assert points[1].link_bytes == pytest.approx(crossing / 2 / 0.95)


def test_the_advice_writes_a_host_pick_as_codecs_by_host() -> None:
    assert pair_spec("int8", "bf16") == "int8/bf16"
    spec = pair_spec(POLICY, "bf16")
    assert spec == "same_host=noop/bf16+other_host=int8/bf16"
    loaded = load_pair(spec)
    assert isinstance(loaded, HostCodecs)
    assert type(loaded.other_host.backward).__name__ == "BF16Codec"
    assert pair_spec("fp16", "other_host=bf16+ranks_per_host=2") == (
        "same_host=fp16/noop+other_host=fp16/bf16+ranks_per_host=2"
    )


def test_two_hosts_of_two_ranks_on_loopback(
    no_launcher: pytest.MonkeyPatch, tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hosts.json"
    argv = ["bench", "--world-size", "4", "--ranks-per-host", "2", "--quick", "--sizes", "64K"]
    argv += ["--codec-size", "64K", "--rounds", "2", "--codecs", f"int8,{POLICY}"]
    argv += ["--ops", "pooled,all_reduce", "--no-fbgemm", "--json", str(out)]
    assert cli_main(argv) == 0
    assert "4 ranks as 2 hosts of 2" in capfd.readouterr().out  # rank 0's, a process
    results = json.loads(out.read_text())
    assert results["meta"]["ranks_per_host"] == 2
    rows = {r["codec"]: r for r in results["codecs"]}
    assert [r["codec"] for r in results["codecs"]] == ["noop", "int8", POLICY]
    int8, policy = rows["int8"], rows[POLICY]
    assert policy["status"] == "ok" and policy["crossing_share"] == 0.5
    assert policy["compression_ratio"] == pytest.approx(int8["compression_ratio"], rel=1e-3)
    assert policy["bits_per_element"] == pytest.approx(int8["bits_per_element"], rel=1e-3)
    ratio = policy["rms_rel_error"] / int8["rms_rel_error"]
    assert 0.6 < ratio < 0.8, ratio  # sqrt(1/2): half the elements cross hosts
    points = {(p["op"], p["label"]): p for p in results["collectives"]}
    for op in ("pooled_embeddings_all_to_all", "all_reduce"):
        for label in ("noop", "int8", POLICY):
            p = points[op, label]
            assert p["status"] == "ok" and p["latency_s"] > 0, (op, label, p["error"])
    # The collective's output against the exact one: on 2 hosts of 2, rank 0
    # gets its own block and its host peer's exact, where int8 encodes the
    # peer's too (sqrt(5.3 / 6.9) of int8's error, the inputs scaled by rank).
    # Were the ranks one host it would be exact; were each a host, int8's.
    a2a = "pooled_embeddings_all_to_all"
    mine, theirs = points[a2a, POLICY]["rms_rel_error"], points[a2a, "int8"]["rms_rel_error"]
    assert 0.8 < mine / theirs < 0.95, (mine, theirs)
    assert points[a2a, POLICY]["compression_ratio"] == points[a2a, "int8"]["compression_ratio"]
    # The all-reduce by host is hierarchical: every element crosses hosts
    # once each way, as int8's, and half as many bytes do.
    ar = "all_reduce"
    mine, theirs = points[ar, POLICY]["rms_rel_error"], points[ar, "int8"]["rms_rel_error"]
    assert mine == pytest.approx(theirs, rel=0.2)
    assert points[ar, POLICY]["compression_ratio"] == pytest.approx(
        2 * points[ar, "int8"]["compression_ratio"]
    )
    assert points[ar, POLICY]["link_bytes"] == pytest.approx(points[ar, "int8"]["link_bytes"] / 2)
    assert results["advice"]["rates"]


def test_a_training_step_with_the_hook_by_host(
    no_launcher: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # Hosts of several ranks add a series: the DDP hook by host, which trains
    # as the default hook does.
    out = tmp_path / "train.json"
    argv = ["bench", "--train", "--train-model", "mlp", "--world-size", "4"]
    argv += ["--ranks-per-host", "2", "--quick", "--json", str(out)]
    assert cli_main(argv) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["train"]["series"]}
    by_host = rows["qcomm int8 between hosts + error feedback"]
    assert by_host["status"] == "ok", by_host["error"]
    assert by_host["ddp_hook"] == f"qcomm {POLICY}+ef"
    assert by_host["step_s"] > 0
    assert by_host["losses"][-1] == pytest.approx(rows["default hook"]["losses"][-1], rel=1e-4)
