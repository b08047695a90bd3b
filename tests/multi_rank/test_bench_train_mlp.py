"""`qcomm bench --train --train-model mlp`: one smoke run on 2 local gloo ranks
(a tiny MLP under DDP, every hook) checked against its own samples and the
default hook's losses, and the options, refused before any rank starts."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from bench_runs import LAUNCHER_VARS, bench_config, spawn_train

import qcomm
from qcomm.benchmark.harness import LOCAL
from qcomm.benchmark.options import (
    TRAIN_DEFAULTS,
    TRAIN_MLP_DEFAULTS,
    TRAIN_MLP_QUICK,
    TRAIN_WARM_UP_STEPS,
    BenchConfig,
)
from qcomm.benchmark.train_mlp import (
    DEFAULT_HOOK,
    FP16_HOOK,
    QCOMM_HOOK,
    QCOMM_SYNC,
    mlp_parameters,
    mlp_series,
)
from qcomm.cli import build_parser

U32 = 2.0**-24  # float32's unit roundoff


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `qcomm bench --train --train-model mlp --quick` on 2 ranks: 5 steps."""
    return spawn_train(tmp_path_factory, "--train-model", "mlp")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_smoke_run_has_every_series_with_its_figures(smoke):
    config, status, results = smoke
    assert status == 0, "a qcomm series failed"
    model, rows = results["train"]["model"], {r["label"]: r for r in results["train"]["series"]}
    assert list(rows) == [s.label for s in mlp_series()]
    assert (model["name"], model["layers"], model["width"]) == (
        "mlp",
        TRAIN_MLP_QUICK["layers"],
        TRAIN_MLP_QUICK["width"],
    )
    assert model["parameters"] == mlp_parameters(model["layers"], model["width"])
    assert sum(model["steps_per_round"]) == config.train_steps - TRAIN_WARM_UP_STEPS
    default, fp16, local = rows[DEFAULT_HOOK], rows[FP16_HOOK], rows[LOCAL]
    for r in rows.values():
        assert r["status"] == "ok", (r["label"], r["error"])
        samples = r["samples_s"]
        assert len(samples) == config.rounds
        assert all(math.isfinite(x) and x > 0 for x in samples)
        assert r["step_s"] == statistics.median(samples)
        assert r["step_min_s"] == min(samples) and r["step_max_s"] == max(samples)
        assert _close(r["speedup"], default["step_s"] / r["step_s"])
        assert _close(r["vs_fp16_hook"], fp16["step_s"] / r["step_s"])
        assert len(r["losses"]) == config.train_steps
        assert all(math.isfinite(x) and x > 0 for x in r["losses"])
        if r is local:
            assert r["loss"] is None and r["comm_share"] is None
            continue
        assert _close(r["comm_share"], 1 - local["step_s"] / r["step_s"])
        assert r["loss"] == r["losses"][-1]
        assert _close(r["loss_gap"], r["loss"] - default["loss"])
    assert [rows[label]["ddp_hook"] for label in (DEFAULT_HOOK, FP16_HOOK, QCOMM_HOOK)] == [
        None,
        "fp16_compress_hook",
        "qcomm int8+ef",
    ]
    assert set(results["units"]) >= {"step_s", "speedup", "vs_fp16_hook", "comm_share", "loss"}


def test_the_hooks_train_as_the_default_hook_does(smoke):
    _, _, results = smoke
    rows = {r["label"]: r["losses"] for r in results["train"]["series"]}
    default, local = rows[DEFAULT_HOOK], rows[LOCAL]
    # The same weights and batches: every first step (before any update) has
    # the same loss, the reference's (the mean of each rank's) included.
    assert len({losses[0] for losses in rows.values()}) == 1
    # Waiting for the hook changes when the buckets travel, not what they carry.
    assert rows[QCOMM_SYNC] == rows[QCOMM_HOOK]
    # Training alone, a rank steps with its own gradient instead of the mean:
    # a gradient error of the gradient's own scale, and what it does to the
    # loss. The hook's error is at most 2 rho of the gradient's scale (reduce
    # and gather codecs, rho their declared relative bound), twice that with
    # error feedback (a step carries the last one's residual): its losses may
    # stray by that share of the reference's distance, plus float32 rounding
    # of the loss (other weights round the forward's sums otherwise).
    for label, spec in ((QCOMM_HOOK, "int8"), (FP16_HOOK, "fp16")):
        rho = qcomm.codec_info(qcomm.load_codec(spec)).rel_error_bound
        for step in range(1, len(default)):
            reference = abs(local[step] - default[step])
            assert reference > 0, "the updates must move the loss for the check to mean anything"
            bound = 4 * rho * reference + 4 * U32 * abs(default[step])
            assert abs(rows[label][step] - default[step]) <= bound, (label, step)
    # By the last step the updates moved the loss far beyond that rounding.
    assert abs(local[-1] - default[-1]) > 100 * U32 * abs(default[-1])


def test_the_text_report_shows_every_series(smoke):
    from qcomm.benchmark.report import format_train_report

    _, _, results = smoke
    text = format_train_report(results)
    assert "MLP under DistributedDataParallel" in text
    assert "x default" in text and "x fp16 hook" in text and "gap to default" in text
    for row in results["train"]["series"]:
        line = next(x for x in text.splitlines() if x.startswith(row["label"] + "  "))
        assert f"x{row['speedup']:.2f}" in line and f"x{row['vs_fp16_hook']:.2f}" in line


def test_mlp_options(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    config = bench_config("--train", "--train-model", "mlp")
    assert (config.train_model, config.train_layers, config.train_width) == (
        "mlp",
        TRAIN_MLP_DEFAULTS["layers"],
        TRAIN_MLP_DEFAULTS["width"],
    )
    assert (config.train_batch, config.train_steps) == (
        TRAIN_MLP_DEFAULTS["batch"],
        TRAIN_MLP_DEFAULTS["steps"],
    )
    quick = bench_config("--train", "--train-model", "mlp", "--quick")
    assert (quick.train_layers, quick.train_width, quick.train_batch, quick.train_steps) == tuple(
        TRAIN_MLP_QUICK[k] for k in ("layers", "width", "batch", "steps")
    )
    # The compute-bound setting of docs/bench.rst.
    bound = bench_config(
        "--train", "--train-model", "mlp", "--train-width", "512", "--train-batch", "8192"
    )
    assert (bound.train_layers, bound.train_width, bound.train_batch) == (8, 512, 8192)
    assert BenchConfig.from_json(bound.to_json()).train_width == 512
    assert bench_config("--train").train_model == "dlrm"
    for option, value in (
        ("--train-tables", "4"),
        ("--train-dim", "32"),
        ("--train-sharding", "row_wise"),
    ):
        with pytest.raises(ValueError, match=f"^{option}: applies to --train-model dlrm only"):
            bench_config("--train", "--train-model", "mlp", option, value)
    for option in ("--train-layers", "--train-width"):
        with pytest.raises(
            ValueError, match=f"^{option}: applies to --train-model mlp or fsdp only"
        ):
            bench_config("--train", option, "4")
        with pytest.raises(ValueError, match=f"^{option}: applies to --train only"):
            bench_config(option, "4")
    with pytest.raises(ValueError, match="^--train-model: applies to --train only"):
        bench_config("--train-model", "mlp")
    with pytest.raises(ValueError, match=r"--train-steps: expected at least 7 .*got 6"):
        bench_config("--train", "--train-model", "mlp", "--train-steps", "6")
    with pytest.raises(ValueError, match=r"^--train-layers, --train-width, .* GiB"):
        bench_config(
            "--train", "--train-model", "mlp", "--train-layers", "1024", "--train-width", "65536"
        )
    assert "layers" not in TRAIN_DEFAULTS  # the DLRM's options stay the DLRM's


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--train-layers", "0"], "--train-layers: expected a whole number from 1 to 1024"),
        (["--train-width", "1e3"], "--train-width: expected a whole number from 1 to 65536"),
        (["--train-model", "cnn"], "--train-model: invalid choice: 'cnn'"),
    ],
)
def test_mlp_numbers_out_of_range_are_usage_errors(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--train", "--train-model", "mlp", *argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--no-fbgemm"], ["--link-gbps", "10"]])
def test_mlp_refuses_what_it_would_ignore(option: list[str]) -> None:
    with pytest.raises(ValueError, match=f"{option[0]}: applies to the collectives"):
        bench_config("--train", "--train-model", "mlp", *option)
    bench_config("--train", *option)  # the DLRM takes them


def test_the_json_reads_back_as_typed_results_and_writes_the_same_text(smoke):
    from qcomm.benchmark.report import jsonable
    from qcomm.benchmark.results import MlpTrain, Results

    results = smoke[2]
    typed = Results.of(results)
    assert isinstance(typed.train, MlpTrain) and typed.mlp
    assert typed.train.model.parameters == results["train"]["model"]["parameters"]
    again = jsonable({**typed.to_json(), "units": results["units"]})
    assert json.dumps(again) == json.dumps(results)
