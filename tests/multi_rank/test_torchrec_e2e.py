"""A qcomm registry inside TorchRec's own sharders, end to end.

Two gloo ranks on CPU shard an EmbeddingBagCollection table-wise, column-wise
(TorchRec's pooled all-to-all) and row-wise (its pooled reduce-scatter), and an
EmbeddingCollection table-wise and row-wise (sequence all-to-all), with
``DistributedModelParallel``. Every built-in codec runs forward and backward
on the collective of each sharding where TorchRec can carry it (and an
element-wise one that is not summable, as the reduce-scatter's backward
codec behind ``fp16``); the forward output and the predictions after one fused exact-SGD step must match the
unquantized sharded run within a bound derived from the codecs' declared
:class:`~qcomm.CodecInfo` errors.

Bound derivation. The model is linear in its weights, ``y = M w`` (pooling sums
rows, a sequence lookup selects one) and ``M >= 0``, so bounds propagate
through the unsharded reference module itself; ``e(s) = rel * s + abs`` is a
codec's declared error (``s`` the block's largest magnitude for block codecs,
bounded here by the tensor's largest):

- forward, all-to-all: every output element crosses the forward codec ``f``
  once: ``|dy| <= e_f(|y|)``.
- forward, reduce-scatter: every rank encodes its partial sum ``p_r``, with
  ``sum_r |p_r| <= A = M |w|``; the wires are summed in the wire format, which
  ``summable`` promises rounds like the codec (``W - 1`` roundings of at most
  ``rel``): ``|dy| <= E + (W - 1) rel (A + E)``, ``E`` the partial sums' codec
  errors together.
- backward: the gradient ``G`` of the loss ``sum(y * G)`` crosses the backward
  codec ``b`` (all-to-all, or the reduce-scatter's all-gather); the fused SGD
  update ``w -= lr / W * M^T g`` (TorchRec divides gradients by the world size)
  is off by ``dw = lr / W * M^T e_b(|G|)``, the next forward by ``dy = M dw``
  before its own forward codec error on values up to ``|y'| + dy``.

Float32 arithmetic (summation order, the update) adds a slack of ``64 eps32``
times the magnitude ``M |w|`` of what is summed; the first test checks the
unquantized sharded run against the unsharded reference within that slack.

Everything runs twice: on qcomm's exchange, which TorchRec's modules take for
a qcomm registry by default (every case counts its calls there), and on
TorchRec's own transport (``QCOMM_TORCHREC_COLLECTIVES=torchrec``, no call
reaches qcomm's exchange). They differ where TorchRec's transport cannot carry
a codec: an unsummable codec on the reduce-scatter is right on qcomm's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from codec_names import BUILTIN
from counting import counted
from dist_utils import run_ranks
from torchrec_utils import (
    Batch,
    BitCastFP8Codec,
    CountingCodec,
    PooledModel,
    SequenceModel,
    cpu_sharders,
    load_global_weights,
)

import qcomm
from qcomm import CodecInfo, CommOp, QuantizedCommCodecs, config, torchrec_exchange
from qcomm.adaptive import DEFAULT_MAX_ERROR, DEFAULT_WINDOW

WORLD = 2
B_LOCAL = 16
MAX_BAG = 3
LR = 0.5
SLACK = 64 * torch.finfo(torch.float32).eps
# Magnitudes of weights and output gradients: outputs and updated outputs
# stay within every codec's range (fp8_e4m3_tensor saturates at 0.9375).
WEIGHT = 0.25
GRAD = 0.1

# (table, dim, rows, feature). Pooled widths per rank are 16 and 40 (table-wise)
# and 8 + 20 = 28 (column-wise): none is a multiple of 32, so the block codecs
# (int8 and fp8 rows, mx4 groups of 32) must pad. TorchRec never pads the
# backward pass; 16 samples per rank make every backward message a whole
# number of 32-element blocks.
POOLED_TABLES = [("t0", 16, 60, "f0"), ("t1", 40, 50, "f1")]
# The sequence all-to-all never pads and cuts its messages at rows, so the
# row width is a multiple of the block codecs' 32.
SEQUENCE_TABLES = [("s0", 32, 60, "g0"), ("s1", 32, 50, "g1")]

# qcomm's exchange (the default) and TorchRec's own transport.
DOORS = ("qcomm", "torchrec")
SHARDINGS = ["ebc-table_wise", "ebc-column_wise", "ebc-row_wise", "ec-table_wise", "ec-row_wise"]
ROW_WISE_EBC = "ebc-row_wise"


def comm_op(sharding: str) -> CommOp:
    """The collective that carries the embeddings of a sharding."""
    if sharding.startswith("ec-"):
        return CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL
    if sharding == ROW_WISE_EBC:
        return CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
    return CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL


def summable(codec: str) -> bool:
    return qcomm.codec_info(qcomm.load_codec(codec)).summable


def spec_pair(case: str) -> str:
    """A case's ``forward/backward`` spec (a lone codec serves both)."""
    return case if "/" in case else f"{case}/{case}"


def valid_on(op: CommOp, case: str) -> bool:
    """Whether TorchRec can carry a case's codecs on ``op``, forward and backward.

    TorchRec's reduce-scatter sums the wire forward and all-gathers it
    backward into a buffer shaped like the unencoded tensor, so it takes only
    a summable forward codec and an element-wise backward one, which is what
    ``build_registry`` accepts where TorchRec's transport is chosen; the
    all-to-alls take any codec.
    """
    with config.configured(torchrec_collectives="torchrec"):
        try:
            qcomm.build_registry({op.value: spec_pair(case)})
        except qcomm.CodecError:
            return False
    return True


# Every codec both ways; and, for the reduce-scatter, every element-wise
# codec that is not summable as the backward codec of a summable one.
PAIRS = BUILTIN + [f"fp16/{c}" for c in BUILTIN if not summable(c)]
CASES = [(s, c) for s in SHARDINGS for c in PAIRS if valid_on(comm_op(s), c)]
CASES = [(s, c) for s, c in CASES if "/" not in c or s == ROW_WISE_EBC]
# Reduce-scatter pairs TorchRec cannot carry, which build_registry refuses:
# an unsummable forward codec, or a backward codec that changes the size.
MISUSES = [(c, "noop") for c in BUILTIN] + [("noop", c) for c in BUILTIN]
MISUSES = [p for p in MISUSES if not valid_on(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER, "/".join(p))]


def _codec_error(info: CodecInfo, magnitude: torch.Tensor) -> torch.Tensor:
    # The declared bound for true values of this magnitude.
    s = magnitude if info.error_block == 1 else magnitude.max().expand_as(magnitude)
    return info.rel_error_bound * s + info.abs_error_bound


def _summed_error(info: CodecInfo, abs_sum: torch.Tensor) -> torch.Tensor:
    # The reduce-scatter's bound (module docstring), for sum_r |p_r| <= abs_sum.
    if info.error_block == 1:
        enc = info.rel_error_bound * abs_sum + WORLD * info.abs_error_bound
    else:
        enc = WORLD * _codec_error(info, abs_sum)
    return enc + (WORLD - 1) * info.rel_error_bound * (abs_sum + enc)


@dataclasses.dataclass
class Setup:
    """One sharding: the global problem every rank rebuilds, and its plan."""

    name: str
    op: CommOp
    batch: Batch
    weights: dict[str, torch.Tensor]
    grad: torch.Tensor  # dL/dy of the global batch
    make_model: Callable[[torch.device], torch.nn.Module]
    plan: Callable[[], dict[str, Any]]
    local: torch.Tensor  # indices of this rank's outputs in the global output


def _setup(name: str, rank: int) -> Setup:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise
    from torchrec.modules.embedding_configs import EmbeddingConfig

    pooled = name.startswith("ebc-")
    sharding = name.split("-")[1]
    tables = POOLED_TABLES if pooled else SEQUENCE_TABLES
    keys = [t[3] for t in tables]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    batch = Batch.random(keys, [t[2] for t in tables], WORLD * B_LOCAL, MAX_BAG, gen)
    weights = {t: (torch.rand(n, d, generator=gen) * 2 - 1) * WEIGHT for t, d, n, _ in tables}

    def make_model(device: torch.device) -> torch.nn.Module:
        if pooled:
            bags = [
                EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[f])
                for t, d, n, f in tables
            ]
            return PooledModel(EmbeddingBagCollection(tables=bags, device=device))
        seqs = [
            EmbeddingConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[f])
            for t, d, n, f in tables
        ]
        return SequenceModel(EmbeddingCollection(tables=seqs, device=device), keys)

    def plan() -> dict[str, Any]:
        if sharding == "table_wise":
            return {
                t[0]: table_wise(rank=i % WORLD, compute_kernel="fused")
                for i, t in enumerate(tables)
            }
        if sharding == "row_wise":
            return {t[0]: row_wise(compute_kernel="fused") for t in tables}
        return {t[0]: column_wise(ranks=list(range(WORLD)), compute_kernel="fused") for t in tables}

    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    if pooled:
        local = torch.arange(lo, hi)
        out_shape = (WORLD * B_LOCAL, sum(t[1] for t in tables))
    else:
        local = batch.sequence_rows(lo, hi)
        out_shape = (sum(len(v) for v in batch.values), tables[0][1])
    grad = (torch.rand(out_shape, generator=gen) * 2 - 1) * GRAD
    return Setup(name, comm_op(name), batch, weights, grad, make_model, plan, local)


class Linear:
    """The unsharded module on the global batch as the map ``w -> M w``, and
    its transpose ``g -> M^T g``."""

    def __init__(self, setup: Setup) -> None:
        self.model = setup.make_model(torch.device("cpu"))
        self.kjt = setup.batch.kjt(0, WORLD * B_LOCAL)

    def __call__(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        load_global_weights(self.model, weights)
        with torch.no_grad():
            return self.model(self.kjt)

    def transpose(self, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        self.model.zero_grad()
        (self.model(self.kjt) * grad).sum().backward()
        grads = {n.split(".")[-2]: p.grad for n, p in self.model.named_parameters()}
        return {n: g.clone() for n, g in grads.items() if g is not None}


@dataclasses.dataclass
class Reference:
    """Exact outputs before and after one SGD step, and their magnitudes."""

    y: torch.Tensor
    y_step: torch.Tensor
    abs_y: torch.Tensor  # M |w|
    abs_y_step: torch.Tensor  # M |w'|
    lin: Linear
    step: float  # lr / W as TorchRec applies it


def _reference(setup: Setup) -> Reference:
    from torchrec.distributed.comm_ops import get_gradient_division

    lin = Linear(setup)
    step = LR / WORLD if get_gradient_division() else LR
    grads = lin.transpose(setup.grad)
    stepped = {t: w - step * grads[t] for t, w in setup.weights.items()}
    return Reference(
        y=lin(setup.weights),
        y_step=lin(stepped),
        abs_y=lin({t: w.abs() for t, w in setup.weights.items()}),
        abs_y_step=lin({t: w.abs() for t, w in stepped.items()}),
        lin=lin,
        step=step,
    )


def _bounds(
    setup: Setup, ref: Reference, fwd: CodecInfo, bwd: CodecInfo
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global element-wise bounds of the forward and the after-step outputs."""
    dw = ref.lin.transpose(_codec_error(bwd, setup.grad.abs()))
    dy = ref.lin({t: ref.step * g for t, g in dw.items()})
    if setup.op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
        fwd_bound = _summed_error(fwd, ref.abs_y)
        step_bound = dy + _summed_error(fwd, ref.abs_y_step + dy)
    else:
        fwd_bound = _codec_error(fwd, ref.y.abs())
        step_bound = dy + _codec_error(fwd, ref.y_step.abs() + dy)
    return (
        fwd_bound + SLACK * ref.abs_y,
        step_bound + SLACK * (ref.abs_y + ref.abs_y_step),
    )


def _run_sharded(
    setup: Setup, rank: int, registry: dict[str, QuantizedCommCodecs] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded model's local output, and its output after one SGD step."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    ebc_sharder, ec_sharder = cpu_sharders(registry, LR)
    sharder = ebc_sharder if setup.name.startswith("ebc-") else ec_sharder
    model = setup.make_model(torch.device("meta"))
    plan = construct_module_sharding_plan(
        model.emb,
        setup.plan(),
        sharder=sharder,
        local_size=WORLD,
        world_size=WORLD,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"emb": plan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    load_global_weights(dmp, setup.weights)
    kjt = setup.batch.kjt(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    y = dmp(kjt)
    (y * setup.grad[setup.local]).sum().backward()  # the fused SGD step runs in here
    with torch.no_grad():
        y_step = dmp(kjt)
    return y.detach(), y_step


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    # Largest error as a fraction of its bound; 0/0 (empty bags) counts as 0.
    ratios = torch.where(err == 0, torch.zeros_like(err), err / bound)
    return float(ratios.max()) if ratios.numel() else 0.0


def _case(
    setup: Setup, ref: Reference, rank: int, base: tuple[torch.Tensor, torch.Tensor], codec: str
) -> dict[str, Any]:
    registry = qcomm.build_registry({setup.op.value: spec_pair(codec)})
    pair = registry[setup.op.name]
    fwd, bwd = CountingCodec(pair.forward), CountingCodec(pair.backward)
    registry[setup.op.name] = QuantizedCommCodecs(forward=fwd, backward=bwd)
    before = sum(counted("torchrec_call").values())
    y, y_step = _run_sharded(setup, rank, registry)
    fwd_bound, step_bound = _bounds(setup, ref, fwd.info, bwd.info)
    fwd_err = (y - base[0]).abs()
    return {
        "fwd_ratio": _ratio(fwd_err, fwd_bound[setup.local]),
        "step_ratio": _ratio((y_step - base[1]).abs(), step_bound[setup.local]),
        "fwd_err": float(fwd_err.max()),
        "fwd_encodes": fwd.encodes,
        "bwd_encodes": bwd.encodes,
        "padding": fwd.max_padding,
        "exchange_calls": sum(counted("torchrec_call").values()) - before,
        "in_range": float(max(ref.y.abs().max(), ref.y_step.abs().max(), setup.grad.abs().max()))
        <= min(fwd.info.max_abs_input, bwd.info.max_abs_input),
    }


def _misuse(
    setup: Setup, ref: Reference, rank: int, base: torch.Tensor, fwd: Any, bwd: Any
) -> dict[str, Any]:
    """Runs TorchRec's reduce-scatter with a pair it cannot carry (forced past
    build_registry's refusal) and returns what went wrong."""
    registry = qcomm.build_registry(
        {setup.op.value: (fwd, bwd)}, allow_unsummable_reduce_scatter=True
    )
    info = qcomm.codec_info(registry[setup.op.name].forward)
    before = sum(counted("torchrec_call").values())
    try:
        y, _ = _run_sharded(setup, rank, registry)
    except Exception as err:  # loud, at least: both ranks raise at the same call
        dist.barrier()
        return {"raised": f"{type(err).__name__}: {err}"[:600], "ratio": math.inf}
    # What the codec promises for each rank's message, summed over the ranks.
    bound = WORLD * _codec_error(info, ref.abs_y) + SLACK * ref.abs_y
    return {
        "raised": None,
        "ratio": _ratio((y - base).abs(), bound[setup.local]),
        "exchange_calls": sum(counted("torchrec_call").values()) - before,
    }


def _by_host(setup: Setup, rank: int, base: torch.Tensor) -> dict[Any, Any]:
    """Codecs by host through the sharders: per peer on qcomm's exchange."""
    coded, _ = _run_sharded(setup, rank, qcomm.build_registry({setup.op.value: "fp16"}))
    out: dict[Any, Any] = {}
    for ranks_per_host in (1, 2):
        spec = f"same_host=noop+other_host=fp16+ranks_per_host={ranks_per_host}"
        before = sum(counted("torchrec_call").values())
        y, _ = _run_sharded(setup, rank, qcomm.build_registry({setup.op.value: spec}))
        out[ranks_per_host] = {
            "exact": bool(torch.equal(y, base)),
            "as_fp16": bool(torch.equal(y, coded)),
            "exchange_calls": sum(counted("torchrec_call").values()) - before,
        }
    out["fp16_differs"] = not torch.equal(coded, base)
    return out


def _guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    # One broken case must not hide the others. TorchRec fails on both ranks
    # at the same call (same shapes, same codecs), so they stay in step; were
    # only one to fail, this barrier would meet the other's collective and the
    # run would end on the process group's timeout, loudly.
    try:
        return fn(*args)
    except Exception:
        dist.barrier()
        return {"error": traceback.format_exc()[-3000:]}


def _worker(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in SHARDINGS:
        setup = _setup(name, rank)
        ref = _reference(setup)
        base = _run_sharded(setup, rank, None)
        out[(name, "fp32")] = {
            "fwd_ratio": _ratio(
                (base[0] - ref.y[setup.local]).abs(), (SLACK * ref.abs_y)[setup.local]
            ),
            "step_ratio": _ratio(
                (base[1] - ref.y_step[setup.local]).abs(),
                (SLACK * (ref.abs_y + ref.abs_y_step))[setup.local],
            ),
        }
        for sharding, codec in CASES:
            if sharding == name:
                out[(name, codec)] = _guarded(_case, setup, ref, rank, base, codec)
        if name == "ebc-table_wise":
            out[("by_host", name)] = _by_host(setup, rank, base[0])
        if name == ROW_WISE_EBC:
            # Installed explicitly: under QCOMM_TORCHREC_COLLECTIVES=torchrec a
            # registry installs nothing, and only an installed door refuses a
            # pair that TorchRec's transport would sum wrong (the registry's
            # own refusal is lifted below).
            torchrec_exchange.install()
            for fwd, bwd in MISUSES:
                out[("misuse", fwd, bwd)] = _misuse(setup, ref, rank, base[0], fwd, bwd)
            out[("misuse", "fp8_bitcast")] = _misuse(
                setup, ref, rank, base[0], BitCastFP8Codec(), "noop"
            )
    return out


@pytest.fixture(scope="module", params=DOORS)
def results(request: pytest.FixtureRequest) -> dict[Any, Any]:
    door = request.param
    per_rank = run_ranks(_worker, WORLD, timeout=600.0, env={torchrec_exchange.ENV: door})
    out: dict[Any, Any] = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    out["door"] = door
    return out


def test_codecs_by_host_through_the_sharders(results):
    # Two ranks: as two hosts of one, every peer takes fp16; as one host of
    # two, none does, where qcomm's exchange moves the bytes. TorchRec's own
    # transport encodes the whole tensor with the other hosts' codec.
    for r in results[("by_host", "ebc-table_wise")]:
        assert r["fp16_differs"]
        assert r[1]["as_fp16"]
        if results["door"] == "qcomm":
            assert r[2]["exact"] and r[1]["exchange_calls"] > 0 and r[2]["exchange_calls"] > 0
        else:
            assert r[2]["as_fp16"] and r[1]["exchange_calls"] == r[2]["exchange_calls"] == 0


def test_every_builtin_codec_is_covered():
    assert {"fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "mx4"} <= set(BUILTIN)
    for codec in BUILTIN:  # every codec runs on every all-to-all sharding
        assert sum(c == codec for _, c in CASES) >= 4


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_unquantized_sharded_run_matches_unsharded(results, sharding):
    # The reference the codecs are held to is exact, and the SGD step is the
    # one the bounds assume (learning rate, gradient division).
    for rank, r in enumerate(results[(sharding, "fp32")]):
        assert r["fwd_ratio"] <= 1.0, f"rank {rank}: {r}"
        assert r["step_ratio"] <= 1.0, f"rank {rank}: {r}"


@pytest.mark.parametrize(("sharding", "codec"), CASES)
def test_codec_within_declared_bound(results, sharding, codec):
    for rank, r in enumerate(results[(sharding, codec)]):
        assert "error" not in r, f"rank {rank} raised:\n{r['error']}"
        assert r["in_range"], f"rank {rank}: values beyond the codec's max_abs_input: {r}"
        assert r["fwd_ratio"] <= 1.0, f"rank {rank}, forward beyond the bound: {r}"
        assert r["step_ratio"] <= 1.0, f"rank {rank}, after one step beyond the bound: {r}"
        on_qcomm = results["door"] == "qcomm"
        assert (r["exchange_calls"] > 0) == on_qcomm, (
            f"rank {rank}: not on the {results['door']} door: {r}"
        )
        assert r["fwd_encodes"] > 0, f"rank {rank}: forward codec never encoded: {r}"
        assert r["bwd_encodes"] > 0, f"rank {rank}: backward codec never encoded: {r}"
        # The codec really sat on the wire: its rounding shows.
        assert r["fwd_err"] > 0, f"rank {rank}: output identical to fp32: {r}"


@pytest.mark.parametrize("codec", BUILTIN)
def test_block_codecs_pad_pooled_embeddings(results, codec):
    # Widths of 16, 40 and 28 columns per rank force a block codec to pad.
    block = qcomm.codec_info(qcomm.load_codec(codec)).error_block
    for sharding in ("ebc-table_wise", "ebc-column_wise"):
        for r in results[(sharding, codec)]:
            assert "error" not in r, r["error"]
            assert (r["padding"] > 0) == (block > 1), f"{sharding}: {r}"


@pytest.mark.parametrize("codec", BUILTIN)
def test_registry_refuses_unsummable_reduce_scatter_codec(codec, torchrecs_transport):
    spec = {"pooled_embeddings_reduce_scatter": f"{codec}/{codec}"}
    if summable(codec):
        assert CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name in qcomm.build_registry(spec)
        return
    with pytest.raises(qcomm.CodecError, match=f"'{codec}'.*POOLED_EMBEDDINGS_REDUCE_SCATTER"):
        qcomm.build_registry(spec)
    with pytest.raises(qcomm.CodecError, match="POOLED_EMBEDDINGS_REDUCE_SCATTER"):
        qcomm.build_registry(forward=codec, backward="fp16")


@pytest.mark.parametrize(("fwd", "bwd"), MISUSES)
def test_reduce_scatter_misuse(results, fwd, bwd):
    # Forced through, the built-in block codecs break TorchRec's reduce-scatter
    # (their wire neither keeps the tensor's shape nor its size), and the
    # shape-keeping fp8_e4m3_tensor corrupts the sum far beyond its own bound
    # (summed bytes may even be a NaN code: a NaN ratio counts). qcomm's
    # reduce-scatter decodes every rank's part and sums in float32: right.
    for rank, r in enumerate(results[("misuse", fwd, bwd)]):
        if results["door"] == "qcomm":
            assert r["raised"] is None and r["ratio"] <= 1.0, f"rank {rank}: {r}"
            assert r["exchange_calls"] > 0, f"rank {rank}: {r}"
        else:
            assert r["raised"] is not None or not r["ratio"] <= 10.0, f"rank {rank}: {r}"


def test_unsummable_reduce_scatter(results):
    # Why the registry refuses: TorchRec's transport sums a shape-keeping
    # unsummable codec's bytes (TorchRec's own tensor-wise FP8 comm is one).
    # On qcomm's exchange it is right; a call that goes to TorchRec's
    # transport with such a pair raises on every rank instead of summing.
    for rank, r in enumerate(results[("misuse", "fp8_bitcast")]):
        if results["door"] == "qcomm":
            assert r["raised"] is None, f"rank {rank}: {r}"
            assert r["ratio"] <= 1.0 and r["exchange_calls"] > 0, f"rank {rank}: {r}"
        else:
            raised = r["raised"] or ""
            assert raised.startswith("CodecError: comm_ops.reduce_scatter"), f"rank {rank}: {r}"
            assert "'fp8_bitcast' is not summable" in raised, f"rank {rank}: {r}"


def test_dlrm_example_runs(tmp_path):
    # A few steps of every configuration of the example: each registry and
    # dense hook works inside a real DLRM, and the outputs it documents are
    # written.
    example = pathlib.Path(__file__).parents[2] / "examples" / "train_dlrm.py"
    args = ["--out", str(tmp_path), "--steps", "3", "--batch-size", "32", "--eval-batches", "1"]
    args += ["--seeds", "2", "--configs", "all"]
    done = subprocess.run(
        [sys.executable, str(example), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["runs"]) == {"fp32", "fp16", "bf16", "int8", "fp8", "mx4", "adaptive"} | {
        "dense-int8+ef",
        "dense-mx4+ef",
        "dense-mx4",
    }
    for name, seeds in results["runs"].items():
        assert len(seeds) == 2, name
        for run in seeds:
            assert len(run["losses"]) == 3 and all(map(math.isfinite, run["losses"])), name
        summary = results["summary"][name]
        assert math.isfinite(summary["held_out_gap"]), name
        assert math.isfinite(summary["held_out_gap_ci95"]), name
        assert summary["significant"] in (True, False), name
    assert results["summary"]["fp32"]["held_out_gap"] == 0.0
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert "held-out" in done.stdout and "95% interval" in done.stdout
    # The adaptive registry runs on TorchRec's sharders (on qcomm's exchange)
    # and says which codec carried each call: per seed, every step's call of
    # both collectives, forward and backward (the table-wise and the
    # column-wise tables take an all-to-all each, forward in training and
    # held-out evaluation), all within the candidates and the budget.
    forward_calls = {"all_to_all_pooled": 2 * (3 + 1), "reduce_scatter_pooled": 3 + 1}
    calls = {f"{name} forward": n for name, n in forward_calls.items()}
    calls |= {f"{name} backward": n * 3 // 4 for name, n in forward_calls.items()}
    for run in results["runs"]["adaptive"]:
        assert {k: v["calls"] for k, v in run["codecs_used"].items()} == calls
        for row in run["codecs_used"].values():
            # No more calls than the window: the most precise candidate carries
            # them, and only the window's last call may choose a cheaper one.
            assert row["codecs"] == {"bf16": row["calls"]}
            switched = [to for _, to in row["switches"]]
            allowed = ([], ["mx4"], ["int8"]) if row["calls"] == DEFAULT_WINDOW else ([],)
            assert switched in allowed, row
            assert set(row["errors"]) == {"mx4", "int8", "bf16"}
            assert row["errors"]["bf16"]["max"] < DEFAULT_MAX_ERROR
    assert all(run["codecs_used"] is None for run in results["runs"]["fp32"])
    used = results["summary"]["adaptive"]["codecs_used"]
    assert {k: v["calls"] for k, v in used.items()} == {k: 2 * n for k, n in calls.items()}
    assert all(v["shares"] == {"bf16": 1.0} and v["last"] == ["bf16"] * 2 for v in used.values())
    assert "adaptive  all_to_all_pooled forward: bf16 100% of 16 calls" in done.stdout
