"""One rank fails alone, the others must not wait for it: its arguments are
invalid, its codec raises (encoding any chunk of any peer's region, forward or
backward, on the first call of a group or a later one), or it dies or stalls.
Every rank raises promptly, the failing rank its own error and the others a
``CodecError`` naming it, and the next call works. What the defaults
(``QCOMM_VERIFY`` unset) do not catch after a group's first call is shown too.

The multi-rank cases run on the spawn of 3 gloo ranks per transport that
test_arguments and test_agreement share (``three_ranks``). Dead and stalled
ranks get spawns of their own with a short process-group timeout, on each
transport too.
"""

from __future__ import annotations

import ast
import datetime
import functools
import os
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import ForeignIdentityCodec
from counting import counted
from dist_utils import TRANSPORTS, RankFailure, run_ranks, transport_env, wrong_transport
from three_ranks import (
    NaNRefusingCodec,
    agreement_exchanges,
    both,
    check,
    exact_on,
    in_step,
    raises,
    runs,
    with_env,
)

import qcomm
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs, config


def forced_transport() -> str:
    """The transport the spawn forces (``QCOMM_TRANSPORT``)."""
    return config.get().transport


class DecodeFailsOnLastRank(ForeignIdentityCodec):
    """Described alike on every rank; its decode raises on the last rank only."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="decode_fails", bits_per_element=32)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("cannot decode here")
        return input_grad


# --------------------------------------------------------------------------
# Its arguments or its codec, on the first call of a group or a later one.


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
# in-band statuses are all that catch a codec failing on one rank, and what
# they do not catch.


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


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_one_rank_fails)
def test_a_failure_on_one_rank_makes_every_rank_raise_promptly(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_codec_fails_after_first_call)
def test_a_codec_failing_after_the_first_call_raises_on_every_rank(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_not_caught_by_default)
def test_after_the_first_call_a_decode_failure_stays_local_and_bad_arguments_wait_for_the_timeout(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


# --------------------------------------------------------------------------
# It dies or stalls: the survivors raise within the process group's timeout. run_ranks reports a rank that raised with its
# traceback; one that hangs is killed after `grace` seconds and has none.


GONE_PG_TIMEOUT = 3.0


def start_any(rank: int, world: int, i: int) -> Any:
    x = torch.full((2 * world, 4), float(i))
    op = i % 3
    if op == 0:
        return qcomm.all_to_all_pooled(x, [2] * world, [4] * world)
    if op == 1:
        return qcomm.reduce_scatter_pooled(x)
    return qcomm.all_to_all_sequence(x, input_splits=[2] * world, output_splits=[2] * world)


def dying_rank(rank: int, world: int, scenario: str) -> None:
    try:
        die_or_survive(rank, world, scenario)
    except Exception as err:
        # The survivor's error says which transports it opened.
        raise RuntimeError(f"opened {dict(counted('transport_opened'))!r}") from err


def die_or_survive(rank: int, world: int, scenario: str) -> None:
    if scenario == "exit_mid_run":
        # Rank 1 exits with calls of its own in flight; rank 0 keeps going.
        for i in range(400):
            pending = start_any(rank, world, i)
            if rank == 1 and i == 25:
                os._exit(7)
            pending.wait()
    elif scenario == "exit_before_first_call":
        # Rank 0's first call of an op waits in the agreement exchange. The
        # barrier first: gloo's own connections may still be forming on rank
        # 0 when rank 1's init returns, and an exit then fails rank 0's init
        # instead of its first call.
        dist.barrier()
        if rank == 1:
            os._exit(7)
        start_any(rank, world, 0).wait()
    elif scenario == "stall":
        # Rank 1 is alive but never calls: only the timeout can end the wait.
        if rank == 1:
            time.sleep(120)
        for i in range(3):
            start_any(rank, world, i).wait()
    raise AssertionError(f"{scenario}: rank {rank} finished without noticing the missing rank")


@pytest.mark.parametrize("scenario", ["exit_mid_run", "exit_before_first_call", "stall"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivor_raises_when_a_rank_is_gone(transport: str, scenario: str) -> None:
    # After a rank exits, rank 0 gets 4 timeouts to raise before it is killed;
    # when rank 0 raises first (stall), the sleeping rank is killed at once.
    grace = 1.0 if scenario == "stall" else 4 * GONE_PG_TIMEOUT
    with pytest.raises(RankFailure) as info:
        run_ranks(
            dying_rank,
            2,
            scenario,
            timeout=90.0,
            pg_timeout=GONE_PG_TIMEOUT,
            grace=grace,
            env=transport_env(transport),
        )
    tracebacks = info.value.tracebacks
    opened = re.search(r"RuntimeError: opened (\{.*\})", tracebacks.get(0, ""))
    assert opened is not None, f"rank 0 did not say what it opened: {tracebacks}"
    problem = wrong_transport([ast.literal_eval(opened.group(1))], transport)
    assert problem is None, problem
    assert 0 in tracebacks, f"rank 0 hung until killed instead of raising: {tracebacks}"
    survivor = tracebacks[0]
    assert "finished without noticing" not in survivor, survivor
    # It raised from inside a qcomm collective (the wait or the agreement
    # exchange), with the backend's error.
    assert "qcomm/collectives" in survivor, survivor
    if scenario != "stall":
        assert "exited with code 7" in tracebacks[1], tracebacks
