"""Fuzzing with hypothesis: the built-in codecs with random options and data,
and the collectives with random (valid and invalid) arguments on 2 ranks.

Codecs: every built-in codec with drawn options (``row_dim``, ``group_size``,
``rounding``, ``loss_scale``) goes through the conformance kit on drawn
lengths and seed, and through round trips of drawn data (tiny, huge,
constant, mixed magnitudes), held to the bound its :class:`~qcomm.CodecInfo`
declares.

Collectives: each rank runs the same hypothesis test with ``derandomize=True``,
so both draw the same examples: the global split lists, trailing shape, codec
and a fault. Valid calls are checked against references computed without
qcomm (the checks of collective_checks, forward and backward). Faults are
global invalid arguments (every rank must raise the same error, naming the
argument), one rank's invalid arguments (that rank raises its error, the other
a CodecError naming it) and disagreements between ranks (a CodecError naming
the rank on both). Verification runs on every call (``QCOMM_VERIFY=1``), so
every valid configuration drawn also shows that the agreement check raises no
false alarm. After each example the ranks compare outcomes, so a failure is
raised on both ranks in the same example and they stay in step.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from codec_names import BUILTIN
from collective_checks import check_pooled, check_reduce_scatter, check_sequence
from dist_utils import run_ranks
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qcomm
from qcomm import CodecError, config
from qcomm.testing import check_codec

SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


# --------------------------------------------------------------------------
# Codecs.


@st.composite
def codec_specs(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(BUILTIN))
    if name == "fp8_e4m3_tensor":  # no options
        return name
    if name in ("fp16", "bf16"):
        scale = draw(st.one_of(st.none(), st.sampled_from([2.0**-10, 0.5, 3.0, 1024.0])))
        return name if scale is None else f"{name}:loss_scale={scale!r}"
    if name == "mx4":
        group = 2 * draw(st.integers(1, 48))
        rounding = draw(st.sampled_from(["nearest", "floor", "even", "stochastic", "ceil"]))
        return f"mx4:group_size={group},rounding={rounding}"
    return f"{name}:row_dim={draw(st.integers(1, 96))}"


@st.composite
def data(draw: st.DrawFn, limit: float) -> torch.Tensor:
    """A 1-D float32 tensor within [-limit, limit]: random, tiny, huge, constant or mixed."""
    top = torch.tensor(limit, dtype=torch.float32)
    if top.item() > limit:  # rounded up to float32: step back below
        top = torch.nextafter(top, torch.zeros(()))
    limit = top.item()
    n = draw(st.integers(0, 300))
    kind = draw(st.sampled_from(["normal", "tiny", "huge", "constant", "mixed", "drawn"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "drawn":
        values = draw(
            st.lists(st.floats(-limit, limit, width=32, allow_nan=False), min_size=n, max_size=n)
        )
        return torch.tensor(values, dtype=torch.float32)
    if kind == "constant":
        return torch.full((n,), draw(st.floats(-limit, limit, width=32)), dtype=torch.float32)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "tiny":  # float32 subnormals and just above
        x = x * 2.0**-130
    elif kind == "huge":
        x = (x / (x.abs().max() if n else 1)) * limit
    elif kind == "mixed":  # every element its own magnitude, 2**-60 to 2**60
        x = x * torch.pow(2.0, torch.randint(-60, 61, (n,), generator=g).double())
    return x.clamp(-limit, limit).float()


def block_magnitude(x: torch.Tensor, block: int) -> torch.Tensor:
    """``s`` of the declared bound: |x|, or the max |x| of each element's block."""
    a = x.abs().double()
    if block == 1 or a.numel() == 0:
        return a
    if block == 0:
        return torch.full_like(a, a.max().item())
    pad = -a.numel() % block
    rows = torch.cat([a, a.new_zeros(pad)]).view(-1, block)
    return rows.amax(dim=1, keepdim=True).expand_as(rows).reshape(-1)[: a.numel()]


@settings(SETTINGS, max_examples=60)
@given(spec=codec_specs(), st_data=st.data())
def test_round_trip_of_drawn_data_within_declared_bound(spec: str, st_data: st.DataObject) -> None:
    codec = qcomm.load_codec(spec)
    info = qcomm.codec_info(codec)
    x = st_data.draw(data(min(info.max_abs_input, 3.0e38)), label="x")
    for ctx in (None, codec.create_context()):
        wire = codec.encode(x, ctx)
        assert wire.dim() == 1 and wire.dtype == codec.quantized_dtype
        assert wire.numel() == codec.calc_quantized_size(x.numel(), ctx), spec
        y = codec.decode(wire, ctx)
        assert y.dim() == 1 and x.numel() <= y.numel(), (spec, tuple(y.shape))
        y = y[: x.numel()].double()
        bound = info.rel_error_bound * block_magnitude(x, info.error_block) + info.abs_error_bound
        err = (y - x.double()).abs()
        bad = ~(err <= bound)  # a NaN is bad too
        if bad.any():
            i = int(bad.nonzero()[0])
            raise AssertionError(
                f"{spec}: element {i} of {x.numel()}: {x[i].item()!r} came back as "
                f"{y[i].item()!r}, error {err[i].item():.3g} > bound {bound[i].item():.3g}"
            )


@settings(SETTINGS, max_examples=12)
@given(
    spec=codec_specs(),
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=4),
    seed=st.integers(0, 2**31),
)
def test_conformance_kit_with_drawn_options(spec: str, lengths: list[int], seed: int) -> None:
    check_codec(qcomm.load_codec(spec), lengths=lengths, seed=seed)


# --------------------------------------------------------------------------
# Collectives on 2 ranks.

WORLD = 2
CODECS = [
    None,
    "fp16",
    "bf16",
    "int8",
    "int8:row_dim=8",
    "fp8_e4m3",
    "fp8_e5m2:row_dim=16",
    "mx4:group_size=8",
    "test_row_int8",
    "test_tensor_int8",
]
FAULTS = ["none", "global", "one_rank", "disagree"]
MAX_EXAMPLES = 200
BAD_SPLITS = ["too_long", "negative", "float", "sum"]


def bad_splits(splits: list[int], how: str) -> list[Any]:
    if how == "too_long":
        return [*splits, 0]
    if how == "negative":
        return [-1, splits[1] + splits[0] + 1]
    if how == "float":
        return [float(splits[0]), splits[1]]
    return [splits[0] + 1, splits[1]]


def expected_local(how: str) -> type[Exception]:
    return TypeError if how == "float" else ValueError


@st.composite
def examples(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["pooled", "reduce_scatter", "sequence"]))
    ex: dict[str, Any] = {
        "op": op,
        "codec": draw(st.sampled_from(CODECS)),
        # Half of the examples valid, the other half one of the faults.
        "fault": draw(st.sampled_from(["none"] * 3 + FAULTS[1:])),
        "bad": draw(st.sampled_from(BAD_SPLITS)),
        "odd": draw(st.integers(0, WORLD - 1)),
        "tag": f"fz{draw(st.integers(0, 10**6))}",
    }
    rows = st.lists(st.integers(0, 4), min_size=WORLD, max_size=WORLD)
    if op == "pooled":
        ex["batches"] = draw(rows)
        ex["dims"] = draw(st.lists(st.integers(0, 40), min_size=WORLD, max_size=WORLD))
    elif op == "reduce_scatter":
        ex["splits"] = draw(st.one_of(st.none(), rows))
        ex["rest"] = draw(st.sampled_from([(), (1,), (5,), (17,), (2, 3)]))
    else:
        ex["matrix"] = draw(st.lists(rows, min_size=WORLD, max_size=WORLD))
        ex["rest"] = draw(st.sampled_from([(1,), (6,), (33,), (2, 4)]))
    return ex


def run_valid(rank: int, ex: dict[str, Any]) -> None:
    op, codec, tag = ex["op"], ex["codec"], ex["tag"]
    if op == "pooled":
        check_pooled(rank, WORLD, ex["batches"], ex["dims"], tag, codec)
    elif op == "reduce_scatter":
        check_reduce_scatter(rank, WORLD, ex["splits"], ex["rest"], tag, codec)
    else:
        check_sequence(rank, WORLD, ex["matrix"], ex["rest"], tag, codec)


def faulty_call(rank: int, ex: dict[str, Any]) -> tuple[Any, str]:
    """The faulty call of an example on this rank, and the argument at fault."""
    op, bad, odd = ex["op"], ex["bad"], ex["odd"]
    spec = ex["codec"]
    codecs = None
    if spec is not None and not spec.startswith("test_"):
        if ex["fault"] == "disagree" and op == "pooled" and rank == odd:
            spec = "bf16" if spec != "bf16" else "fp16"
        codecs = qcomm.QuantizedCommCodecs(qcomm.load_codec(spec), qcomm.load_codec(spec))
    faulty = ex["fault"] == "global" or rank == odd
    if op == "pooled":
        batches, dims = ex["batches"], ex["dims"]
        x = torch.ones(sum(batches), dims[rank])
        if ex["fault"] == "disagree":
            if codecs is not None:
                return (lambda: qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs)), "codecs"
            other = [dims[1 - rank] + 1 if k != rank else dims[k] for k in range(WORLD)]
            call_dims = other if rank == odd else dims
            return (lambda: qcomm.all_to_all_pooled(x, batches, call_dims)), "dim_sum_per_rank"
        call_batches = bad_splits(batches, bad) if faulty else batches
        return (
            lambda: qcomm.all_to_all_pooled(x, call_batches, dims, codecs=codecs)
        ), "batch_size_per_rank"
    if op == "reduce_scatter":
        splits = ex["splits"] or [1] * WORLD
        rest = ex["rest"]
        if ex["fault"] == "disagree":
            shape = (sum(splits), *rest, 2 if rank == odd else 1)
            x = torch.ones(shape)
            return (
                lambda: qcomm.reduce_scatter_pooled(x, input_splits=splits, codecs=codecs)
            ), "input.shape[1:]"
        x = torch.ones(sum(splits), *rest)
        call_splits = bad_splits(splits, bad) if faulty else splits
        return (
            lambda: qcomm.reduce_scatter_pooled(x, input_splits=call_splits, codecs=codecs)
        ), "input_splits"
    matrix, rest = ex["matrix"], ex["rest"]
    sends = matrix[rank]
    recvs = [matrix[k][rank] for k in range(WORLD)]
    x = torch.ones(sum(sends), *rest)
    if ex["fault"] == "disagree":
        if rank == odd:
            recvs = [recvs[0] + 1, *recvs[1:]]
        return (
            lambda: qcomm.all_to_all_sequence(
                x, input_splits=sends, output_splits=recvs, codecs=codecs
            )
        ), "output_splits"
    call_sends = bad_splits(sends, bad) if faulty else sends
    return (
        lambda: qcomm.all_to_all_sequence(
            x, input_splits=call_sends, output_splits=recvs, codecs=codecs
        )
    ), "input_splits"


def check_fault(rank: int, ex: dict[str, Any]) -> str:
    """Runs the faulty call, checks this rank's error; returns its summary."""
    call, field = faulty_call(rank, ex)
    try:
        call().wait()
    except Exception as err:
        raised: BaseException = err
    else:
        raise AssertionError(f"{ex}: the faulty call raised nothing on rank {rank}")
    text = f"{type(raised).__name__}: {raised}"
    fault, odd = ex["fault"], ex["odd"]
    if fault == "global" or (fault == "one_rank" and rank == odd):
        expected: type[Exception] = expected_local(ex["bad"])
        words = [field]
    elif fault == "one_rank":
        expected, words = CodecError, [f"rank {odd} rejected", field]
    elif field == "output_splits":
        expected, words = CodecError, ["do not match", f"rank {odd} expects"]
    else:
        expected, words = CodecError, [f"rank {odd} differ" if WORLD > 2 else "differ", field]
    assert isinstance(raised, expected), f"{ex}: expected {expected.__name__}, got {text}"
    missing = [w for w in words if w not in str(raised)]
    assert not missing, f"{ex}: message lacks {missing}: {text}"
    # The same error everywhere for a global fault: its type and the
    # argument it names (values may differ, e.g. each rank's own splits).
    return f"{type(raised).__name__} {str(raised).split(':')[0]}"


def agree_on_outcome(outcome: str) -> list[str]:
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, outcome)
    return everyone


@settings(SETTINGS, max_examples=MAX_EXAMPLES, phases=[Phase.explicit, Phase.generate])
@given(ex=examples())
def fuzz_one(ex: dict[str, Any]) -> None:
    rank = dist.get_rank()
    try:
        if ex["fault"] == "none":
            run_valid(rank, ex)
            outcome = "ok"
        else:
            outcome = check_fault(rank, ex)
    except Exception:
        outcome = f"FAILED on rank {rank}: {ex}\n{traceback.format_exc()}"
    SEEN[ex["fault"] if outcome.startswith(("ok", "Value", "Type", "Codec")) else "failed"] += 1
    everyone = agree_on_outcome(outcome)
    failed = [o for o in everyone if o.startswith("FAILED")]
    # Both ranks fail the same example, so that hypothesis's report replays
    # it on both and they stay in step.
    assert not failed, "\n".join(failed)
    if ex["fault"] == "global":
        assert len(set(everyone)) == 1, f"{ex}: ranks raised different errors: {everyone}"


SEEN: collections.Counter[str] = collections.Counter()


def fuzz_collectives(rank: int, world: int) -> dict[str, int]:
    config.configure(verify="always")
    fuzz_one()
    # Still in step after every fault: one more exact call.
    check_pooled(rank, world, [2, 1], [3, 4], "fuzz-end", None)
    return dict(SEEN)


def test_collectives_with_drawn_arguments_on_two_ranks() -> None:
    seen = run_ranks(fuzz_collectives, WORLD, timeout=300.0, pg_timeout=30.0)
    assert seen[0] == seen[1], seen
    # Every kind of example was drawn, and all of them ran.
    assert sorted(seen[0]) == sorted(FAULTS), seen[0]
    assert sum(seen[0].values()) == MAX_EXAMPLES, seen[0]


@pytest.mark.parametrize("how", BAD_SPLITS)
def test_bad_splits_are_bad(how: str) -> None:
    # The fuzzer's invalid split lists are invalid for every valid one.
    from qcomm.collectives._args import check_splits

    for splits in ([0, 0], [3, 1], [4, 4]):
        with pytest.raises(expected_local(how)):
            check_splits(bad_splits(splits, how), "s", WORLD, sum(splits))
