"""The typed rows of `qcomm bench`: every field says what it means, the JSON's
`units` come from those texts, a row reads back from its JSON, and a real
run's JSON keeps the keys it has always had."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from qcomm.benchmark.report import TRAIN_MLP_UNITS, TRAIN_UNITS, UNITS
from qcomm.benchmark.rows import (
    CodecRow,
    DlrmRow,
    MlpRow,
    Point,
    TrainRow,
    column,
    from_json,
    to_json,
    units,
)
from qcomm.cli import main as cli_main

ROWS = [CodecRow, Point, DlrmRow, MlpRow]

# The JSON's keys, as users' scripts read them: a new column is added here too.
CODEC_KEYS = ["codec", "source", "summable", "status", "error"]
CODEC_FIGURES = [
    "elements",
    "wire_dtype",
    "wire_elements",
    "calc_quantized_size",
    "wire_bytes_per_element",
    "bits_per_element",
    "declared_bits_per_element",
    "compression_ratio",
    "encode_s",
    "decode_s",
    "encode_GBps",
    "decode_GBps",
    "encode_roofline_fraction",
    "decode_roofline_fraction",
    "max_rel_error",
    "rms_rel_error",
    "sqnr_db",
    "encode_samples_s",
    "decode_samples_s",
    "spread",
    "break_even_GBps",
    "crossing_share",
    "backward_compression_ratio",
]
POINT_KEYS = ["op", "impl", "codec", "label", "pass", "size_bytes", "status", "error"]
POINT_TIMINGS = [
    "max_rel_error",
    "rms_rel_error",
    "calls",
    "latency_s",
    "latency_min_s",
    "latency_max_s",
    "samples_s",
    "spread",
    "algbw_GBps",
    "busbw_GBps",
]
POINT_FIGURES = [
    "baseline",
    "speedup",
    "compression_ratio",
    "link_bound_s",
    "x_link_bound",
    "link_bytes",
    "unlimited_s",
    "unlimited_samples_s",
    "predicted_s",
    "measured_over_predicted",
    "vs_torchrec",
    "break_even_gbit_per_s",
    "pays_at_every_rate",
]
ALL_REDUCE_FIGURES = ["vs_allreduce_hook", "vs_fp16_compress_hook"]


@pytest.mark.parametrize("record", ROWS, ids=lambda r: r.__name__)
def test_every_field_says_what_it_means(record: type) -> None:
    for field in dataclasses.fields(record):
        assert isinstance(field.metadata.get("unit"), str), f"{record.__name__}.{field.name}"
        assert len(field.metadata["unit"]) > 5, f"{record.__name__}.{field.name}"


def test_the_units_are_made_from_the_fields() -> None:
    for table, records in ((UNITS, [CodecRow, Point]), (TRAIN_UNITS, [DlrmRow])):
        for record in records:
            for field in dataclasses.fields(record):
                key = field.metadata["key"] or field.name
                assert table[key] == field.metadata["unit"]
    assert TRAIN_MLP_UNITS == units(MlpRow) and "vs_fp16_hook" in TRAIN_MLP_UNITS
    assert "MSE" in TRAIN_MLP_UNITS["loss"] and "BCE" in TRAIN_UNITS["loss"]
    assert UNITS["pass"].startswith("'fwd'") and "advice" in UNITS

    @dataclasses.dataclass(kw_only=True)
    class Other:
        spread: float | None = column("something else")

    with pytest.raises(ValueError, match="Other.spread: two meanings for 'spread'"):
        units(Point, Other)


def _point(**figures: Any) -> Point:
    base: dict[str, Any] = {"op": "all_reduce", "impl": "qcomm", "codec": "int8", "label": "int8"}
    base.update(passes="fwd", size_bytes=64, status="ok")
    return Point(**{**base, **figures})


def test_a_row_that_did_not_run_leaves_its_measurements_out() -> None:
    ok = to_json(_point(latency_s=0.5, samples_s=[0.5]))
    assert list(ok) == POINT_KEYS + POINT_TIMINGS + POINT_FIGURES + ALL_REDUCE_FIGURES
    assert ok["pass"] == "fwd" and ok["latency_s"] == 0.5 and ok["calls"] is None
    failed = to_json(_point(status="failed", error="boom"))
    assert list(failed) == POINT_KEYS + POINT_FIGURES + ALL_REDUCE_FIGURES
    # Its warm-up ran, its timing did not: the error measured stays.
    warmed = to_json(_point(status="failed", error="boom", max_rel_error=0.01))
    assert list(warmed) == POINT_KEYS + ["max_rel_error"] + POINT_FIGURES + ALL_REDUCE_FIGURES
    other = to_json(dataclasses.replace(_point(), op="pooled_embeddings_all_to_all"))
    assert "vs_allreduce_hook" not in other and "vs_fp16_compress_hook" not in other
    codec = to_json(CodecRow(codec="x", source="qcomm", status="failed", error="no"))
    assert list(codec) == CODEC_KEYS
    train = to_json(DlrmRow(label="fp32", kind="fp32", status="skipped", error="why"))
    assert "step_s" not in train and "samples_s" not in train and train["loss"] is None


@pytest.mark.parametrize("record", [CodecRow, Point, DlrmRow, MlpRow], ids=lambda r: r.__name__)
def test_a_row_reads_back_from_its_json(record: type) -> None:
    required: dict[str, Any] = {
        (f.metadata["key"] or f.name): "x"
        for f in dataclasses.fields(record)
        if f.default is dataclasses.MISSING
    }
    if record is Point:
        required["size_bytes"] = 64
    row = from_json(record, {**required, "status": "ok", "spread": 0.25})
    assert isinstance(row, record) and row.spread == 0.25 and row.error is None
    assert from_json(record, json.loads(json.dumps(to_json(row)))) == row
    with pytest.raises(ValueError, match=rf"{record.__name__}: unknown key\(s\) sprea\b"):
        from_json(record, {**required, "sprea": 0.25})
    missing = next(iter(required))
    with pytest.raises(ValueError, match=rf"missing required key\(s\) {missing}"):
        from_json(record, {k: v for k, v in required.items() if k != missing})


def test_train_rows_share_their_figures() -> None:
    # The code that sets the training figures sees them on either model's row.
    common = {f.name for f in dataclasses.fields(TrainRow)}
    assert common <= {f.name for f in dataclasses.fields(DlrmRow)}
    assert common <= {f.name for f in dataclasses.fields(MlpRow)}


def test_a_real_runs_json_keeps_its_keys(tmp_path: Any) -> None:
    out = tmp_path / "out.json"
    argv = ["bench", "--codecs", "fp16,int8:row_dim=48", "--no-fbgemm", "--ops", "pooled,ar"]
    argv += ["--sizes", "64K", "--codec-size", "64K", "--budget", "0.01", "--rounds", "1"]
    assert cli_main([*argv, "--json", str(out)]) == 1  # int8:row_dim=48 fails on its own
    results = json.loads(out.read_text())
    assert list(results) == [
        "meta", "link", "roofline", "codecs", "collectives", "unavailable", "advice", "units",
    ]  # fmt: skip
    codecs = {r["codec"]: r for r in results["codecs"]}
    assert list(codecs["fp16"]) == CODEC_KEYS + CODEC_FIGURES
    assert list(codecs["int8:row_dim=48"]) == CODEC_KEYS
    for p in results["collectives"]:
        assert p["status"] == "ok", p
        extra = ALL_REDUCE_FIGURES if p["op"] == "all_reduce" else []
        assert list(p) == POINT_KEYS + POINT_TIMINGS + POINT_FIGURES + extra
    assert {p["op"] for p in results["collectives"]} == {
        "pooled_embeddings_all_to_all",
        "all_reduce",
    }
    assert set(results["units"]) >= set(CODEC_KEYS + CODEC_FIGURES + POINT_KEYS + POINT_FIGURES)


def test_results_read_back_refuse_a_key_they_do_not_know() -> None:
    from qcomm.benchmark.results import BenchMeta, LinkFigures, Results, TrainMeta

    with pytest.raises(ValueError, match="BenchMeta: unknown key.s. nosuch"):
        Results.of({"meta": {"nosuch": 1}})
    with pytest.raises(ValueError, match="RunAdvice: unknown key.s. rate;"):
        Results.of({"meta": {}, "advice": {"rate": []}})
    # A part a run does not have is None, and left out of the JSON.
    bench = Results.of({"meta": {"world_size": 2}, "link": {"spec": "1gbit", "bytes": 1}})
    assert isinstance(bench.meta, BenchMeta) and isinstance(bench.link, LinkFigures)
    assert list(bench.to_json()) == ["meta", "link"]
    train = Results.of({"meta": {"seed": 3}, "train": {"model": {"name": "mlp"}, "series": []}})
    assert isinstance(train.meta, TrainMeta) and train.meta.seed == 3 and train.mlp
