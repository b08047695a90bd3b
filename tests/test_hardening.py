"""Hardening of the collectives: every call's headers catch ranks that
disagree after the first call, a rank that fails alone makes its peers raise
promptly instead of waiting, inputs and gradients of any layout work, and a
failed wait stays failed.

One spawn of 3 gloo ranks runs the multi-rank cases (each reported as its own
test) with a process-group timeout of 30 s: a peer that waited for the
failing rank would take that long, so every error must come well before it.
Each case ends with a valid exact call, which shows the ranks are in step.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_cases
from test_collectives import (
    POOLED,
    ForeignIdentityCodec,
    check_pooled,
    check_sequence,
)

import qcomm
import qcomm.collectives._agreement as qverify
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs

WORLD = 3
PG_TIMEOUT = 30.0
# A peer told of a failure raises within this many seconds (a peer left
# waiting would raise only at the process-group timeout).
PROMPT = 8.0


def in_step(rank: int, world: int, tag: str) -> None:
    """A valid exact call: fails unless every rank is at the same point."""
    batches, dims = POOLED[world][0]
    check_pooled(rank, world, batches, dims, tag, None)


def with_env(value: str | None, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(qverify.ENV)
    if value is None:
        os.environ.pop(qverify.ENV, None)
    else:
        os.environ[qverify.ENV] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(qverify.ENV, None)
        else:
            os.environ[qverify.ENV] = old


def raises(error: type[Exception], words: tuple[str, ...], fn: Callable[[], Any]) -> float:
    """Runs ``fn``, expecting ``error`` with ``words`` in its message; returns seconds taken."""
    start = time.monotonic()
    try:
        fn()
    except error as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"{error.__name__} message {str(err)!r} lacks {missing}"
        took = time.monotonic() - start
        assert took < PROMPT, f"raised after {took:.1f} s: {err}"
        return took
    except Exception as err:
        raise AssertionError(f"expected {error.__name__} naming {words}, got {err!r}") from err
    raise AssertionError(f"expected {error.__name__} naming {words}, nothing was raised")


class ScaledCodec(ForeignIdentityCodec):
    """A foreign codec keeping its option where only its behaviour shows it."""

    def __init__(self, scale: float) -> None:
        self.options = {"scale": scale}
        self.info = CodecInfo(name="scaled", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1) * self.options["scale"]

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad / self.options["scale"]


class RankPaddedCodec(ForeignIdentityCodec):
    """Describes itself alike on every rank but pads rows by the rank: the
    wire sizes differ, which only the call's own headers can see."""

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        extra = dist.get_rank() if dist.is_initialized() else 0
        return dim_per_rank[my_rank] + extra, extra


class NaNRefusingCodec(ForeignIdentityCodec):
    """Raises on NaN, as the plugin docs allow."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="nan_refusing", bits_per_element=32, error_block=1)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if torch.isnan(input_tensor).any():
            raise ValueError("NaN in the input")
        return input_tensor.reshape(-1)


def fbgemm_fp16(loss_scale: float | None) -> Any:
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.distributed.fbgemm_qcomm_codec import FbgemmQuantizedCommCodec

    return FbgemmQuantizedCommCodec(comm_precision=SparseType.FP16, loss_scale=loss_scale)


def both(codec: Any) -> QuantizedCommCodecs:
    return QuantizedCommCodecs(forward=codec, backward=codec)


# --------------------------------------------------------------------------
# Silent corruption: ranks that disagree are caught on every call.


def case_codec_options(rank: int, world: int) -> None:
    """Codecs differing only in an option the old check could not see."""
    batches, dims = [2] * world, [4] * world
    x = torch.ones(sum(batches), dims[rank])
    odd = rank == world - 1

    def pooled(codecs: QuantizedCommCodecs) -> Any:
        return qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs).wait()

    pairs = [
        ("fbgemm loss_scale", fbgemm_fp16(None), fbgemm_fp16(1024.0)),
        ("foreign option", ScaledCodec(1.0), ScaledCodec(2.0)),
        ("fp16 loss_scale", qcomm.load_codec("fp16"), qcomm.load_codec("fp16:loss_scale=1024")),
    ]
    for label, same, other in pairs:
        mine = both(other if odd else same)
        group = dist.new_group()

        def call(mine: QuantizedCommCodecs = mine) -> Any:
            # The group of the moment, read when called.
            return qcomm.all_to_all_pooled(
                x,
                batches,
                dims,
                codecs=mine,
                group=group,  # noqa: B023
            ).wait()

        # Checked on every call (the first call of a group and a later one),
        # then by default (the first call of a new group only).
        for verify, calls in (("1", 2), (None, 1)):
            if verify is None:
                group = dist.new_group()
            for _ in range(calls):
                try:
                    with_env(verify, lambda: raises(CodecError, (f"rank {world - 1}",), call))
                except AssertionError as err:
                    raise AssertionError(f"{label}, QCOMM_VERIFY={verify}: {err}") from err
        pooled(both(same))
    in_step(rank, world, "codec-options")


def case_after_first_call(rank: int, world: int) -> None:
    """With QCOMM_VERIFY=1 the headers alone (the full check switched off
    here) catch splits, codecs and wire sizes that differ, on every call."""
    real = qverify.Agreement._exchange
    qverify.Agreement._exchange = lambda self, failed: None  # type: ignore[method-assign]
    try:
        with_env("1", lambda: after_first_call(rank, world))
    finally:
        qverify.Agreement._exchange = real  # type: ignore[method-assign]
    in_step(rank, world, "after-first-call")


def after_first_call(rank: int, world: int) -> None:
    """Splits and backward codecs that differ after a first good call."""
    batches, dims = [2] * world, [4] * world
    odd = rank == world - 1
    group = dist.new_group()
    x = torch.ones(sum(batches), dims[rank])
    qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()  # verified, agreeing

    # Splits: a pooled call whose batch sizes differ on one rank.
    bad = [3, 1] + [2] * (world - 2) if odd else batches

    def pooled_splits() -> Any:
        return qcomm.all_to_all_pooled(x, bad, dims, group=group).wait()

    raises(CodecError, ("rank",), pooled_splits)
    # Sequence: one rank expects more rows from rank 0 than it sends.
    s_in = [1] * world
    s_out = [2] + [1] * (world - 1) if odd else s_in
    y = torch.ones(world, 4)
    qcomm.all_to_all_sequence(y, input_splits=s_in, output_splits=s_in, group=group).wait()
    expected = ("rank 0", f"rank {world - 1}") if rank in (0, world - 1) else ("rank",)
    raises(
        CodecError,
        expected,
        lambda: qcomm.all_to_all_sequence(
            y, input_splits=s_in, output_splits=s_out, group=group
        ).wait(),
    )
    # A backward codec that differs on one rank: the forward is fine, the
    # backward raises on every rank.
    fwd = qcomm.load_codec("fp16")
    bwd = qcomm.load_codec("int8" if odd else "bf16")
    codecs = QuantizedCommCodecs(forward=fwd, backward=bwd)
    xg = torch.ones(sum(batches), dims[rank], requires_grad=True)
    qcomm.all_to_all_pooled(xg, batches, dims, group=group, codecs=both(fwd)).wait()
    out = qcomm.all_to_all_pooled(xg, batches, dims, group=group, codecs=codecs).wait()
    raises(CodecError, ("backward", "rank"), lambda: out.sum().backward())
    # Wire sizes that differ though the codecs describe themselves alike:
    # with full verification too (it used to abort the process).
    padded = both(RankPaddedCodec())
    raises(
        CodecError,
        ("wire elements",),
        lambda: qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=padded).wait(),
    )


# --------------------------------------------------------------------------
# Hangs: a rank that fails alone, forward or backward, first call or later.


def case_one_rank_fails(rank: int, world: int) -> None:
    batches, dims = [2] * world, [4] * world
    odd = rank == world - 1
    x = torch.ones(sum(batches), dims[rank])
    name = f"rank {world - 1}"
    a2a, seq = qcomm.all_to_all_pooled, qcomm.all_to_all_sequence
    s = [1] * world
    y = torch.ones(world, 4)
    huge = [2**63] + [1] * (world - 1)

    def pooled(g: Any) -> Any:  # g: a process group, or None
        return a2a(x, batches, dims, group=g).wait()

    cases: list[tuple[str, type[Exception], Callable[[Any], Any], Callable[[Any], Any]]] = [
        (
            "invalid group",
            TypeError,
            lambda g: a2a(x, batches, dims, group="world"),  # type: ignore[arg-type]
            pooled,
        ),
        ("meta input", ValueError, lambda g: a2a(x.to("meta"), batches, dims, group=g), pooled),
        (
            "split >= 2**63",
            ValueError,
            lambda g: seq(y, input_splits=s, output_splits=huge, group=g),
            lambda g: seq(y, input_splits=s, output_splits=s, group=g).wait(),
        ),
        ("QCOMM_VERIFY=yes", ValueError, lambda g: with_env("yes", lambda: pooled(g)), pooled),
    ]
    # With QCOMM_VERIFY=1 (the headers, on every call), and by default on the
    # first call of a group (the full check). A rank with an invalid
    # QCOMM_VERIFY acts as if it were unset: it meets peers that check by
    # default, on a new group.
    for verify in ("1", None):
        for label, error, bad, good in cases:
            if (verify == "1") == label.startswith("QCOMM_VERIFY"):
                continue
            group = dist.new_group() if verify is None else None
            try:
                fn = bad if odd else good
                want: tuple[type[Exception], tuple[str, ...]] = (
                    (error, ()) if odd else (CodecError, (name,))
                )
                # Called at once, within this iteration.
                with_env(verify, lambda: raises(*want, lambda: fn(group)))  # noqa: B023
            except AssertionError as err:
                raise AssertionError(f"{label}, QCOMM_VERIFY={verify}: {err}") from err
        in_step(rank, world, f"fails-{verify}")

    with_env("1", lambda: codec_fails(rank, world))
    in_step(rank, world, "codec-fails")


def codec_fails(rank: int, world: int) -> None:
    batches, dims = [2] * world, [4] * world
    odd = rank == world - 1
    name = f"rank {world - 1}"
    a2a = qcomm.all_to_all_pooled
    # A codec raising on NaN on one rank: on the first chunk, on a later
    # chunk (the peers have posted receives: they get zeros, then a failed
    # trailer), and in the backward pass.
    codecs = both(NaNRefusingCodec())
    wide = torch.ones(sum(batches) * 64, dims[rank])
    for where in ("first chunk", "later chunk"):
        z = wide.clone()
        if odd:
            # Rows 0..127 go to rank 0 first, in chunks of 16 rows.
            z[127 if where == "later chunk" else 0, 0] = float("nan")
        words = () if odd else (name,)
        raises(
            CodecError,
            words,
            functools.partial(
                lambda z: a2a(
                    z, [b * 64 for b in batches], dims, codecs=codecs, chunk_bytes=256
                ).wait(),
                z,
            ),
        )
    g = torch.ones(sum(batches), dims[rank], requires_grad=True)
    out = a2a(g, batches, dims, codecs=codecs).wait()
    grad = torch.ones_like(out)
    if odd:
        grad[0, 0] = float("nan")
    raises(CodecError, () if odd else (name, "backward"), lambda: out.backward(grad))
    in_step(rank, world, "codec-fails")


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


CASES: dict[str, Callable[[int, int], None]] = {
    "codec_options": case_codec_options,
    "after_first_call": case_after_first_call,
    "one_rank_fails": case_one_rank_fails,
    "layouts": case_layouts,
    "memory_and_waits": case_memory_and_waits,
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


@pytest.fixture(scope="module")
def spawned() -> dict[str, str | None]:
    # A rank that did not raise as a case expects is out of step with the
    # others: a failed check stops the run too.
    return run_cases(
        run_case,
        WORLD,
        list(CASES),
        stop_on_failed_check=True,
        timeout=400.0,
        pg_timeout=PG_TIMEOUT,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_multi_rank(case: str, spawned: dict[str, str | None]) -> None:
    failure = spawned[case]
    if failure:
        pytest.fail(f"{case} on {WORLD} ranks:\n{failure}", pytrace=False)
