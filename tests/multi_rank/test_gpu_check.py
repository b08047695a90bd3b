"""The GPU check (``tools/gpu_check.py``), in its dry mode on CPU, and its pure helpers.

The dry run goes through the same logic as on a GPU (spawned gloo ranks at
world size 1 and 2, and 2 with ``QCOMM_TRANSPORT=all_to_all``); every check
of every codec must pass within its declared bound, and the forced setup must
have run on the all-to-all transport.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import qcomm
import qcomm.collectives._transport as transport

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()


def info(rel: float, block: int = 1) -> qcomm.CodecInfo:
    return qcomm.CodecInfo(name="t", bits_per_element=8, rel_error_bound=rel, error_block=block)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu_check") / "x.json"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--timeout", "200", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, report


def test_dry_run_passes_every_check_within_its_bound(
    dry_run: tuple[int, str, dict[str, Any]],
) -> None:
    returncode, output, report = dry_run
    assert returncode == 0, output
    assert report["mode"] == "dry-run" and report["passed"] is True
    rows = {(r["check"], r["setup"], r["codec"]): r for r in report["checks"]}
    expected = [
        (check, setup, codec)
        for setup in ("gloo/1 cpu", "gloo/2 cpu", "gloo/2 cpu a2a")
        for check in gc.COLLECTIVES
        for codec in gc.CODECS
    ] + [("encode_decode", "codec cpu", codec) for codec in gc.CODECS]
    assert sorted(rows) == sorted(expected)
    for key in expected:
        row = rows[key]
        assert row["status"] == "pass", (key, row)
        assert row["error"] <= row["bound"] and row["ratio"] <= 1, (key, row)
        assert str(row["host_syncs"]).startswith("skipped"), (key, row)
        if key[2] == "noop" and key[0] in ("pooled", "sequence", "encode_decode"):
            assert row["max_error"] == 0, (key, row)  # a copy is exact
    assert "PASSED" in output and "gloo/2 cpu a2a" in output


def test_dry_run_forces_the_all_to_all_transport(dry_run: tuple[int, str, dict[str, Any]]) -> None:
    _, output, report = dry_run
    setups = {s["name"]: s for s in report["setups"]}
    assert setups["gloo/2 cpu a2a"]["env"] == {"QCOMM_TRANSPORT": "all_to_all"}, output
    assert setups["gloo/2 cpu"]["env"] == {}
    assert all(s["error"] is None for s in setups.values()), output
    if hasattr(transport, "opened"):
        forced = setups["gloo/2 cpu a2a"]["transports_opened"]
        assert forced.get("OneAllToAll", 0) > 0 and "PointToPoint" not in forced, forced
        assert setups["gloo/2 cpu"]["transports_opened"].get("PointToPoint", 0) > 0


def test_dry_run_times_codecs_on_cpu(dry_run: tuple[int, str, dict[str, Any]]) -> None:
    _, output, report = dry_run
    timing = report["timing"]
    assert timing["device"] == "cpu" and "skipped" in timing["note"], output
    assert sorted(t["codec"] for t in timing["rows"]) == sorted(gc.FBGEMM)
    for t in timing["rows"]:
        assert t["qcomm_encode_gbps"] > 0 and t["qcomm_decode_gbps"] > 0, t
        assert "fbgemm_encode_gbps" in t or "fbgemm_error" in t, t


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is CUDA here")
def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA" in proc.stderr and "--dry-run" in proc.stderr
    assert not out.exists()


def test_bounds() -> None:
    exact = info(0.0)
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5])
    # No codec: only the float32 rounding of the one addition.
    assert torch.equal(gc.sum_bound([a, b], exact), gc.U32 * (a.abs() + b.abs()).double())
    ref, bound = gc.expect_cat([a, b], 0, info(0.5, block=32))
    # A block codec's scale is each part's largest magnitude.
    assert bound.tolist() == [1.0, 1.0, 1.5, 1.5] and ref.dtype == torch.float64
    assert gc.offsets([2, 0, 3]) == [0, 2, 2, 5]


def test_score() -> None:
    ref, bound = torch.tensor([1.0, 2.0]).double(), torch.tensor([0.5, 0.0]).double()
    assert gc.score([torch.tensor([1.25, 2.0])], [(ref, bound)])["ratio"] == 0.5
    assert gc.score([torch.tensor([1.0, 2.5])], [(ref, bound)])["ratio"] == math.inf
    assert gc.score([torch.tensor([math.nan, 2.0])], [(ref, bound)])["ratio"] == math.inf
    with pytest.raises(AssertionError, match="shape"):
        gc.score([torch.zeros(3)], [(ref, bound)])


def test_merge_rows_passes_only_where_every_rank_passed() -> None:
    ok: dict[str, Any] = {"check": "pooled", "codec": "int8", "status": "pass"}
    ok.update(host_syncs={"call": 0}, max_error=0.1, error=0.1, bound=1.0, ratio=0.1)
    bad = {**ok, "status": "fail", "error": 2.0, "ratio": 2.0, "message": "beyond"}
    keys = [("pooled", "int8"), ("ddp", "int8")]
    merged = gc.merge_rows("nccl/1 cuda", keys, [[ok], [bad]], None)
    assert [r["status"] for r in merged] == ["fail", "fail"]
    assert merged[0]["ratio"] == 2.0 and merged[0]["message"] == "rank 1: beyond"
    assert "not reported" in merged[1]["message"]
    assert gc.merge_rows("s", keys[:1], [[ok], [ok]], None)[0]["status"] == "pass"
    assert gc.cell(merged[0]) == "FAIL 2 s0" and gc.cell(None) == "-"


def test_setups() -> None:
    dry = gc.setups(True)
    assert [s["name"] for s in dry] == ["gloo/1 cpu", "gloo/2 cpu", "gloo/2 cpu a2a", "codec cpu"]
    gpu = {s["name"]: s for s in gc.setups(False)}
    assert gpu["nccl/1 cuda"]["world"] == 1 and gpu["gloo/2 cpu a2a"]["device"] == "cpu"
    assert gpu["gloo/2 cuda a2a"]["env"] == {"QCOMM_TRANSPORT": "all_to_all"}
    assert "cross_stream" in gc.kinds_of(gpu["gloo/2 cuda"])
    assert gc.kinds_of(gpu["codec cuda"]) == ("encode_decode",)
