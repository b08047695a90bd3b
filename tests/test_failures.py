"""Hardening of the collectives: every call's headers catch ranks that
disagree after the first call, a rank that fails alone makes its peers raise
promptly instead of waiting, inputs and gradients of any layout work, and a
failed wait stays failed. By default (``QCOMM_VERIFY`` unset) the in-band
statuses alone catch a codec failing on one rank in any peer's region after
the first call, and a later call whose codec differs on one rank with the
same wire size; the DDP all-reduce is checked like the other collectives.
What the defaults do not catch is shown too.

One spawn of 3 gloo ranks per transport (forced with ``QCOMM_TRANSPORT``:
gloo's point-to-point, and the all-to-all NCCL takes) runs the multi-rank
cases (each reported as its own test, which also checks that the case opened
the transport it names and no other) with a process-group timeout of 30 s: a
peer that waited for the failing rank would take that long, so every error
must come well before it. Each case ends with a valid exact call, which shows
the ranks are in step.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env
from test_collectives import (
    POOLED,
    ForeignIdentityCodec,
    check_pooled,
    check_sequence,
)
from test_ddp import Bucket

import qcomm
import qcomm.collectives._agreement as qverify
import qcomm.collectives._transport as qtransport
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives.all_reduce import all_reduce, layout

WORLD = 3
PG_TIMEOUT = 30.0
# A peer told of a failure raises within this many seconds (a peer left
# waiting would raise only at the process-group timeout).
PROMPT = 8.0


def in_step(rank: int, world: int, tag: str) -> None:
    """A valid exact call: fails unless every rank is at the same point."""
    batches, dims = POOLED[world][0]
    check_pooled(rank, world, batches, dims, tag, None)


def exact_on(group: Any, rank: int, world: int) -> None:
    """A valid exact call on ``group``: the next call after a failure works."""
    x = torch.full((2 * world, 3), float(rank + 1))
    out = qcomm.all_to_all_pooled(x, [2] * world, [3] * world, group=group).wait()
    expected = torch.cat([torch.full((2, 3), float(k + 1)) for k in range(world)], dim=1)
    assert torch.equal(out, expected), f"the call after a failure gave {out.tolist()}"


def exact_all_reduce(group: Any, rank: int, world: int) -> None:
    """A valid exact all-reduce on ``group``."""
    got = all_reduce(torch.full((100,), float(rank + 1)), group=group)
    expected = float(world * (world + 1) // 2)
    assert torch.equal(got, torch.full((100,), expected)), f"all_reduce gave {got[:4].tolist()}"


@contextlib.contextmanager
def agreement_exchanges() -> Iterator[list[str]]:
    """Counts the agreement check's exchanges (by collective) while in the block."""
    seen: list[str] = []
    real = qverify.Agreement._exchange

    def counting(self: qverify.Agreement, failed: BaseException | None) -> None:
        seen.append(self.collective)
        real(self, failed)

    qverify.Agreement._exchange = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        qverify.Agreement._exchange = real  # type: ignore[method-assign]


def forced_transport() -> str:
    """The transport the spawn forces (``QCOMM_TRANSPORT``)."""
    return os.environ[qtransport.ENV]


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
    """Raises on NaN, as the plugin docs allow; counts its encodes (in a list,
    which its description shows by type only: alike on every rank)."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="nan_refusing", bits_per_element=32, error_block=1)
        self.encodes: list[int] = []

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self.encodes.append(input_tensor.numel())
        if torch.isnan(input_tensor).any():
            raise ValueError("NaN in the input")
        return input_tensor.reshape(-1)


class DecodeFailsOnLastRank(ForeignIdentityCodec):
    """Described alike on every rank; its decode raises on the last rank only."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="decode_fails", bits_per_element=32)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("cannot decode here")
        return input_grad


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
    # trailer), in a later peer's region, and in the backward pass. Rows
    # 0..127 go to rank 0 first, in chunks of 16 rows on point-to-point (the
    # all-to-all transport sends each peer one piece), rows 128..255 to rank 1;
    # the encodes counted on the failing rank show where it failed.
    pieces = {"point_to_point": (1, 8, 9), "all_to_all": (1, 1, 2)}[forced_transport()]
    wide = torch.ones(sum(batches) * 64, dims[rank])
    for (where, row), encodes in zip(
        (("first chunk", 0), ("later chunk", 127), ("later region", 128)), pieces
    ):
        codecs = both(NaNRefusingCodec())
        z = wide.clone()
        if odd:
            z[row, 0] = float("nan")
        words = ("NaN in the input",) if odd else (name,)
        raises(
            CodecError,
            words,
            functools.partial(
                lambda z, codecs: a2a(
                    z, [b * 64 for b in batches], dims, codecs=codecs, chunk_bytes=256
                ).wait(),
                z,
                codecs,
            ),
        )
        if odd:
            got = len(codecs.forward.encodes)
            assert got == encodes, f"{where}: failed on encode {got}, expected {encodes}"
    codecs = both(NaNRefusingCodec())
    g = torch.ones(sum(batches), dims[rank], requires_grad=True)
    out = a2a(g, batches, dims, codecs=codecs).wait()
    grad = torch.ones_like(out)
    if odd:
        grad[0, 0] = float("nan")
    raises(CodecError, () if odd else (name, "backward"), lambda: out.backward(grad))
    in_step(rank, world, "codec-fails")


# --------------------------------------------------------------------------
# Default settings (QCOMM_VERIFY unset): after a group's first call, the
# in-band statuses are all that catch a mistake.


def failing_calls(
    rank: int, world: int, group: Any
) -> list[tuple[str, Callable[[Any, int], Callable[[], Any]]]]:
    """(label, make) where ``make(codec, peer)`` is a call whose codec fails
    on the last rank in the region it sends to ``peer``: the first region it
    encodes for peer 0, a later one for peer 1 (it sends to 0, then 1)."""
    odd = rank == world - 1
    rows, width = [2] * world, 4
    a2a, rs, seq = qcomm.all_to_all_pooled, qcomm.reduce_scatter_pooled, qcomm.all_to_all_sequence

    def data(peer: int) -> torch.Tensor:
        # Rows 2 * peer onwards go to peer (every collective here).
        x = torch.ones(sum(rows), width)
        if odd:
            x[2 * peer, 0] = float("nan")
        return x

    def fwd(codec: Any) -> QuantizedCommCodecs:
        return QuantizedCommCodecs(forward=codec, backward=ForeignIdentityCodec())

    def bwd(codec: Any) -> QuantizedCommCodecs:
        return QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=codec)

    def pooled_backward(codec: Any, peer: int) -> Callable[[], Any]:
        x = torch.ones(sum(rows), width, requires_grad=True)
        out = a2a(x, rows, [width] * world, group=group, codecs=bwd(codec)).wait()
        grad = torch.ones_like(out)
        if odd:
            grad[0, width * peer] = float("nan")  # columns width * peer onwards go to peer
        return functools.partial(out.backward, grad)

    def sequence_backward(codec: Any, peer: int) -> Callable[[], Any]:
        x = torch.ones(sum(rows), width, requires_grad=True)
        out = seq(x, input_splits=rows, output_splits=rows, group=group, codecs=bwd(codec)).wait()
        return functools.partial(out.backward, data(peer))

    return [
        (
            "pooled forward",
            lambda codec, peer: (
                lambda: a2a(
                    data(peer), rows, [width] * world, group=group, codecs=fwd(codec)
                ).wait()
            ),
        ),
        ("pooled backward", pooled_backward),
        (
            "reduce-scatter forward",
            lambda codec, peer: lambda: rs(data(peer), group=group, codecs=fwd(codec)).wait(),
        ),
        (
            "sequence forward",
            lambda codec, peer: (
                lambda: seq(
                    data(peer),
                    input_splits=rows,
                    output_splits=rows,
                    group=group,
                    codecs=fwd(codec),
                ).wait()
            ),
        ),
        ("sequence backward", sequence_backward),
    ]


def case_codec_fails_after_first_call(rank: int, world: int) -> None:
    """A codec raising on the last rank in the first or a later peer's region,
    forward or backward, after the group's first call of each collective:
    every rank raises promptly (the failing rank its own error, the others
    naming it), no agreement exchange is involved, and the next call works."""
    odd = rank == world - 1
    group = dist.new_group()
    x = torch.ones(2 * world, 4)
    # The first call of each collective on the group: checked, agreeing.
    qcomm.all_to_all_pooled(x, [2] * world, [4] * world, group=group).wait()
    qcomm.reduce_scatter_pooled(x, group=group).wait()
    s = [2] * world
    qcomm.all_to_all_sequence(x, input_splits=s, output_splits=s, group=group).wait()
    with agreement_exchanges() as exchanges:
        for label, make in failing_calls(rank, world, group):
            for peer, where in ((0, "first region"), (1, "later region")):
                codec = NaNRefusingCodec()
                words = (
                    ("nan_refusing", "NaN in the input")
                    if odd
                    else (f"rank {world - 1}", "failed during the call")
                )
                try:
                    raises(CodecError, words, make(codec, peer))
                    if odd:
                        # Encoded (and failed on) its region for peer 0, or
                        # for peer 0 then peer 1.
                        assert len(codec.encodes) == peer + 1, f"encodes {codec.encodes}"
                except AssertionError as err:
                    raise AssertionError(f"{label}, {where}: {err}") from err
                exact_on(group, rank, world)
    assert exchanges == [], f"the agreement check ran: {exchanges}"
    in_step(rank, world, "fails-after-first-call")


def case_codec_differs_later(rank: int, world: int) -> None:
    """A later call whose codec differs on the last rank, with the same wire
    size (its bytes fit what the peers expect): every rank raises, naming the
    other side, on the forward or the backward pass; the next call works."""
    odd = rank == world - 1
    batches, dims = [2] * world, [4] * world
    group = dist.new_group()
    fp16 = qcomm.load_codec("fp16")
    x = torch.ones(sum(batches), dims[rank], requires_grad=True)
    qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=both(fp16)).wait()
    pairs = [
        ("fp16 loss_scale", fp16, qcomm.load_codec("fp16:loss_scale=1024")),
        ("bf16 for fp16", fp16, qcomm.load_codec("bf16")),
        ("foreign option", ScaledCodec(1.0), ScaledCodec(2.0)),
    ]
    others = tuple(f"rank {r}" for r in range(world - 1))
    words = (*others, "made another call") if odd else (f"rank {world - 1}", "made another call")
    with agreement_exchanges() as exchanges:
        for label, same, other in pairs:
            mine = other if odd else same
            fwd = QuantizedCommCodecs(forward=mine, backward=same)
            bwd = QuantizedCommCodecs(forward=same, backward=mine)

            def forward(codecs: QuantizedCommCodecs = fwd) -> Any:
                return qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=codecs).wait()

            out = qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=bwd).wait()
            for passed, call in (("forward", forward), ("backward", out.sum().backward)):
                try:
                    raises(CodecError, words, call)
                except AssertionError as err:
                    raise AssertionError(f"{label}, {passed}: {err}") from err
                exact_on(group, rank, world)
    assert exchanges == [], f"the agreement check ran: {exchanges}"
    in_step(rank, world, "differs-later")


def case_not_caught_by_default(rank: int, world: int) -> None:
    """What the defaults do not catch after a group's first call (the first
    call's check and QCOMM_VERIFY=1 do). Not tested, as it ends the process:
    a peer sending more bytes than a rank expects (other split lists, a codec
    of another wire size) makes gloo abort it (NCCL fails or hangs)."""
    odd = rank == world - 1
    batches, dims = [2] * world, [4] * world
    x = torch.full((sum(batches), dims[rank]), float(rank + 1))
    expected = torch.cat([torch.full((2, 4), float(k + 1)) for k in range(world)], dim=1)
    # A codec failing on one rank while decoding raises there alone; the
    # peers' results are sound.
    group = dist.new_group()
    codecs = both(DecodeFailsOnLastRank())
    qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()

    def decoded() -> Any:
        return qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=codecs).wait()

    if odd:
        raises(CodecError, ("decode_fails", "cannot decode here"), decoded)
    else:
        out = decoded()
        assert torch.equal(out, expected), f"a peer's result: {out.tolist()}"
    exact_on(group, rank, world)
    # A rank whose arguments are invalid on a later call raises at once, but
    # its peers wait for it until the group's timeout (here 3 s), then raise
    # the backend's error.
    timeout = 3.0
    short = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    qcomm.all_to_all_pooled(x, batches, dims, group=short).wait()
    bad = [9] + batches[1:] if odd else batches

    def invalid() -> Any:
        return qcomm.all_to_all_pooled(x, bad, dims, group=short).wait()

    if odd:
        raises(ValueError, ("batch_size_per_rank", "summing"), invalid)
    else:
        start = time.monotonic()
        try:
            invalid()
        except CodecError as err:
            raise AssertionError(f"caught after all: {err}") from err
        except Exception:
            took = time.monotonic() - start
            assert took >= 0.9 * timeout, f"raised after {took:.1f} s, before the timeout"
        else:
            raise AssertionError("the peer of a rank that never sent returned")
    in_step(rank, world, "not-caught")


# --------------------------------------------------------------------------
# The DDP all-reduce: checked on its first call, statuses on every call.


def case_all_reduce_mistakes(rank: int, world: int) -> None:
    """Hooks or all_reduce calls with different codecs raise on the first call
    of a group (default) and on a later one with QCOMM_VERIFY=1; a later call
    whose codec differs with the same wire size, or whose reduce-scatter or
    all-gather codec fails on one rank, raises on every rank by default, and
    the next all-reduce is exact."""
    odd = rank == world - 1
    name = f"rank {world - 1}"
    group = dist.new_group()
    n = 100
    failures: list[str] = []

    def check(label: str, fn: Callable[[], Any]) -> None:
        # Every rank makes every call, whatever a check says: in step.
        try:
            fn()
        except AssertionError as err:
            failures.append(f"{label}: {err}")

    def hook(spec: str) -> Callable[[], Any]:
        state, fn = qcomm.ddp_comm_hook(spec, process_group=group)
        return lambda: fn(state, Bucket(torch.full((n,), float(rank + 1)))).wait()

    def reduce(buffer: torch.Tensor, **codecs: Any) -> Callable[[], Any]:
        return lambda: all_reduce(buffer, group=group, **codecs)

    def ones() -> torch.Tensor:
        return torch.full((n,), float(rank + 1))

    with agreement_exchanges() as exchanges:
        # The first call: hooks with different codecs, then (a failed check
        # is not remembered as done) all_reduce calls whose gather codec differs.
        differ = (f"{name} differs on reduce_codec", "gather_codec", "Int8Codec", "FP16Codec")
        check(
            "hooks, first call", lambda: raises(CodecError, differ, hook("int8" if odd else "fp16"))
        )
        gather = qcomm.load_codec("bf16" if odd else "fp16")
        check(
            "all_reduce, first call",
            lambda: raises(
                CodecError,
                (f"{name} differs on gather_codec",),
                reduce(ones(), gather_codec=gather),
            ),
        )
        check("first good call", lambda: exact_all_reduce(group, rank, world))
        # The hook reduces on its worker's own group, whose first call is
        # checked on its own: a good one, so that later hook calls are later.
        check("first good hook call", lambda: hook("fp16")())
        if exchanges != ["all_reduce"] * 4:
            failures.append(f"first calls: agreement exchanges {exchanges}")
        # A later call, checked with QCOMM_VERIFY=1.
        verified = functools.partial(
            raises,
            CodecError,
            (f"{name} differs on reduce_codec",),
            hook("int8" if odd else "fp16"),
        )
        check("QCOMM_VERIFY=1, later call", lambda: with_env("1", verified))
        # A later call by default: another codec with the same wire size.
        said = tuple(f"rank {r}" for r in range(world - 1)) if odd else (name,)
        check(
            "later call, bf16 for fp16",
            lambda: raises(
                CodecError,
                ("all_reduce", *said, "made another call"),
                hook("bf16" if odd else "fp16"),
            ),
        )
        exact_all_reduce(group, rank, world)
        # A codec failing on the last rank in the reduce-scatter (in the block
        # it sends first, to rank 0, or in a later one, to rank 1) or in the
        # all-gather (its own block, summed, then encoded once for all peers).
        bounds = layout(n, world, 1)
        words = (
            ("nan_refusing", "NaN in the input")
            if odd
            else ("all_reduce", name, "failed during the call")
        )
        for step, block, encodes in (
            ("reduce_codec", 0, 1),
            ("reduce_codec", 1, 2),
            ("gather_codec", world - 1, 1),
        ):
            codec = NaNRefusingCodec()
            buffer = ones()
            if odd:
                buffer[bounds[block]] = float("nan")
            call = reduce(buffer, **{step: codec})
            check(
                f"{step} failing in block {block}",
                functools.partial(raises, CodecError, words, call),
            )
            if odd and len(codec.encodes) != encodes:
                failures.append(f"{step} failing in block {block}: encodes {codec.encodes}")
            exact_all_reduce(group, rank, world)
    assert not failures, "\n".join(failures)
    assert exchanges == ["all_reduce"] * 5, f"agreement exchanges: {exchanges}"
    in_step(rank, world, "all-reduce-mistakes")


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
    "codec_fails_after_first_call": case_codec_fails_after_first_call,
    "codec_differs_later": case_codec_differs_later,
    "not_caught_by_default": case_not_caught_by_default,
    "layouts": case_layouts,
    "memory_and_waits": case_memory_and_waits,
    "all_reduce_mistakes": case_all_reduce_mistakes,
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


@pytest.fixture(scope="module")
def spawned() -> dict[str, Callable[[int], dict[str, Outcome]]]:
    # A rank that did not raise as a case expects is out of step with the
    # others: a failed check stops the run too.
    return {
        transport: outcomes_per_world_size(
            run_case,
            list(CASES),
            env=transport_env(transport),
            stop_on_failed_check=True,
            timeout=400.0,
            pg_timeout=PG_TIMEOUT,
        )
        for transport in TRANSPORTS
    }


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_multi_rank(
    transport: str, case: str, spawned: dict[str, Callable[[int], dict[str, Outcome]]]
) -> None:
    outcome = spawned[transport](WORLD)[case]
    check_case(outcome, f"{case} on {WORLD} ranks, {transport}", transport)
