"""What a collective call is handed: arguments and codecs are checked before
anything is sent, and a bad one gets a clear error naming it (what
test_collectives' validation cases do not cover); a codec whose encoded size
is not its ``calc_quantized_size`` gets a ``CodecError`` naming it, forward or
backward, on every path; inputs and gradients of any layout work. And what it
keeps: the output's graph does not keep the input alive, and a ``wait()`` that
failed fails again.

The multi-rank cases run on the spawn of 3 gloo ranks per transport that
test_agreement and test_failures share (``three_ranks``): every case ends with
a valid call whose exact result shows that the failures before it sent
nothing and left the ranks in step.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import (
    CastFP16Codec,
    ForeignIdentityCodec,
    RowInt8Codec,
    check_sequence,
    expect,
    run_all,
)
from dist_utils import TRANSPORTS
from three_ranks import both, check, in_step, runs, with_env

import qcomm
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs

# --------------------------------------------------------------------------
# Arguments checked before any communication.


class UncallableEncodeCodec(ForeignIdentityCodec):
    encode = 5  # type: ignore[assignment]


class StringDtypeCodec(ForeignIdentityCodec):
    @property
    def quantized_dtype(self) -> Any:
        return "uint8"


class Int16WireCodec(ForeignIdentityCodec):
    """A correct codec whose wire dtype gloo cannot carry."""

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1).round().to(torch.int16)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad.float()

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.int16


def case_arguments(rank: int, world: int) -> None:
    a2a, rs, seq = qcomm.all_to_all_pooled, qcomm.reduce_scatter_pooled, qcomm.all_to_all_sequence
    batches, dims = [2] * world, [3] * world
    x = torch.zeros(sum(batches), dims[rank])

    def codecs(codec: Any) -> QuantizedCommCodecs:
        return QuantizedCommCodecs(forward=codec, backward=ForeignIdentityCodec())

    cases: list[tuple[type[Exception], tuple[str, ...], Callable[[], Any]]] = [
        (TypeError, ("input", "dense", "sparse"), lambda: rs(torch.ones(world, 2).to_sparse())),
        (
            TypeError,
            ("codecs.forward.encode", "method", "int"),
            lambda: a2a(x, batches, dims, codecs=codecs(UncallableEncodeCodec())),
        ),
        (
            TypeError,
            ("codecs.forward.quantized_dtype", "torch.dtype", "'uint8'"),
            lambda: rs(x, input_splits=batches, codecs=codecs(StringDtypeCodec())),
        ),
        (
            CodecError,
            ("codecs.forward", "Int16WireCodec", "torch.int16", "gloo"),
            lambda: seq(
                x, input_splits=batches, output_splits=batches, codecs=codecs(Int16WireCodec())
            ),
        ),
        (
            TypeError,
            ("input", "gloo", "torch.float8_e4m3fn"),
            lambda: seq(x.to(torch.float8_e4m3fn), input_splits=batches, output_splits=batches),
        ),
        (
            ValueError,
            ("QCOMM_VERIFY", "'yes'"),
            lambda: with_env("yes", lambda: rs(x)),
        ),
    ]
    run_all([functools.partial(expect, e, w, f) for e, w, f in cases])
    # new_group hands the processes it leaves out a marker, not a group.
    sub = dist.new_group(list(range(world - 1)))
    if rank == world - 1:
        expect(ValueError, ("group", "not a member"), lambda: a2a(x, batches, dims, group=sub))
    else:
        y = torch.full((4, 2), float(rank))
        out = a2a(y, [2] * (world - 1), [2] * (world - 1), group=sub).wait()
        assert out.tolist() == [[float(k) for k in range(world - 1) for _ in range(2)]] * 2
    in_step(rank, world, "after-arguments")


# --------------------------------------------------------------------------
# An encoded size other than calc_quantized_size raises CodecError naming
# the codec, before anything is sent; on every path.


class BlockLiar(RowInt8Codec):
    """A block codec (encoded segment by segment) whose wire is a byte too long."""

    def __init__(self) -> None:
        super().__init__()
        self.info = CodecInfo(name="block_liar", bits_per_element=12, error_block=self.ROW)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        wire = super().encode(input_tensor, ctx)
        return torch.cat([wire, wire.new_zeros(1)])


class ShortSummableLiar(CastFP16Codec):
    """Summable (reduce-scatter sums it natively) and a wire one element short."""

    def __init__(self) -> None:
        super().__init__()
        self.info = CodecInfo(name="short_summable_liar", bits_per_element=16, summable=True)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return super().encode(input_tensor, ctx)[1:]


class NoInfoLiar(ForeignIdentityCodec):
    """A foreign codec without info, whose size promise is off by one."""

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len + 1


def case_lying_codecs(rank: int, world: int) -> None:
    batches, dims = [2] * world, [8] * world
    x = torch.ones(sum(batches), dims[rank])
    checks = []
    for liar, name in (
        (BlockLiar, "block_liar"),
        (ShortSummableLiar, "short_summable_liar"),
        (NoInfoLiar, "NoInfoLiar"),
    ):
        pair = QuantizedCommCodecs(forward=liar(), backward=liar())
        calls = [
            lambda pair=pair: qcomm.all_to_all_pooled(x, batches, dims, codecs=pair),
            lambda pair=pair: qcomm.reduce_scatter_pooled(x, codecs=pair),
            lambda pair=pair: qcomm.all_to_all_sequence(
                x, input_splits=batches, output_splits=batches, codecs=pair
            ),
        ]
        checks += [
            lambda call=call, name=name: expect(
                CodecError, (repr(name), "calc_quantized_size"), call
            )
            for call in calls
        ]
    run_all(checks)
    # A backward codec that lies is caught on the backward pass, on every rank.
    for start in (
        lambda y, p: qcomm.all_to_all_pooled(y, batches, dims, codecs=p),
        lambda y, p: qcomm.reduce_scatter_pooled(y, codecs=p),
        lambda y, p: qcomm.all_to_all_sequence(
            y, input_splits=batches, output_splits=batches, codecs=p
        ),
    ):
        pair = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=BlockLiar())
        y = x.clone().requires_grad_(True)
        out = start(y, pair).wait()
        expect(CodecError, ("'block_liar'", "calc_quantized_size"), out.sum().backward)
    in_step(rank, world, "after-lies")


# --------------------------------------------------------------------------
# Layouts, memory, waiting twice.


def case_layouts(rank: int, world: int) -> None:
    """Sequence inputs and gradients of any layout, uneven splits, with codecs."""
    matrix = [[(k + r) % world + 1 for r in range(world)] for k in range(world)]
    send = matrix[rank]
    recv = [matrix[k][rank] for k in range(world)]
    views: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "1-D strided": lambda b: b[:, 0],
        "column slice": lambda b: b[:, 2:6],
        "transposed": lambda b: b.t().contiguous().t(),
        "expanded": lambda b: b[:, :1].expand(-1, 4),
    }
    for codec in (None, "int8", "fp16"):
        check_sequence(rank, world, matrix, (4,), f"layout-{codec}", codec)
        codecs = both(qcomm.load_codec(codec)) if codec else None

        def seq(t: torch.Tensor, codecs: Any = codecs) -> torch.Tensor:
            return qcomm.all_to_all_sequence(
                t, input_splits=send, output_splits=recv, codecs=codecs
            ).wait()

        for label, view in views.items():
            base = torch.arange(sum(send) * 8.0).view(sum(send), 8).add(rank).requires_grad_(True)
            out = seq(view(base))
            ref = seq(view(base).detach().contiguous())
            assert torch.equal(out.detach(), ref), f"{codec} {label}: output differs"
            out.sum().backward()  # a stride-0 gradient
            plain = base.detach().clone().requires_grad_(True)
            view(plain).sum().backward()
            tol = 0.0 if codec is None else 0.05
            assert base.grad is not None
            torch.testing.assert_close(
                base.grad, plain.grad, atol=tol, rtol=0, msg=f"{codec} {label}: gradient"
            )
    in_step(rank, world, "layouts")


def case_memory_and_waits(rank: int, world: int) -> None:
    """The graph does not keep the input alive; a failed wait stays failed."""
    leaf = torch.ones(2 * world, 4, requires_grad=True)
    calls = {
        "pooled": lambda t: qcomm.all_to_all_pooled(t, [2] * world, [4] * world),
        "reduce-scatter": lambda t: qcomm.reduce_scatter_pooled(t),
        "sequence": lambda t: qcomm.all_to_all_sequence(
            t, input_splits=[2] * world, output_splits=[2] * world
        ),
    }
    for label, fn in calls.items():
        inp = leaf * 2  # not a leaf: only the collective could keep it
        ref = weakref.ref(inp)
        out = fn(inp).wait()
        del inp
        gc.collect()
        assert ref() is None, f"{label}: the output's graph keeps the input alive"
        out.sum().backward()

    def bad_callback(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("callback failed")

    pending = qcomm.all_to_all_pooled(torch.ones(2 * world, 4), [2] * world, [4] * world)
    pending.callbacks.append(bad_callback)
    for _ in range(2):
        try:
            pending.wait()
        except RuntimeError as err:
            assert "callback failed" in str(err), err
        else:
            raise AssertionError("wait() after a failed callback returned")
    in_step(rank, world, "memory")


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_arguments)
def test_bad_arguments_are_named_before_anything_is_sent(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_lying_codecs)
def test_codecs_that_lie_about_their_sizes_are_named(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_layouts)
def test_sequence_inputs_and_gradients_of_any_layout_and_uneven_splits(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_memory_and_waits)
def test_the_graph_keeps_no_input_alive_and_a_failed_wait_stays_failed(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)
