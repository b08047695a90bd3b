"""The collectives on 2 and 3 gloo ranks, on both transports, against
references computed without qcomm (the checks of ``collective_checks``).

One spawn per world size and transport (forced with ``QCOMM_TRANSPORT``:
gloo's point-to-point, and the all-to-all NCCL takes) runs every case; each
case is reported as its own test, which also checks that its calls opened the
transport it names and no other.

- Every collective exact without codecs (float16 and bfloat16 too, gradient
  division too) and with a foreign identity codec; within the declared bound
  with every codec of ``codec_names`` and the test-local ones.
- Twenty calls in flight at once, waited for in reverse order, give the bits
  of the same calls made one by one; kept receive buffers never leak between
  calls.
- Bad arguments and codecs that lie raise before anything is sent, naming
  what is wrong (more of both in test_arguments.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import (
    ALL_GATHER,
    CODEC_NAMES,
    POOLED,
    REDUCE_SCATTER,
    SEQUENCE,
    ForeignIdentityCodec,
    assert_equal,
    check_all_gather,
    check_pooled,
    check_reduce_scatter,
    check_sequence,
    expect,
    gen,
    offsets,
    pair,
    run_all,
)
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env

import qcomm
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives import _backends, all_gather_pooled

WORLD_SIZES = (2, 3)


# --------------------------------------------------------------------------
# Codecs that break a promise, or run on another device.


class LyingCodec(ForeignIdentityCodec):
    """Breaks one promise, chosen by ``lie``."""

    def __init__(self, lie: str) -> None:
        self.lie = lie
        self.info = CodecInfo(name=f"liar_{lie}", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        x = input_tensor.reshape(-1)
        if self.lie == "size":
            return torch.cat([x, x.new_zeros(1)])
        if self.lie == "dtype":
            return x.double()
        return x

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad[1:] if self.lie == "decode" and input_grad.numel() else input_grad

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return -1 if self.lie == "calc" else input_len


class CudaOnlyCodec(ForeignIdentityCodec):
    def __init__(self) -> None:
        self.info = CodecInfo(name="cuda_only", bits_per_element=32, devices=("cuda",))


# --------------------------------------------------------------------------
# The cases, each run on every rank of a spawn.


def case_noop(rank: int, world: int) -> None:
    run_all(
        [
            *(
                functools.partial(check_pooled, rank, world, b, d, f"np{i}", None)
                for i, (b, d) in enumerate(POOLED[world])
            ),
            *(
                functools.partial(check_reduce_scatter, rank, world, sp, rest, f"nr{i}", None)
                for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
            ),
            *(
                functools.partial(check_sequence, rank, world, m, rest, f"ns{i}", None)
                for i, (m, rest) in enumerate(SEQUENCE[world])
            ),
        ]
    )


def case_noop_dtypes_and_division(rank: int, world: int) -> None:
    # Without codecs a float16 tensor travels as float16 and comes back as is.
    batches, dims = POOLED[world][0]
    splits, rest = REDUCE_SCATTER[world][0]
    matrix, width = SEQUENCE[world][0]
    run_all(
        [
            functools.partial(check_pooled, rank, world, batches, dims, "nh", None, torch.float16),
            functools.partial(check_pooled, rank, world, batches, dims, "nd", None, division=True),
            functools.partial(
                check_reduce_scatter, rank, world, splits, rest, "rh", None, None, torch.float16
            ),
            functools.partial(
                check_reduce_scatter, rank, world, splits, rest, "rd", None, division=True
            ),
            functools.partial(
                check_sequence, rank, world, matrix, width, "sh", None, None, torch.bfloat16
            ),
        ]
    )


def case_foreign_identity(rank: int, world: int) -> None:
    # No info: reduce-scatter goes through the all-to-all and a float32 sum,
    # every block is encoded on its own; still exact.
    codecs = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=ForeignIdentityCodec())
    run_all(
        [
            *(
                functools.partial(
                    check_reduce_scatter, rank, world, sp, rest, f"fr{i}", None, codecs
                )
                for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
            ),
            *(
                functools.partial(check_sequence, rank, world, m, rest, f"fs{i}", None, codecs)
                for i, (m, rest) in enumerate(SEQUENCE[world])
            ),
        ]
    )


def case_codec_pooled(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_pooled, rank, world, b, d, f"cp{i}", codec)
            for i, (b, d) in enumerate(POOLED[world])
        ]
    )


def case_codec_reduce_scatter(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_reduce_scatter, rank, world, sp, rest, f"cr{i}", codec)
            for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
        ]
    )


def case_codec_all_gather(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_all_gather, rank, world, sp, rest, f"ca{i}", codec)
            for i, (sp, rest) in enumerate(ALL_GATHER[world])
        ]
    )


def case_all_gather_exact_and_checked(rank: int, world: int) -> None:
    # The first call on the group is checked: ranks that disagree on the
    # blocks raise, naming what differs, like on any collective.
    mine = 1 if rank == 0 else 2  # rank 0 sees its own block as one row
    with pytest.raises(CodecError, match="output_splits"):
        all_gather_pooled(torch.ones(mine, 3), output_splits=[mine] + [2] * (world - 1)).wait()
    with pytest.raises(
        ValueError, match=r"output_splits: this rank's block is input.shape\[0\] = 4"
    ):
        all_gather_pooled(torch.ones(4, 3), output_splits=[1] * world)
    # Without codecs: exact both ways; equal blocks by default.
    for i, (splits, rest) in enumerate(ALL_GATHER[world]):
        check_all_gather(rank, world, splits, rest, f"ae{i}", None)
    x = gen("ae:eq", (2, 3), True)
    out = all_gather_pooled(x).wait()
    assert out.shape == (2 * world, 3) and torch.equal(out[2 * rank : 2 * rank + 2], x)


def case_codec_sequence(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_sequence, rank, world, m, rest, f"cs{i}", codec)
            for i, (m, rest) in enumerate(SEQUENCE[world])
        ]
    )


def overlapped_calls(world: int) -> list[tuple[str, str | None, int]]:
    ops = ("pooled", "reduce_scatter", "sequence")
    codecs = (None, "test_fp16", "test_row_int8", "test_tensor_int8")
    return [(ops[i % 3], codecs[i % 4], i) for i in range(20)]


def start_call(
    rank: int, world: int, op: str, codec: str | None, i: int
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    codecs = pair(codec) if codec else None
    if op == "pooled":
        batches, dims = POOLED[world][i % len(POOLED[world])]
        x = gen(f"o{i}:{rank}", (sum(batches), dims[rank]), False).requires_grad_(True)
        pending = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs)
        g = gen(f"og{i}:{rank}", (batches[rank], sum(dims)), False)
    elif op == "reduce_scatter":
        splits, rest = REDUCE_SCATTER[world][i % len(REDUCE_SCATTER[world])]
        sizes = splits if splits is not None else [2] * world
        x = gen(f"o{i}:{rank}", (sum(sizes), *rest), False).requires_grad_(True)
        pending = qcomm.reduce_scatter_pooled(x, input_splits=splits, codecs=codecs)
        g = gen(f"og{i}:{rank}", (sizes[rank], *rest), False)
    else:
        matrix, rest = SEQUENCE[world][i % len(SEQUENCE[world])]
        received = sum(matrix[k][rank] for k in range(world))
        x = gen(f"o{i}:{rank}", (sum(matrix[rank]), *rest), False).requires_grad_(True)
        pending = qcomm.all_to_all_sequence(
            x,
            input_splits=matrix[rank],
            output_splits=[matrix[k][rank] for k in range(world)],
            codecs=codecs,
        )
        g = gen(f"og{i}:{rank}", (received, *rest), False)
    return x, pending, g


def case_overlapped(rank: int, world: int) -> None:
    calls = overlapped_calls(world)
    sequential = []
    for op, codec, i in calls:
        x, pending, g = start_call(rank, world, op, codec, i)
        out = pending.wait()
        (out * g).sum().backward()
        assert x.grad is not None
        sequential.append((out.detach(), x.grad))
    started = [start_call(rank, world, op, codec, i) for op, codec, i in calls]
    # Waited for in reverse order, while all 20 are in flight.
    outs = [pending.wait() for _, pending, _ in reversed(started)][::-1]
    loss = sum((out * g).sum() for out, (_, _, g) in zip(outs, started))
    loss.backward()  # type: ignore[union-attr]
    assert outs[0] is started[0][1].wait(), "a second wait() must return the same tensor"
    for (op, codec, i), out, (x, _, _), (ref_out, ref_grad) in zip(
        calls, outs, started, sequential
    ):
        assert_equal(f"call {i} ({op}, {codec}) output", out.detach(), ref_out)
        assert x.grad is not None
        assert_equal(f"call {i} ({op}, {codec}) input gradient", x.grad, ref_grad)


def case_buffer_reuse(rank: int, world: int) -> None:
    # Receive buffers of 1 MiB and more are kept and reused between calls:
    # calls that size, one after the other and several in flight at once,
    # must not see each other's data.
    batches = [300 + k for k in range(world)]
    dims = [520 + 8 * k for k in range(world)]
    matrix = [[150 + 7 * k + r for r in range(world)] for k in range(world)]
    foreign = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=ForeignIdentityCodec())
    checks: list[Callable[[], None]] = []
    for i in range(2):
        checks += [
            functools.partial(check_pooled, rank, world, batches, dims, f"bp{i}", None),
            functools.partial(
                check_reduce_scatter, rank, world, batches, (520,), f"br{i}", None, foreign
            ),
            functools.partial(check_sequence, rank, world, matrix, (520,), f"bs{i}", None, foreign),
            functools.partial(
                check_reduce_scatter, rank, world, batches, (520,), f"bf{i}", "test_fp16"
            ),
        ]
    run_all(checks)
    xs = [
        [gen(f"bf{i}:{k}", (sum(batches), dims[k]), True) for k in range(world)] for i in range(4)
    ]
    pending = [qcomm.all_to_all_pooled(x[rank], batches, dims) for x in xs]
    outs = [p.wait() for p in reversed(pending)][::-1]
    rows = offsets(batches)
    for i, (x, out) in enumerate(zip(xs, outs)):
        ref = torch.cat([xk[rows[rank] : rows[rank + 1]] for xk in x], dim=1)
        assert_equal(f"call {i} in flight", out, ref)
    # Without codecs a sequence all-to-all returns its receive buffer itself:
    # that one must never be reused while the caller holds it.
    column = [matrix[k][rank] for k in range(world)]
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(3):
        x = [gen(f"bh{i}:{k}", (sum(matrix[k]), 1040), True) for k in range(world)]
        call = qcomm.all_to_all_sequence(x[rank], input_splits=matrix[rank], output_splits=column)
        sent = [offsets(matrix[k]) for k in range(world)]
        ref = torch.cat([x[k][sent[k][rank] : sent[k][rank + 1]] for k in range(world)])
        held.append((call.wait(), ref))
    for i, (out, ref) in enumerate(held):
        assert_equal(f"held output {i}", out, ref)


def case_validation(rank: int, world: int) -> None:
    batches, dims = [2] * world, [3] * world
    x = torch.zeros(sum(batches), dims[rank])
    # Typed Any: the cases call them with arguments of the wrong types on purpose.
    a2a: Any = qcomm.all_to_all_pooled
    rs: Any = qcomm.reduce_scatter_pooled
    seq: Any = qcomm.all_to_all_sequence
    ones = [1] * world
    cases: list[tuple[type[Exception], tuple[str, ...], Callable[[], Any]]] = [
        (TypeError, ("input", "Tensor"), lambda: a2a([[0.0]], batches, dims)),
        (TypeError, ("input", "int64"), lambda: a2a(x.long(), batches, dims)),
        (ValueError, ("input", "2-D"), lambda: a2a(x.view(-1), batches, dims)),
        (ValueError, ("batch_size_per_rank", f"({world})"), lambda: a2a(x, batches + [0], dims)),
        (ValueError, ("batch_size_per_rank[0]", "-1"), lambda: a2a(x, [-1] + batches[1:], dims)),
        (TypeError, ("batch_size_per_rank[0]", "float"), lambda: a2a(x, [2.0] + batches[1:], dims)),
        (TypeError, ("batch_size_per_rank[0]", "bool"), lambda: a2a(x, [True] * world, dims)),
        (TypeError, ("batch_size_per_rank", "int"), lambda: a2a(x, 2, dims)),
        (ValueError, ("batch_size_per_rank", "summing"), lambda: a2a(x, ones, dims)),
        (
            ValueError,
            (f"dim_sum_per_rank[{rank}]", "input.shape[1]"),
            lambda: a2a(x, batches, [4] * world),
        ),
        (TypeError, ("codecs", "object"), lambda: a2a(x, batches, dims, codecs=object())),
        (
            TypeError,
            ("codecs.forward", "encode"),
            lambda: a2a(x, batches, dims, codecs=QuantizedCommCodecs(forward=object())),
        ),
        (
            CodecError,
            ("cuda_only", "cpu"),
            lambda: a2a(x, batches, dims, codecs=QuantizedCommCodecs(backward=CudaOnlyCodec())),
        ),
        (TypeError, ("gradient_division",), lambda: a2a(x, batches, dims, gradient_division=1)),
        (TypeError, ("group", "str"), lambda: a2a(x, batches, dims, group="world")),
        (ValueError, ("input", "divisible", str(world)), lambda: rs(torch.zeros(world + 1, 2))),
        (ValueError, ("input_splits", "summing"), lambda: rs(x, input_splits=ones)),
        (ValueError, ("input", "0-D"), lambda: rs(torch.tensor(1.0))),
        (TypeError, ("input", "floating"), lambda: rs(torch.zeros(world, dtype=torch.int32))),
        (
            ValueError,
            ("output_splits", f"({world})"),
            lambda: seq(x, input_splits=batches, output_splits=[1]),
        ),
        (
            ValueError,
            ("input_splits", "input.shape[0]"),
            lambda: seq(x, input_splits=ones, output_splits=ones),
        ),
        (
            TypeError,
            ("output_splits[1]", "str"),
            lambda: seq(x, input_splits=batches, output_splits=[1, "1"] + [1] * (world - 2)),
        ),
    ]
    run_all([functools.partial(expect, error, words, fn) for error, words, fn in cases])
    # A CPU tensor on an NCCL group (the backend is faked: this machine has no
    # GPU). Forced point-to-point (gloo's) is refused first, by the transport.
    words: tuple[str, ...] = ("input", "nccl", "cpu")
    if os.environ.get("QCOMM_TRANSPORT") == "point_to_point":
        words = ("QCOMM_TRANSPORT=point_to_point", "gloo", "nccl", "cpu")
    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment,return-value]
    _backends._known.clear()  # what the group's backend does is asked once
    try:
        expect(ValueError, words, lambda: a2a(x, batches, dims))
    finally:
        dist.get_backend = real_get_backend
        _backends._known.clear()
    # Nothing was sent by the failed calls: the group is still in step.
    check_pooled(rank, world, POOLED[world][0][0], POOLED[world][0][1], "after-validation", None)


def case_lying_codecs(rank: int, world: int) -> None:
    batches, dims = [2] * world, [3] * world
    x = torch.ones(sum(batches), dims[rank])
    checks: list[Callable[[], None]] = []
    for lie, words in (
        ("size", ("liar_size", "calc_quantized_size")),
        ("dtype", ("liar_dtype", "float64")),
        ("calc", ("liar_calc", "non-negative")),
    ):
        codecs = QuantizedCommCodecs(forward=LyingCodec(lie))
        # Raised when called, before anything is sent, on every op.
        calls = [
            functools.partial(qcomm.all_to_all_pooled, x, batches, dims, codecs=codecs),
            functools.partial(qcomm.reduce_scatter_pooled, x, codecs=codecs),
            functools.partial(
                qcomm.all_to_all_sequence,
                x,
                input_splits=batches,
                output_splits=batches,
                codecs=codecs,
            ),
        ]
        checks += [functools.partial(expect, CodecError, words, call) for call in calls]
    run_all(checks)
    # A decode of the wrong length is caught where it happens, on wait().
    codecs = QuantizedCommCodecs(forward=LyingCodec("decode"))
    pending = qcomm.all_to_all_sequence(
        x, input_splits=batches, output_splits=batches, codecs=codecs
    )
    expect(CodecError, ("liar_decode", "decode"), pending.wait)
    check_pooled(rank, world, POOLED[world][0][0], POOLED[world][0][1], "after-lies", None)


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (
        case_noop,
        case_noop_dtypes_and_division,
        case_foreign_identity,
        case_overlapped,
        case_buffer_reuse,
        case_validation,
        case_lying_codecs,
        case_all_gather_exact_and_checked,
    )
}
CODEC_CASES: dict[str, Callable[[int, int, str], None]] = {
    f.__name__: f
    for f in (
        case_codec_pooled,
        case_codec_reduce_scatter,
        case_codec_sequence,
        case_codec_all_gather,
    )
}
CASE_IDS = [*CASES, *(f"{op}[{codec}]" for codec in CODEC_NAMES for op in CODEC_CASES)]


def run_case(case: str, rank: int, world: int) -> None:
    if case in CASES:
        CASES[case](rank, world)
        return
    op, codec = case.rstrip("]").split("[")
    CODEC_CASES[op](rank, world, codec)


Spawned = dict[str, Callable[[int], dict[str, Outcome]]]


@pytest.fixture(scope="module")
def spawned() -> Spawned:
    """Runs every case once per transport and world size, on first use, and remembers the outcome."""
    return {
        transport: outcomes_per_world_size(
            run_case, CASE_IDS, env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport in TRANSPORTS
    }


def check(
    spawned: Spawned, transport: str, world: int, case: Callable[..., None], *codec: str
) -> None:
    """Fails the calling test with ``case``'s tracebacks (on ``codec`` where given),
    or unless every rank opened ``transport`` only."""
    name = f"{case.__name__}[{codec[0]}]" if codec else case.__name__
    check_case(spawned[transport](world)[name], f"{name} on {world} ranks, {transport}", transport)


# Each test checks its case of the spawn, on each transport and world size.


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_collective_without_codecs_is_exact(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_noop)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_codecs_half_dtypes_travel_as_they_are_and_gradients_divide(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_noop_dtypes_and_division)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_codec_without_info_is_exact_through_the_all_to_all_and_a_float32_sum(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_foreign_identity)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_overlapped_calls_waited_in_reverse_order_match_sequential_ones(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_overlapped)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reused_receive_buffers_never_mix_calls(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_buffer_reuse)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_invalid_arguments_are_refused_naming_the_argument(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_validation)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_codecs_that_lie_about_their_sizes_are_caught(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_lying_codecs)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_gather_is_exact_and_its_first_call_checked(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_all_gather_exact_and_checked)


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pooled_all_to_all_is_within_the_codecs_bound(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_codec_pooled, codec)


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reduce_scatter_is_within_the_codecs_bound(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_codec_reduce_scatter, codec)


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sequence_all_to_all_is_within_the_codecs_bound(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_codec_sequence, codec)


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_gather_is_within_the_codecs_bound(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_codec_all_gather, codec)
