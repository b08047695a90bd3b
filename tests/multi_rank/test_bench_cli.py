"""`qcomm bench`: one quick run on 2 local gloo ranks checked figure by figure,
the pure functions behind the figures against hand-computed values, and the
option parsing and failure paths of the command."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import re
import time

import pytest
import torch
from fake_dists import activate, make_dist

import qcomm
from qcomm import CodecError, CommOp, codec_info
from qcomm.benchmark.candidates import default_codecs
from qcomm.benchmark.command import config_from_args
from qcomm.benchmark.launch import spawn_local
from qcomm.benchmark.metrics import (
    TCP_EFFICIENCY,
    algorithm_bandwidth,
    break_even_bandwidth,
    bus_bandwidth,
    collective_break_even,
    error_stats,
    predicted_time,
    sqnr_db,
)
from qcomm.benchmark.options import (
    QUICK_SIZES,
    BenchConfig,
    format_size,
    parse_ops,
    parse_size,
    parse_sizes,
    split_codec_list,
)
from qcomm.benchmark.report import format_report, jsonable
from qcomm.benchmark.series import base_input, make_case
from qcomm.benchmark.timing import calls_for_budget
from qcomm.cli import build_parser
from qcomm.cli import main as cli_main

WORLD_SIZE = 2
OPS = [op.value for op in CommOp]
CODEC_FIGURES = [
    "wire_bytes_per_element",
    "bits_per_element",
    "compression_ratio",
    "encode_GBps",
    "decode_GBps",
    "encode_roofline_fraction",
    "decode_roofline_fraction",
    "max_rel_error",
    "rms_rel_error",
    "sqnr_db",
    "break_even_GBps",
]
POINT_FIGURES = ["latency_s", "algbw_GBps", "busbw_GBps", "speedup", "max_rel_error"]

# Two codecs that must show up as failed rows, not end the run: one whose
# plugin cannot be imported, one that raises when it encodes.
CRASHY_CODEC = """
import torch

class Codec:
    def encode(self, input_tensor, ctx=None):
        raise RuntimeError("crashy encode")

    def decode(self, input_grad, ctx=None):
        return input_grad

    @property
    def quantized_dtype(self):
        return torch.float32

    def calc_quantized_size(self, input_len, ctx=None):
        return input_len

    def create_context(self):
        return None

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
        return dim_per_rank[my_rank], 0
"""


# A codec that fails on rank 1 only: rank 0 is left waiting in the collective.
LOPSIDED_CODEC = CRASHY_CODEC.replace(
    'raise RuntimeError("crashy encode")',
    'if __import__("os").environ["RANK"] == "1":\n            raise RuntimeError("rank 1 only")\n'
    "        return input_tensor",
)


def _strict_json(path: pathlib.Path) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `qcomm bench --quick` on the default codecs (every discovered one but the
    example plugin's) plus two broken ones."""
    root = tmp_path_factory.mktemp("bench_plugins")
    make_dist(
        root,
        "bench-broken",
        "bench_broken_mod",
        "import no_such_module_xyz\n",
        {"bench_unloadable": "Codec"},
    )
    make_dist(root, "bench-crashy", "bench_crashy_mod", CRASHY_CODEC, {"bench_crashy": "Codec"})
    out = tmp_path_factory.mktemp("bench_out")
    with pytest.MonkeyPatch.context() as mp:
        activate(root, mp)
        # The ranks are separate processes: they find the plugins on PYTHONPATH.
        mp.setenv("PYTHONPATH", str(root), prepend=":")
        mp.delenv("QCOMM_PLUGINS", raising=False)
        names = default_codecs()
        assert "example_fp16_scaled" in qcomm.available_codecs()
        assert "example_fp16_scaled" not in names and "bench_crashy" in names
        status = cli_main(
            ["bench", "--quick", "--json", str(out / "out.json"), "--plot", str(out / "out.png")]
        )
    return status, names, _strict_json(out / "out.json"), out / "out.png"


def _positive_finite(row: dict, keys: list[str], where: str) -> None:
    for key in keys:
        value = row.get(key)
        assert isinstance(value, (int, float)), f"{where}: {key} is {value!r}"
        assert math.isfinite(value) and value > 0, f"{where}: {key} = {value!r}"


def test_quick_run_completes_and_reports_the_broken_codecs(quick_run):
    status, names, results, _ = quick_run
    assert status == 1  # completed, with failed qcomm codecs
    rows = {r["codec"]: r for r in results["codecs"]}
    assert [r["codec"] for r in results["codecs"] if r["source"] == "qcomm"][0] == "noop"
    assert {r["codec"] for r in results["codecs"] if r["source"] == "qcomm"} == set(names)
    assert rows["bench_unloadable"]["status"] == "failed"
    assert "no_such_module_xyz" in rows["bench_unloadable"]["error"]
    assert rows["bench_crashy"]["status"] == "failed"
    assert "crashy encode" in rows["bench_crashy"]["error"]
    for broken in ("bench_unloadable", "bench_crashy"):
        points = [p for p in results["collectives"] if p["codec"] == broken]
        assert len(points) == len(OPS) * len(QUICK_SIZES)
        assert all(p["status"] == "failed" and p["error"] for p in points)


def test_quick_run_meta(quick_run):
    _, _, results, _ = quick_run
    meta = results["meta"]
    assert meta["world_size"] == WORLD_SIZE
    assert meta["backend"] == "gloo" and meta["device"] == "cpu"
    assert meta["sizes"] == QUICK_SIZES and meta["ops"] == OPS and meta["quick"] is True
    assert 0 < meta["duration_s"] < 600
    _positive_finite(results["roofline"], ["copy_s", "copy_GBps"], "roofline")
    assert set(results["units"]) >= {"busbw_GBps", "break_even_GBps", "max_rel_error"}


def _working_codecs(names: list[str]) -> list[str]:
    return [n for n in names if not n.startswith("bench_")]


def test_quick_run_codec_figures(quick_run):
    _, names, results, _ = quick_run
    rows = {r["codec"]: r for r in results["codecs"]}
    copy_GBps = results["roofline"]["copy_GBps"]
    for name in _working_codecs(names):
        row = rows[name]
        assert row["status"] == "ok", f"{name}: {row['error']}"
        n = row["elements"]
        codec = qcomm.load_codec(name)
        expected = codec.calc_quantized_size(n, codec.create_context())
        assert row["wire_elements"] == row["calc_quantized_size"] == expected
        itemsize = torch.empty(0, dtype=getattr(torch, row["wire_dtype"])).element_size()
        assert row["wire_bytes_per_element"] == pytest.approx(expected * itemsize / n)
        assert row["bits_per_element"] == pytest.approx(8 * row["wire_bytes_per_element"])
        assert row["compression_ratio"] == pytest.approx(4 / row["wire_bytes_per_element"])
        assert row["declared_bits_per_element"] == codec_info(codec).bits_per_element
        logical, wire = 4 * n, row["wire_bytes_per_element"] * n
        assert row["encode_GBps"] == pytest.approx(logical / row["encode_s"] / 1e9)
        assert row["encode_roofline_fraction"] == pytest.approx(row["encode_GBps"] / copy_GBps)
        assert row["decode_roofline_fraction"] == pytest.approx(row["decode_GBps"] / copy_GBps)
        assert row["break_even_GBps"] == pytest.approx(
            break_even_bandwidth(wire, logical, row["encode_s"], row["decode_s"]) / 1e9
        )
        if name == "noop":
            assert row["max_rel_error"] == 0 and row["rms_rel_error"] == 0
            assert row["sqnr_db"] is None  # infinite: exact
            assert row["compression_ratio"] == 1 and row["break_even_GBps"] == 0
            continue
        _positive_finite(row, CODEC_FIGURES, name)
        assert row["sqnr_db"] == pytest.approx(-20 * math.log10(row["rms_rel_error"]))
        # The declared bound |e_i| <= rel * s_i + abs, with every scale s_i at
        # most max|x| and max|x| > 1 for 2**18 normal samples, gives:
        info = codec_info(codec)
        if info.max_abs_input <= 1:
            # A clamping codec (fp8_e4m3_tensor) holds its bound only for
            # inputs up to max_abs_input; the bench reports what it does to
            # the data beyond, which is the figure a user needs.
            continue
        assert row["max_rel_error"] <= info.rel_error_bound + info.abs_error_bound, name


def test_quick_run_json_gives_the_planner_its_codec_rates(quick_run):
    # The planner reads a real bench file: each working qcomm codec's rates
    # as the run measured them, the copy's from the roofline.
    _, names, results, _ = quick_run
    profile = qcomm.profile_from_bench(results)
    rows = {r["codec"]: r for r in results["codecs"] if r["source"] == "qcomm"}
    measured = [n for n in _working_codecs(names) if n != "noop"]
    assert measured
    for name in measured:
        assert profile.encode_Bps[name] == pytest.approx(1e9 * rows[name]["encode_GBps"])
        assert profile.decode_Bps[name] == pytest.approx(1e9 * rows[name]["decode_GBps"])
    assert profile.copy_Bps == pytest.approx(1e9 * results["roofline"]["copy_GBps"])
    assert profile.source == "bench"


def test_quick_run_fbgemm_rows(quick_run):
    _, names, results, _ = quick_run
    if results["unavailable"]["fbgemm"]:
        pytest.skip(results["unavailable"]["fbgemm"])
    rows = {r["codec"]: r for r in results["codecs"] if r["source"] == "fbgemm"}
    assert set(rows) == {"fbgemm:fp16", "fbgemm:bf16", "fbgemm:int8", "fbgemm:fp8", "fbgemm:mx4"}
    qcomm_rows = {r["codec"]: r for r in results["codecs"]}
    for label, row in rows.items():
        # Every one runs, fbgemm's tensor-wise FP8 too (it sees rows of 32).
        assert row["status"] == "ok", (label, row["error"])
        _positive_finite(row, CODEC_FIGURES, label)
    # fbgemm's fp16 and bf16 are the same casts as qcomm's: the same error.
    for fmt in ("fp16", "bf16"):
        assert rows[f"fbgemm:{fmt}"]["max_rel_error"] == pytest.approx(
            qcomm_rows[fmt]["max_rel_error"], rel=1e-6
        )


@functools.cache
def _extremes(op: CommOp, size: int) -> tuple[float, float]:
    """Largest input magnitude over the ranks, smallest max|expected output|."""
    base = base_input(size, world_size=WORLD_SIZE, dim=128, seed=0)
    cpu = torch.device("cpu")
    cases = [
        make_case(op, base, rank=r, world_size=WORLD_SIZE, device=cpu) for r in range(WORLD_SIZE)
    ]
    largest_input = max(c.input.abs().max().item() for c in cases)
    return largest_input, min(c.expected.abs().max().item() for c in cases)


def _collective_bound(info: qcomm.CodecInfo, op: CommOp, size: int) -> float:
    """Largest max_rel_error the declared bound allows for `op` on the bench's inputs.

    Each output element is the sum of `terms` decoded values; each decoded
    value is off by at most rel * s + abs, s at most the sender's max|input|.
    A summable codec summed on the wire rounds the sum once more (rel * |sum|).
    """
    largest_input, smallest_output = _extremes(op, size)
    terms = WORLD_SIZE if op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER else 1
    bound = terms * (info.rel_error_bound * largest_input + info.abs_error_bound) / smallest_output
    if info.summable and terms > 1:
        bound += info.rel_error_bound
    return bound


def test_quick_run_collective_figures(quick_run):
    _, names, results, _ = quick_run
    points = {(p["op"], p["label"], p["size_bytes"]): p for p in results["collectives"]}
    for op in OPS:
        for size in QUICK_SIZES:
            noop = points[(op, "noop", size)]
            assert noop["status"] == "ok", noop["error"]
            assert noop["speedup"] == 1.0 and noop["baseline"] == "noop"
            # Float32 moved as is (a sum of two floats is exact in any order).
            assert noop["max_rel_error"] == 0.0
            for name in _working_codecs(names):
                p = points[(op, name, size)]
                where = f"{op} {format_size(size)} {name}"
                assert p["status"] == "ok", f"{where}: {p['error']}"
                _positive_finite(p, ["latency_s", "algbw_GBps", "busbw_GBps", "speedup"], where)
                assert p["calls"] >= 3
                assert p["algbw_GBps"] == pytest.approx(size / p["latency_s"] / 1e9)
                # nccl-tests: busbw = algbw * (n - 1) / n for all-to-all and reduce-scatter.
                assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] / 2)
                assert p["speedup"] == pytest.approx(noop["latency_s"] / p["latency_s"])
                info = codec_info(qcomm.load_codec(name))
                bound = _collective_bound(info, CommOp(op), size)
                if info.max_abs_input <= 1:  # clamping: see the codec figures
                    bound = math.inf
                assert 0 <= p["max_rel_error"] <= bound, where


def test_quick_run_torchrec_rows(quick_run):
    _, _, results, _ = quick_run
    if results["unavailable"]["torchrec"] or results["unavailable"]["fbgemm"]:
        pytest.skip(results["unavailable"]["torchrec"] or results["unavailable"]["fbgemm"])
    op = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value
    torchrec = [p for p in results["collectives"] if p["impl"] == "torchrec"]
    assert {p["op"] for p in torchrec} == {op}
    labels = {p["label"] for p in torchrec}
    assert labels >= {"torchrec[none]", "torchrec[fbgemm:int8]", "torchrec[fbgemm:fp16]"}
    for p in torchrec:
        assert p["baseline"] == "torchrec[none]"
        if p["status"] != "ok":
            assert p["error"]
            continue
        _positive_finite(p, ["latency_s", "busbw_GBps", "speedup"], p["label"])
        if p["codec"] == "none":
            assert p["speedup"] == 1.0 and p["max_rel_error"] == 0.0
    # TorchRec's int8 through its own all-to-all errs like fbgemm's int8 codec on its own.
    int8 = {p["size_bytes"]: p for p in torchrec if p["codec"] == "fbgemm:int8"}
    assert all(p["status"] == "ok" and p["max_rel_error"] < 0.01 for p in int8.values())
    fp8 = [p for p in torchrec if p["codec"] == "fbgemm:fp8"]
    assert fp8 and all(p["status"] == "ok" for p in fp8), [p["error"] for p in fp8]


def test_quick_run_plot_is_a_png(quick_run):
    _, _, _, png = quick_run
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # four panels of lines and points, not an empty canvas


def test_a_codec_failing_on_one_rank_times_out_and_the_run_goes_on(tmp_path, monkeypatch):
    make_dist(
        tmp_path, "bench-lopsided", "bench_lopsided_mod", LOPSIDED_CODEC, {"lopsided": "Codec"}
    )
    activate(tmp_path, monkeypatch)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path), prepend=":")
    argv = ["bench", "--codecs", "lopsided", "--no-fbgemm", "--ops", "pooled,seq"]
    argv += ["--sizes", "64K", "--codec-size", "64K", "--budget", "0.01", "--timeout", "2"]
    assert cli_main([*argv, "--json", str(tmp_path / "out.json")]) == 1
    results = _strict_json(tmp_path / "out.json")
    row = results["codecs"][1]
    assert row["codec"] == "lopsided" and row["status"] == "failed"
    assert row["error"] == "rank 1: RuntimeError: rank 1 only"
    points = {(p["op"], p["codec"]): p for p in results["collectives"]}
    for op in ("pooled_embeddings_all_to_all", "sequence_embeddings_all_to_all"):
        assert points[(op, "lopsided")]["status"] == "failed"
        # The cause comes first, rank 0's timeout (or its error naming rank 1) after it.
        error = points[(op, "lopsided")]["error"]
        assert error.startswith("rank 1: ") and error.index("rank 1 only") < error.index("rank 0")
        # A fresh work group after the failure: the next collective runs.
        assert points[(op, "noop")]["status"] == "ok"
        assert points[(op, "noop")]["max_rel_error"] == 0.0


def test_a_crashing_rank_ends_the_run_with_an_error(capfd):
    # dim=0 makes every rank raise while building its first collective input.
    config = BenchConfig(
        codecs=["noop"], sizes=[65536], fbgemm=False, budget=0.001, codec_bytes=4096, dim=0
    )
    assert spawn_local(config) == 2
    err = capfd.readouterr().err
    assert "exited with status 2" in err and "the run was stopped" in err
    assert "ZeroDivisionError" in err


# The pure functions, against hand-computed values.


def test_bandwidths_like_nccl_tests():
    assert algorithm_bandwidth(64 << 20, 0.01) == pytest.approx(6710886400.0)
    assert bus_bandwidth(10.0, 2) == 5.0
    assert bus_bandwidth(10.0, 8) == 8.75
    assert bus_bandwidth(10.0, 1) == 0.0
    with pytest.raises(ValueError, match="seconds"):
        algorithm_bandwidth(1.0, 0.0)
    with pytest.raises(ValueError, match="world_size"):
        bus_bandwidth(1.0, 0)


def test_break_even_bandwidth():
    # int8-like: 1.25 wire bytes per 4 logical; 1 ms encode + 1 ms decode of 4 MB.
    # (1 - 1.25/4) / (2e-3 s / 4e6 B) = 0.6875 / 5e-10 = 1.375e9 B/s.
    assert break_even_bandwidth(1.25e6, 4e6, 1e-3, 1e-3) == pytest.approx(1.375e9)
    assert break_even_bandwidth(2.0, 4.0, 0.0, 0.0) == math.inf
    assert break_even_bandwidth(5.0, 4.0, 1.0, 1.0) == 0.0  # grows the message
    with pytest.raises(ValueError, match="logical_bytes"):
        break_even_bandwidth(1.0, 0.0, 1.0, 1.0)


def test_sqnr_and_error_stats():
    assert sqnr_db(1000.0, 1.0) == pytest.approx(30.0)
    assert sqnr_db(0.0, 0.0) != sqnr_db(0.0, 0.0)  # nan: no signal, no noise
    x = torch.tensor([3.0, -4.0, 0.0, 0.0])
    stats = error_stats(x, torch.tensor([3.0, -4.0, 0.5, 0.0]))
    # max |e| / max |x| = 0.5 / 4; sqrt(0.25 / 25) = 0.1; 10 log10(25 / 0.25) = 20 dB.
    assert stats.max_rel == pytest.approx(0.125)
    assert stats.rms_rel == pytest.approx(0.1)
    assert stats.sqnr_db == pytest.approx(20.0)
    exact = error_stats(x, x.clone())
    assert exact.max_rel == 0 and exact.rms_rel == 0 and exact.sqnr_db == math.inf
    with pytest.raises(ValueError, match="elements"):
        error_stats(x, x[:2])


def test_timing_budget_and_json_values():
    assert calls_for_budget(0.001, 0.25, 3, 200) == 200
    assert calls_for_budget(0.1, 0.25, 3, 200) == 3
    assert calls_for_budget(0.01, 0.25, 3, 200) == 25
    assert jsonable({"a": [math.inf, -math.inf, math.nan, 1.5]}) == {"a": [None, None, None, 1.5]}


def test_size_and_op_options():
    assert parse_size("64K") == 65536 and parse_size("64kib") == 65536
    assert parse_size("1M") == 1 << 20 and parse_size("2G") == 2 << 30
    assert parse_sizes("64M, 64K,1M") == [65536, 1 << 20, 64 << 20]
    assert format_size(64 << 20) == "64M" and format_size(100) == "100"
    for bad in (",", "0", "1.5M", "64T", "-1K"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_sizes(bad)
    assert parse_ops("rs,pooled") == [
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
        CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
    ]
    assert parse_ops("SEQUENCE_EMBEDDINGS_ALL_TO_ALL") == [CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL]
    with pytest.raises(ValueError, match="--ops: unknown collective 'allreduce'"):
        parse_ops("allreduce")


def test_codec_lists_keep_options_with_their_codec():
    assert split_codec_list("int8:row_dim=64,fp16") == ["int8:row_dim=64", "fp16"]
    assert split_codec_list("int8:row_dim=64,stochastic=true,mx4;fp16:x=1,y=2") == [
        "int8:row_dim=64,stochastic=true",
        "mx4",
        "fp16:x=1,y=2",
    ]
    assert split_codec_list("a:k=v:w,b") == ["a:k=v:w", "b"]
    with pytest.raises(CodecError, match="comes before any codec name"):
        split_codec_list("row_dim=64,int8")


def _config(*argv: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(["bench", *argv]))


def test_bench_options(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    config = _config()
    assert config.codecs is None and config.world_size == 2 and config.sizes[0] == 64 << 10
    assert config.sizes[-1] == 64 << 20 and config.ops == OPS and config.fbgemm
    quick = _config(
        "--quick", "--codecs", "int8:row_dim=64,fp16", "--codec", "mx4:group_size=16,rounding=floor"
    )
    assert quick.codecs == ["int8:row_dim=64", "fp16", "mx4:group_size=16,rounding=floor"]
    # A named codec that cannot be built stops the run before any rank starts.
    with pytest.raises(ValueError, match=r"--codecs: 'mx4:a=1,b=2' cannot be used: .* a, b"):
        _config("--codec", "mx4:a=1,b=2")
    with pytest.raises(ValueError, match="--codecs: 'nosuch' cannot be used: unknown codec"):
        _config("--codecs", "int8,nosuch")
    assert _config("--link-gbps", "25").link_gbps == 25.0
    assert _config().command is not None
    assert quick.sizes == QUICK_SIZES and quick.budget < config.budget
    assert _config("--quick", "--sizes", "4M", "--budget", "1").sizes == [4 << 20]
    assert _config("--ops", "seq", "--no-fbgemm").ops == ["sequence_embeddings_all_to_all"]
    with pytest.raises(ValueError, match="--world-size: expected at least 2"):
        _config("--world-size", "1")
    with pytest.raises(ValueError, match="--json: the folder"):
        _config("--json", str(tmp_path / "missing" / "out.json"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert _config().world_size == 4  # the launcher's ranks
    with pytest.raises(ValueError, match="--world-size: the launcher started 4 ranks, got 2"):
        _config("--world-size", "2")


def test_bad_options_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--sizes", "64T"])
    assert exit_info.value.code == 2
    assert "--sizes: expected a positive size" in capsys.readouterr().err
    assert cli_main(["bench", "--world-size", "1"]) == 2
    assert "--world-size" in capsys.readouterr().err
    started = time.monotonic()
    assert cli_main(["bench", "--codecs", "int8:row_dim=0"]) == 2
    assert time.monotonic() - started < 30  # before any rank starts
    assert "--codecs: 'int8:row_dim=0' cannot be used" in capsys.readouterr().err


def test_quick_run_model_figures_and_advice(quick_run):
    _, _, results, _ = quick_run
    ours = [p for p in results["collectives"] if p["impl"] == "qcomm" and p["status"] == "ok"]
    for p in ours:
        # On loopback the time with no link limit is the measured time.
        assert p["unlimited_s"] == p["latency_s"] and p["link_bytes"] > 0, p["label"]
        bound = p["size_bytes"] / 2 / p["compression_ratio"] / TCP_EFFICIENCY
        assert p["link_bytes"] == pytest.approx(bound)
        if p["codec"] != "noop":
            assert p["pays_at_every_rate"] in (True, False), p["label"]
            if not p["pays_at_every_rate"]:
                assert p["break_even_gbit_per_s"] >= 0, p["label"]
    for row in results["codecs"]:
        if row["status"] == "ok":
            assert min(len(s) for s in row["encode_samples_s"]) >= 15
            assert 0 <= row["spread"] < math.inf
    meta = results["meta"]
    assert meta["command"] and meta["cpu_model"] and meta["load_before"] is not None
    text = format_report(results)
    assert "expected on a link of 1 Gbit/s" in text and "100 Gbit/s" in text
    specs = re.findall(r"QCOMM_CODECS='([^']*)'", text)
    assert len(specs) == 3
    for spec in specs:
        registry = qcomm.build_registry(spec)  # what the report says to paste works
        assert set(registry) == {op.name for op in CommOp}


def test_model_of_collective_time():
    assert predicted_time(3e6, 1e9, 0.004) == pytest.approx(0.005)
    assert predicted_time(0.0, 1e9, 0.004) == 0.004
    assert predicted_time(1e9, 1e9, 0.0) == 1.0
    with pytest.raises(ValueError, match="rate"):
        predicted_time(1.0, 0.0, 1.0)
    # Break-even: where the two predicted times are equal.
    rate = collective_break_even(4e6, 0.003, 1e6, 0.005)
    assert predicted_time(4e6, rate, 0.003) == pytest.approx(predicted_time(1e6, rate, 0.005))
    assert collective_break_even(4e6, 0.005, 1e6, 0.003) == math.inf  # cheaper and smaller
    assert collective_break_even(4e6, 0.003, 4e6, 0.005) == 0.0  # saves no bytes


# Options refused up front (issue 13): nothing a user types ends in a traceback,
# and nothing found wrong at the end loses the run.


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--timeout", "inf", "--timeout: expected a number from"),
        ("--timeout", "nan", "--timeout: expected a number from"),
        ("--timeout", "1e300", "--timeout: expected a number from"),
        ("--budget", "inf", "--budget: expected a number from"),
        ("--budget", "0", "--budget: expected a number from"),
        ("--link-gbps", "inf", "--link-gbps: expected a number from"),
        ("--seed", "1e23", "--seed: expected a whole number from 0 to 4294967295"),
        ("--seed", "100000000000000000000000", "--seed: expected a whole number from 0 to"),
        ("--seed", "-1", "--seed: expected a whole number from 0 to"),
        ("--rounds", "1000000000000", "--rounds: expected a whole number from 1 to"),
        ("--world-size", "1000000", "--world-size: expected a whole number from 1 to"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", option, value])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_sizes_this_machine_cannot_hold_are_refused_up_front(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"--sizes: 100G per rank needs at least .* of memory"):
        _config("--sizes", "64K,100G")
    with pytest.raises(ValueError, match=r"--codec-size: 100G per rank needs at least"):
        _config("--codec-size", "100G")
    started = time.monotonic()
    assert cli_main(["bench", "--sizes", "100G"]) == 2
    assert time.monotonic() - started < 30  # before any rank starts
    assert "--sizes: 100G per rank" in capsys.readouterr().err
    assert _config("--sizes", "64M").sizes == [64 << 20]


def test_output_paths_are_checked_before_any_rank_starts(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for option in ("--json", "--plot"):
        with pytest.raises(ValueError, match=rf"{option}: .* is a folder"):
            _config(option, str(tmp_path))
        with pytest.raises(ValueError, match=rf"{option}: cannot write"):
            _config(option, "/proc/qcomm-bench-out")
    with pytest.raises(ValueError, match="--plot: the same file as --json"):
        _config("--json", str(tmp_path / "a"), "--plot", str(tmp_path / "a"))
    config = _config("--json", str(tmp_path / "out.json"))
    assert config.json_path == str(tmp_path / "out.json")
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing behind


def test_figures_survive_an_output_that_fails_at_the_end(monkeypatch, tmp_path, capsys):
    from qcomm.benchmark import report

    monkeypatch.setattr(report, "format_report", lambda results: "TABLE")
    gone = tmp_path / "gone"
    gone.mkdir()
    target = gone / "out.json"
    gone.rmdir()  # removed while the run went on
    report.write_report({"meta": {"host": "42"}}, json_path=str(target))
    captured = capsys.readouterr()
    assert captured.out.startswith("TABLE")
    fallback = re.search(r"written to (\S+) instead", captured.err)
    assert fallback and str(target) in captured.err
    assert json.loads(pathlib.Path(fallback.group(1)).read_text())["meta"]["host"] == "42"
    pathlib.Path(fallback.group(1)).unlink()


def test_a_dangling_link_as_output_is_written_through_at_the_end(monkeypatch, tmp_path, capsys):
    from qcomm.benchmark import report

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "real").mkdir()
    link, target = tmp_path / "out.json", tmp_path / "real" / "figures.json"
    link.symlink_to(target)
    config = _config("--json", str(link))
    # The option check creates nothing at the target and keeps the link.
    assert link.is_symlink() and not target.exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out.json", "real"]
    monkeypatch.setattr(report, "format_report", lambda results: "TABLE")
    report.write_report({"meta": {"host": "42"}}, json_path=config.json_path)
    assert link.is_symlink() and json.loads(target.read_text())["meta"]["host"] == "42"
    # A link into a folder that does not exist is refused, and left as it was.
    nowhere = tmp_path / "nowhere.json"
    nowhere.symlink_to(tmp_path / "gone" / "figures.json")
    with pytest.raises(ValueError, match=r"--plot: the folder of .*nowhere\.json.* does not exist"):
        _config("--plot", str(nowhere))
    assert nowhere.is_symlink() and not (tmp_path / "gone").exists()


def test_a_block_that_does_not_divide_the_codec_tensor_fails_in_its_row(tmp_path):
    # 16384 elements: neither rows of 48 nor groups of 6 divide them. The
    # collectives' inputs fit the block, so the codec runs there.
    argv = ["bench", "--codecs", "int8:row_dim=48", "--codec", "mx4:group_size=6"]
    argv += ["--no-fbgemm", "--ops", "pooled", "--sizes", "64K", "--codec-size", "64K"]
    argv += ["--budget", "0.01", "--rounds", "1", "--json", str(tmp_path / "out.json")]
    assert cli_main(argv) == 1
    results = _strict_json(tmp_path / "out.json")
    rows = {r["codec"]: r for r in results["codecs"]}
    for spec in ("int8:row_dim=48", "mx4:group_size=6"):
        assert rows[spec]["status"] == "failed" and "16384 inputs" in rows[spec]["error"]
        point = next(p for p in results["collectives"] if p["codec"] == spec)
        assert point["status"] == "ok" and point["break_even_gbit_per_s"] is None


def test_the_json_reads_back_as_typed_results_and_writes_the_same_text(quick_run):
    from qcomm.benchmark.results import BenchMeta, Results, RunAdvice

    results = quick_run[2]
    typed = Results.of(results)
    assert isinstance(typed.meta, BenchMeta) and isinstance(typed.advice, RunAdvice)
    assert (
        typed.roofline is not None and typed.roofline.copy_GBps == results["roofline"]["copy_GBps"]
    )
    assert [r.codec for r in typed.codecs or []] == [r["codec"] for r in results["codecs"]]
    assert len(typed.collectives or []) == len(results["collectives"])
    assert [rate.registry for rate in typed.advice.rates] == [
        rate["registry"] for rate in results["advice"]["rates"]
    ]
    again = jsonable({**typed.to_json(), "units": results["units"]})
    assert json.dumps(again) == json.dumps(results)  # same keys, same order, same values
