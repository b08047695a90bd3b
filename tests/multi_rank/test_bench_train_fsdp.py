"""`qcomm bench --train --train-model fsdp`: one smoke run on 2 local gloo
ranks (a tiny MLP under FSDP2, every series) checked against its own samples
and FSDP float32's losses, and its options."""

from __future__ import annotations

import math
import statistics

import pytest
from bench_runs import bench_config, spawn_train

import qcomm
from qcomm.benchmark.harness import LOCAL
from qcomm.benchmark.options import TRAIN_MLP_DEFAULTS, TRAIN_MLP_QUICK
from qcomm.benchmark.train_fsdp import BF16, DEFAULT, fsdp_series


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `qcomm bench --train --train-model fsdp --quick` on 2 ranks: 5 steps."""
    return spawn_train(tmp_path_factory, "--train-model", "fsdp")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_smoke_run_has_every_series_with_its_figures(smoke):
    config, status, results = smoke
    assert status == 0, "a qcomm series failed"
    model, rows = results["train"]["model"], {r["label"]: r for r in results["train"]["series"]}
    assert list(rows) == [s.label for s in fsdp_series()]
    assert (model["name"], model["layers"], model["width"]) == (
        "fsdp",
        TRAIN_MLP_QUICK["layers"],
        TRAIN_MLP_QUICK["width"],
    )
    default, bf16 = rows[DEFAULT], rows[BF16]
    for r in rows.values():
        assert r["status"] == "ok", (r["label"], r["error"])
        assert r["step_s"] == statistics.median(r["samples_s"])
        assert _close(r["speedup"], default["step_s"] / r["step_s"])
        assert _close(r["vs_fp16_hook"], bf16["step_s"] / r["step_s"])
        if r["label"] != LOCAL:
            assert _close(r["loss_gap"], r["loss"] - default["loss"])
    assert rows["qcomm int8 grads + fp8 weights + error feedback"]["ddp_hook"] == (
        "qcomm int8/fp8_e4m3+ef"
    )


def test_qcomm_series_train_as_float32_does(smoke):
    # The same weights and batches: the first step's loss is float32's; after
    # 5 steps of SGD the losses stay within the weights' codec bound of it
    # (the loss is a mean of squares of what the weights give).
    _, _, results = smoke
    rows = {r["label"]: r["losses"] for r in results["train"]["series"]}
    default = rows[DEFAULT]
    for label, losses in rows.items():
        assert losses[0] == pytest.approx(default[0], rel=1e-2)
        if label.startswith("qcomm"):
            spec = "fp8_e4m3" if "fp8" in label else "int8"
            rho = qcomm.codec_info(qcomm.load_codec(spec)).rel_error_bound
            assert abs(losses[-1] - default[-1]) <= 2 * rho * default[-1], label


def test_fsdp_takes_the_mlps_sizes():
    config = bench_config("--train", "--train-model", "fsdp", "--train-layers", "3")
    assert (config.train_model, config.train_layers) == ("fsdp", 3)
    assert config.train_width == TRAIN_MLP_DEFAULTS["width"]
    with pytest.raises(ValueError, match="--train-tables: applies to --train-model dlrm"):
        bench_config("--train", "--train-model", "fsdp", "--train-tables", "4")
