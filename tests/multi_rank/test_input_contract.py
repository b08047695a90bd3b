"""A call has read its input by the time it returns (one spawn of 2 gloo ranks
per transport): a caller that refills its input before ``wait()`` (the next
batch, ``x.copy_(next_batch)``) gets the output of the values it passed, for
every collective with a block of its own (pooled and sequence all-to-alls,
reduce-scatter, all-gather) and the codecs ``noop``, ``fp16``, ``int8`` and
one whose wire is its input itself:

- the output, on every rank, is bit for bit that of a call whose input was
  left alone (the exchange does not depend on timing), this rank's own block
  included;
- under autograd, the gradient of an input that is changed in place before
  ``wait()`` goes where it went when the call was made.

Each rank in turn leads: it makes its call, refills its input and only then
lets its peer make its own, so the leader's call is certainly in flight when
its input changes (its peer has not even called: counted, on the
point-to-point transport, as no call completed in the background yet, and
one more each after ``wait()``). The leader's background thread is held by
an earlier call that needs the peer too, so that even what it does first
comes after the change. Every call is handed to the background thread there,
however small; a small call made as usual is finished where it is waited
for instead (counted: nothing completes in the background).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import ForeignIdentityCodec
from counting import counted
from dist_utils import TRANSPORTS, Outcome, check_case, run_outcomes, transport_env

import qcomm
from qcomm import CodecInfo, QuantizedCommCodecs
from qcomm.awaitable import Awaitable
from qcomm.collectives import _exchange, _transport, all_gather_pooled

WORLD = 2
ROWS = 64  # rows of each rank's block
WIDTH = 16
PG_TIMEOUT = 20.0
CHUNK_BYTES = 1024  # several chunks per peer: parts of the work come later


class HandsBackCodec(ForeignIdentityCodec):
    """A codec from elsewhere whose wire is its input itself, cut in chunks."""

    info = CodecInfo("hands_back", 32.0, rel_error_bound=0.0)


#: the codecs, by name: the no-op one, two that encode, and one whose wire is
#: the caller's memory although it is not qcomm's no-op codec
CODECS: dict[str, Callable[[], Any]] = {
    "noop": lambda: qcomm.load_codec("noop"),
    "fp16": lambda: qcomm.load_codec("fp16"),
    "int8": lambda: qcomm.load_codec("int8"),
    "hands_back": HandsBackCodec,
}

Call = Callable[[torch.Tensor, int, int, QuantizedCommCodecs], Awaitable[torch.Tensor]]


def _pooled(x: torch.Tensor, rank: int, world: int, c: QuantizedCommCodecs) -> Awaitable:
    return qcomm.all_to_all_pooled(
        x, [ROWS] * world, [WIDTH] * world, codecs=c, chunk_bytes=CHUNK_BYTES
    )


def _sequence(x: torch.Tensor, rank: int, world: int, c: QuantizedCommCodecs) -> Awaitable:
    splits = [ROWS] * world
    return qcomm.all_to_all_sequence(
        x, input_splits=splits, output_splits=splits, codecs=c, chunk_bytes=CHUNK_BYTES
    )


def _reduce_scatter(x: torch.Tensor, rank: int, world: int, c: QuantizedCommCodecs) -> Awaitable:
    return qcomm.reduce_scatter_pooled(x, codecs=c, chunk_bytes=CHUNK_BYTES)


def _all_gather(x: torch.Tensor, rank: int, world: int, c: QuantizedCommCodecs) -> Awaitable:
    return all_gather_pooled(x, codecs=c, chunk_bytes=CHUNK_BYTES)


#: each collective, and the rows of its input in blocks
COLLECTIVES: dict[str, tuple[Call, int]] = {
    "all_to_all_pooled": (_pooled, WORLD),
    "all_to_all_sequence": (_sequence, WORLD),
    "reduce_scatter_pooled": (_reduce_scatter, WORLD),
    "all_gather_pooled": (_all_gather, 1),
}
CASES = [f"{name}/{codec}" for name in COLLECTIVES for codec in CODECS]


def _refilled_before_wait(case: str, rank: int, world: int) -> None:
    # Every call here is handed to the background thread, however small:
    # the path where the input is read latest. (Small calls are finished
    # where they are waited for: checked at the end.)
    hand_off = _exchange._HAND_OFF
    _exchange._HAND_OFF = 0
    try:
        problems = _refill_checks(case, rank, world)
    finally:
        _exchange._HAND_OFF = hand_off
    name, codec = case.split("/")
    call, blocks = COLLECTIVES[name]
    codecs = QuantizedCommCodecs(forward=CODECS[codec](), backward=CODECS[codec]())
    values = torch.randn(blocks * ROWS, WIDTH, generator=torch.Generator().manual_seed(rank))
    completed = counted("background_completed").total()
    call(values, rank, world, codecs).wait()
    if counted("background_completed").total() != completed:
        problems.append("a small call was handed to the background thread")
    assert not problems, f"{case}: {'; '.join(problems)}"


def _refill_checks(case: str, rank: int, world: int) -> list[str]:
    name, codec = case.split("/")
    call, blocks = COLLECTIVES[name]
    codecs = QuantizedCommCodecs(forward=CODECS[codec](), backward=CODECS[codec]())
    store = dist.distributed_c10d._get_default_store()
    background = _transport.choice() == "point_to_point"
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(blocks * ROWS, WIDTH, generator=gen)
    # The first call of a collective checks the ranks' agreement, together:
    # made here, so that the leader's calls below return before its peer's.
    call(values, rank, world, codecs).wait()
    # Checks fail at the end: a rank that stopped half-way would leave its
    # peer waiting for the next round.
    problems = []
    for leader in range(world):
        x = values.clone()
        if rank != leader:
            store.wait([f"{case}/{leader}"], datetime.timedelta(seconds=PG_TIMEOUT))
        completed = counted("background_completed").total()
        # Holds the background thread until the peer calls (see the module).
        first = call(values.clone(), rank, world, codecs)
        pending = call(x, rank, world, codecs)
        x.copy_(values + 1000.0)  # the next batch
        if rank == leader:
            if counted("background_completed").total() != completed:
                problems.append("a call completed before its peer called")
            store.set(f"{case}/{leader}", "refilled")
        reference, out = first.wait(), pending.wait()
        ran = counted("background_completed").total() - completed
        if ran != (2 if background else 0):
            problems.append(f"{ran} of the 2 calls completed in the background")
        changed = (out != reference).any(dim=-1).nonzero().flatten().tolist()
        if changed:
            problems.append(f"led by rank {leader}, {len(changed)} of {len(out)} rows changed")

    # Under autograd: the gradient reaches the input the call was given.
    grads = []
    for refill in (False, True):
        leaf = values.clone().requires_grad_(True)
        x = leaf * 2.0
        pending = call(x, rank, world, codecs)
        if refill:
            x.copy_(values + 1000.0)
        out = pending.wait()
        out.backward(torch.ones_like(out))
        assert leaf.grad is not None
        grads.append(leaf.grad)
    if not grads[0].abs().sum() > 0:
        problems.append("no gradient reached the input")
    if not torch.equal(grads[1], grads[0]):
        problems.append("the gradient followed the refill")
    return problems


@pytest.fixture(scope="module", params=TRANSPORTS)
def spawned(request: pytest.FixtureRequest) -> tuple[str, dict[str, Outcome]]:
    transport = request.param
    return transport, run_outcomes(
        _refilled_before_wait,
        WORLD,
        CASES,
        timeout=180.0,
        pg_timeout=PG_TIMEOUT,
        env=transport_env(transport),
    )


@pytest.mark.parametrize("case", CASES)
def test_input_refilled_before_wait(case: str, spawned: tuple[str, dict[str, Outcome]]) -> None:
    transport, outcomes = spawned
    check_case(outcomes[case], f"{case} on {transport}", transport)
