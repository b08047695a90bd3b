"""`qcomm bench --train`: one smoke run on 2 local gloo ranks (TorchRec's
pipeline, with compiled series) checked figure by figure against its own
samples, one in the plain loop, the series and the advice's rule, and the
options, refused before any rank starts."""

from __future__ import annotations

import json
import math
import statistics
import time

import pytest
from bench_runs import LAUNCHER_VARS, bench_config, spawn_train

import qcomm
import qcomm.config
from qcomm import CodecError
from qcomm.adaptive import DEFAULT_WINDOW
from qcomm.benchmark.harness import LOCAL
from qcomm.benchmark.options import TRAIN_DEFAULTS, TRAIN_QUICK, TRAIN_WARM_UP_STEPS, BenchConfig
from qcomm.benchmark.train import advice_pick, train_series
from qcomm.benchmark.train_adaptive import ADAPTIVE
from qcomm.cli import build_parser
from qcomm.cli import main as cli_main

pytest.importorskip("torchrec")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `qcomm bench --train --quick` on 2 ranks: a tiny model, 5 steps, in
    TorchRec's pipeline (the default), with compiled series (aot_eager)."""
    return spawn_train(tmp_path_factory, "--train-compile", "aot_eager")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same in the plain loop, without TorchRec's codecs (fewer series)."""
    return spawn_train(tmp_path_factory, "--train-loop", "plain", "--no-fbgemm")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_smoke_run_has_every_series_with_its_figures(smoke, capfd):
    config, status, results = smoke
    assert status == 0, "a qcomm series failed"
    train = results["train"]
    rows = {r["label"]: r for r in train["series"]}
    assert list(rows) == [s.label for s in train_series(config)]
    # A series that gives the reduce-scatter int8 is skipped only where the
    # run found that TorchRec's own transport carries it (which sums the wire).
    carried = train["reduce_scatter_on_qcomm"]
    for s in train_series(config):
        row = rows[s.label]
        if s.unsummable_reduce_scatter and not carried:
            assert row["status"] == "skipped" and "needs qcomm's exchange" in row["error"]
            assert train["reduce_scatter_refused"]
        else:
            assert row["status"] == "ok", (s.label, row["error"])
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert {"fp32", LOCAL, "qcomm fp16/fp16", "torchrec fp16/fp16"} <= {r["label"] for r in ok}
    fp32, local = rows["fp32"], rows[LOCAL]
    torchrec = {(r["pair"], r["compile"]): r for r in ok if r["kind"] == "torchrec"}
    for r in ok:
        samples = r["samples_s"]
        assert len(samples) == config.rounds
        assert all(math.isfinite(x) and x > 0 for x in samples)
        assert r["step_s"] == statistics.median(samples)
        assert r["step_min_s"] == min(samples) and r["step_max_s"] == max(samples)
        assert _close(r["speedup"], fp32["step_s"] / r["step_s"])
        theirs = torchrec.get((r["pair"], r["compile"]))
        if r["kind"] == "qcomm" and theirs is not None:
            assert _close(r["vs_torchrec"], theirs["step_s"] / r["step_s"])
        else:
            assert r["vs_torchrec"] is None
        assert len(r["losses"]) == config.train_steps
        assert all(math.isfinite(x) and x > 0 for x in r["losses"])
        if r is local:
            assert r["loss"] is None and r["comm_share"] is None
            continue
        assert _close(r["comm_share"], 1 - local["step_s"] / r["step_s"])
        assert r["loss"] == r["losses"][-1]
        assert _close(r["loss_gap"], r["loss"] - fp32["loss"])
    assert rows["qcomm fp16/fp16"]["vs_torchrec"] is not None
    assert rows["qcomm int8/bf16, compiled"]["vs_torchrec"] is not None
    # The DDP hook runs: the same first step, then its int8 dense gradients.
    plain, hooked = rows["qcomm fp16/fp16"]["losses"], rows["qcomm fp16/fp16 + DDP int8"]["losses"]
    assert hooked[0] == plain[0] and hooked[1:] != plain[1:]
    # The same weights and batches for every series: with no codec the
    # advice's series repeats fp32's losses bit for bit, and the reference's
    # first step (before any update) has fp32's loss on every rank's batch.
    assert train["advice"]["registry"] is None
    assert rows["advice: no codec"]["losses"] == fp32["losses"]
    # (The tables' init is small: other weights would move that loss by ~1e-6.)
    assert math.isclose(local["losses"][0], fp32["losses"][0], rel_tol=1e-8)
    model = train["model"]
    assert (model["tables"], model["dim"]) == (TRAIN_QUICK["tables"], TRAIN_QUICK["dim"])
    assert sum(model["steps_per_round"]) == config.train_steps - TRAIN_WARM_UP_STEPS
    assert set(results["units"]) >= {"step_s", "speedup", "vs_torchrec", "comm_share", "loss"}


def test_the_adaptive_series_says_where_it_settled(smoke):
    # Its row ran on qcomm's exchange; rank 0's history of the registry's
    # calls says, per collective and pass, the last call's codec (one of the
    # candidates) and each codec's share of the calls.
    config, _, results = smoke
    rows = {r["label"]: r for r in results["train"]["series"]}
    row = rows[f"qcomm {ADAPTIVE}"]
    assert row["status"] == "ok", row["error"]
    assert (row["kind"], row["pair"]) == ("qcomm", ADAPTIVE)
    assert row["loss"] is not None and math.isfinite(row["loss"])
    candidates = {"mx4", "int8", "bf16"}
    # Both embedding collectives, forward and backward: a call of each per
    # step (the mixed sharding: one table-wise, one row-wise).
    collectives = {
        f"{name} {direction}"
        for name in ("all_to_all_pooled", "reduce_scatter_pooled")
        for direction in ("forward", "backward")
    }
    assert set(row["settled"]) == set(row["codec_shares"]) == set(row["switches"]) == collectives
    for collective, codec in row["settled"].items():
        assert codec in candidates, (collective, codec)
        shares = row["codec_shares"][collective]
        assert set(shares) <= candidates and shares[codec] > 0
        assert math.isclose(sum(shares.values()), 1.0), shares
    # The quick run's few steps (one call of each per step) are fewer than
    # the window a cheaper candidate needs: the most precise one, which
    # carries the calls until then, carried them all.
    assert config.train_steps < DEFAULT_WINDOW
    assert set(row["settled"].values()) == {"bf16"}
    assert all(shares == {"bf16": 1.0} for shares in row["codec_shares"].values())
    assert set(row["switches"].values()) == {0}
    # No other series has these figures.
    others = [r for r in rows.values() if r["label"] != row["label"]]
    assert all(r["settled"] is r["codec_shares"] is r["switches"] is None for r in others)


def test_the_text_report_shows_every_series(smoke, plain, tmp_path, capsys):
    from qcomm.benchmark.report import format_train_report

    _, _, results = smoke
    text = format_train_report(results)
    assert "x fp32" in text and "comm share" in text and "gap to fp32" in text
    assert "trained in TorchRec's TrainPipelineSparseDist" in text
    assert "graph breaks" in text and "x eager" in text and "torch.compile (aot_eager)" in text
    for row in results["train"]["series"]:
        line = next(x for x in text.splitlines() if x.startswith(row["label"] + "  "))
        if row["status"] == "ok":
            assert f"x{row['speedup']:.2f}" in line
            assert line.split()[-2] == "0"  # graph breaks, then x eager
        else:
            assert row["status"] in line
    row = next(r for r in results["train"]["series"] if r["pair"] == ADAPTIVE)
    assert f"{row['label']}: where each collective settled" in text
    for collective, codec in row["settled"].items():
        assert f"  {collective}: {codec} (" in text
    text = format_train_report(plain[2])
    assert "trained in a plain loop" in text and "x eager" not in text


def test_the_default_loop_is_torchrecs_pipeline(smoke):
    config, _, results = smoke
    train = results["train"]
    assert config.train_loop == "pipeline" and train["model"]["loop"] == "pipeline"
    for r in train["series"]:
        if r["status"] != "ok":
            continue
        if r["kind"] == "local":
            # Nothing sharded to pipeline: the reference keeps the plain loop.
            assert r["pipelined_batches"] is None, r
            continue
        # TorchRec's own counts: it loaded every batch of the series and took
        # over the input distribution of the sharded embedding collection.
        assert (r["pipelined_batches"], r["pipelined_modules"]) == (config.train_steps, 1), r


def test_the_plain_loop_trains_as_the_pipeline(smoke, plain):
    config, status, results = plain
    assert status == 0
    assert config.train_loop == "plain" and results["train"]["model"]["loop"] == "plain"
    piped = {r["label"]: r for r in smoke[2]["train"]["series"] if r["status"] == "ok"}
    rows = [r for r in results["train"]["series"] if r["status"] == "ok"]
    assert {"fp32", "qcomm int8/bf16", LOCAL} <= {r["label"] for r in rows}
    for r in rows:
        assert r["pipelined_batches"] is None and r["pipelined_modules"] is None, r
        # The pipeline reorders when a batch's collectives start, not what
        # they compute: the same losses, bit for bit.
        assert r["losses"] == piped[r["label"]]["losses"], r["label"]


def test_a_compiled_series_has_no_graph_break_and_trains_as_eager(smoke):
    config, _, results = smoke
    rows = {r["label"]: r for r in results["train"]["series"]}
    compiled = [r for r in rows.values() if r["compile"] is not None]
    assert [r["label"] for r in compiled] == [
        "fp32, compiled",
        "torchrec int8/bf16, compiled",
        "qcomm int8/bf16, compiled",
    ]
    for r in rows.values():
        if r["status"] != "ok":
            continue
        assert r["graph_breaks"] == 0, r
        if r["compile"] is None:
            assert r["compiled_graphs"] == 0 and r["vs_eager"] is None, r
            continue
        assert r["compile"] == "aot_eager"
        eager = rows[r["label"].removesuffix(", compiled")]
        assert _close(r["vs_eager"], eager["step_s"] / r["step_s"])
        # Same weights, same batches: float32 rounding apart, the same losses.
        assert r["losses"] == pytest.approx(eager["losses"], rel=1e-5), r["label"]
    # The first compiled series compiled the dense arch, the interaction and
    # the over arch (forward); the others reuse the graphs (same code).
    assert rows["fp32, compiled"]["compiled_graphs"] >= 3


def test_the_series_and_their_registries():
    config = BenchConfig(train=True)
    series = train_series(config)
    labels = [s.label for s in series]
    assert labels[0] == "fp32" and labels[-1] == LOCAL
    assert {
        "torchrec fp16/fp16",
        "torchrec int8/bf16",
        "qcomm fp16/fp16",
        "qcomm int8/bf16",
        "qcomm adaptive:mx4|int8|bf16",
    } <= set(labels)
    hooked = [s for s in series if s.dense]
    assert [(s.dense, s.unsummable_reduce_scatter) for s in hooked] == [("int8", False)]
    assert "torchrec" not in " ".join(s.label for s in train_series(BenchConfig(fbgemm=False)))
    for s in series:
        if s.registry is None:
            continue
        qcomm.build_registry(s.registry, allow_unsummable_reduce_scatter=True)
        # What the series says of its reduce-scatter is what build_registry
        # says where TorchRec's transport, which sums the wires, is chosen.
        # An adaptive registry, whose errors travel in qcomm's statuses, is
        # refused there whatever the collective.
        with qcomm.config.configured(torchrec_collectives="torchrec"):
            if s.pair == ADAPTIVE:
                with pytest.raises(CodecError, match="runs on qcomm's exchange only"):
                    qcomm.build_registry(s.registry)
            elif s.unsummable_reduce_scatter:
                with pytest.raises(CodecError, match="POOLED_EMBEDDINGS_REDUCE_SCATTER"):
                    qcomm.build_registry(s.registry)
            else:
                qcomm.build_registry(s.registry)


def test_the_advice_rule():
    assert advice_pick(None) is None and advice_pick(10.5) is None
    for rate in (0.1, 1.0, 10.0):
        pick = advice_pick(rate)
        assert pick is not None and "pooled_embeddings_all_to_all=int8/bf16" in pick
        qcomm.build_registry(pick)  # TorchRec's own reduce-scatter can carry it
    linked = train_series(BenchConfig(train=True, link="1gbit"))
    advice = next(s for s in linked if s.label.startswith("advice"))
    assert advice.label == "advice: int8/bf16" and advice.registry == advice_pick(1.0)
    faster = train_series(BenchConfig(train=True, link="1gbit", link_gbps=100.0))
    assert "advice: no codec" in [s.label for s in faster]


def test_train_options(monkeypatch, tmp_path):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    config = bench_config("--train")
    assert config.train and config.rounds == 5
    assert config.train_tables == TRAIN_DEFAULTS["tables"]
    assert config.train_steps == TRAIN_DEFAULTS["steps"]
    quick = bench_config("--train", "--quick")
    assert (quick.train_tables, quick.train_dim, quick.train_batch, quick.train_steps) == tuple(
        TRAIN_QUICK[k] for k in ("tables", "dim", "batch", "steps")
    )
    given = bench_config(
        "--train", "--train-tables", "4", "--train-dim", "32", "--train-batch", "64"
    )
    assert (given.train_tables, given.train_dim, given.train_batch) == (4, 32, 64)
    again = BenchConfig.from_json(given.to_json())
    assert again.train and again.train_dim == 32
    assert not bench_config().train
    assert bench_config("--train", "--train-sharding", "row_wise").train_sharding == "row_wise"
    assert bench_config("--train", "--train-model", "dlrm", "--train-dim", "64").train_dim == 64
    assert (config.train_loop, config.train_compile) == ("pipeline", None)
    looped = bench_config("--train", "--train-loop", "plain", "--train-compile", "inductor")
    assert (looped.train_loop, looped.train_compile) == ("plain", "inductor")
    assert BenchConfig.from_json(looped.to_json()).train_compile == "inductor"
    for option in (["--train-loop", "plain"], ["--train-compile", "aot_eager"]):
        with pytest.raises(ValueError, match=f"{option[0]}: applies to --train only"):
            bench_config(*option)
        with pytest.raises(ValueError, match=f"{option[0]}: applies to --train-model dlrm only"):
            bench_config("--train", "--train-model", "mlp", *option)
    with pytest.raises(ValueError, match="--train-dim: applies to --train only"):
        bench_config("--train-dim", "64")
    with pytest.raises(ValueError, match="--train-dim: expected a multiple of 4, got 6"):
        bench_config("--train", "--train-dim", "6")
    with pytest.raises(ValueError, match=r"--train-steps: expected at least 7 .*--rounds 5.*got 6"):
        bench_config("--train", "--train-steps", "6")
    assert bench_config("--train", "--train-steps", "4", "--rounds", "2").train_steps == 4
    for option in (["--sizes", "64K"], ["--ops", "pooled"], ["--backward"], ["--codecs", "int8"]):
        with pytest.raises(ValueError, match=f"{option[0]}: .* does not apply to --train"):
            bench_config("--train", *option)
    with pytest.raises(ValueError, match="--plot: .* does not apply to --train"):
        bench_config("--train", "--plot", str(tmp_path / "out.png"))
    with pytest.raises(ValueError, match=r"--train-tables, --train-dim, --train-batch: .* GiB"):
        bench_config("--train", "--train-tables", "1024", "--train-dim", "4096")


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--train-tables", "1", "--train-tables: expected a whole number from 2 to 1024"),
        ("--train-dim", "x", "--train-dim: expected a whole number from 4 to 4096"),
        ("--train-batch", "0", "--train-batch: expected a whole number from 1 to"),
        ("--train-steps", "2", "--train-steps: expected a whole number from 3 to"),
    ],
)
def test_train_numbers_out_of_range_are_usage_errors(capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--train", option, value])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_bad_train_option_stops_the_command_before_any_rank(monkeypatch, capsys):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    assert cli_main(["bench", "--train", "--train-dim", "6"]) == 2
    assert time.monotonic() - started < 30
    assert "--train-dim: expected a multiple of 4" in capsys.readouterr().err


def test_the_json_reads_back_as_typed_results_and_writes_the_same_text(smoke):
    from qcomm.benchmark.report import jsonable
    from qcomm.benchmark.results import DlrmTrain, Results, TrainMeta

    results = smoke[2]
    typed = Results.of(results)
    assert isinstance(typed.meta, TrainMeta) and isinstance(typed.train, DlrmTrain)
    assert typed.train.model.tables == results["train"]["model"]["tables"]
    assert [r.label for r in typed.train.series] == [r["label"] for r in results["train"]["series"]]
    again = jsonable({**typed.to_json(), "units": results["units"]})
    assert json.dumps(again) == json.dumps(results)


def test_a_planners_plan_is_the_sharding_every_series_trains(plain, tmp_path_factory):
    # The default shards t0 table-wise on rank 0 and t1 row-wise; the plan
    # the other way round. The int8/bf16 series (int8 on the all-to-all and
    # the reduce-scatter alike) then rounds each table's embeddings through
    # the other collective, while float32 learns the same to its rounding.
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan = {"t0": "row_wise", "t1": "table_wise:0"}
    path.write_text(json.dumps(plan))
    config, status, results = spawn_train(
        tmp_path_factory, "--train-loop", "plain", "--no-fbgemm", "--train-plan", str(path)
    )
    assert status == 0
    model = results["train"]["model"]
    assert config.train_plan == plan and model["plan"] == plan
    assert (model["table_wise"], model["row_wise"]) == (1, 1)
    rows = {r["label"]: r for r in results["train"]["series"]}
    default = {r["label"]: r for r in plain[2]["train"]["series"]}
    for label, r in rows.items():
        assert r["status"] == "ok", (label, r["error"])
    planned, mixed = rows["qcomm int8/bf16"]["losses"], default["qcomm int8/bf16"]["losses"]
    assert planned != mixed
    assert rows["fp32"]["losses"] == pytest.approx(default["fp32"]["losses"], rel=1e-5)
