"""What ranks do between a call and its backward pass (one spawn of 2 gloo ranks):

- two all-to-alls waited for in different orders on the two ranks run their
  backward passes in the order they were made, on both, with every input's
  own gradient (their outputs join the autograd graph when they are made);
- backward passes run in different orders on the two ranks never swap: every
  rank raises a ``CodecError`` (by default, and with ``QCOMM_VERIFY=1``)
  instead of mixing gradients;
- a rank whose pooled input needs no gradient (no tables, or frozen ones)
  still takes part in the backward pass its peer runs (no wait until the
  group's timeout);
- ``mx4:rounding=stochastic`` seeded differently per rank agrees on the first
  call, and the agreement check leaves the user's random stream alone;

and, without ranks, a garbage collection inside ``lease()`` that frees an
earlier output never deadlocks.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_utils import run_cases

import qcomm
from qcomm import CodecError, QuantizedCommCodecs, config
from qcomm.collectives import _buffers

WORLD = 2
PG_TIMEOUT = 30.0
PROMPT = 8.0  # seconds: a rank left waiting would take PG_TIMEOUT


def raises_promptly(words: tuple[str, ...], fn: Callable[[], Any]) -> None:
    start = time.monotonic()
    try:
        fn()
    except CodecError as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"CodecError {err} lacks {missing}"
        assert time.monotonic() - start < PROMPT, f"raised only after the timeout: {err}"
        return
    raise AssertionError(f"expected a CodecError naming {words}, nothing raised")


def in_step(rank: int, world: int) -> None:
    """A valid exact call, forward and backward: fails unless the ranks are in step."""
    x = torch.arange(2.0 * world * 3).view(2 * world, 3).add(rank).requires_grad_(True)
    out = qcomm.all_to_all_pooled(x, [2] * world, [3] * world).wait()
    out.backward(torch.ones_like(out))
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))


def case_wait_order(rank: int, world: int) -> None:
    """Outputs waited for, or backward passes run, in different orders."""
    batches, dims = [2] * world, [4] * world
    for verify in ("first", "always"):
        with config.configured(verify=verify):
            # Rank 0 waits for a then b, rank 1 for b then a; each weighs the
            # output it waited for first by 1 and the other by 10. The graph
            # follows the order the calls were made, alike on both ranks.
            a = torch.full((sum(batches), dims[rank]), 1.0, requires_grad=True)
            b = torch.full((sum(batches), dims[rank]), 2.0, requires_grad=True)
            pa = qcomm.all_to_all_pooled(a, batches, dims)
            pb = qcomm.all_to_all_pooled(b, batches, dims)
            first, second = (pa, pb) if rank == 0 else (pb, pa)
            out_first, out_second = first.wait(), second.wait()
            (out_first.sum() + 10.0 * out_second.sum()).backward()
            # Block s of an input's gradient is rank s's weight of its output.
            weight_a = torch.tensor([1.0] + [10.0] * (world - 1))
            expected_a = weight_a.repeat_interleave(2)[:, None].expand_as(a)
            expected_b = (11.0 - weight_a).repeat_interleave(2)[:, None].expand_as(b)
            assert a.grad is not None and torch.equal(a.grad, expected_a), (verify, a.grad)
            assert b.grad is not None and torch.equal(b.grad, expected_b), (verify, b.grad)
            # Backward passes run one by one, in different orders: they must
            # not swap.
            a.grad = b.grad = None
            out_a = qcomm.all_to_all_pooled(a, batches, dims).wait()
            out_b = qcomm.all_to_all_pooled(b, batches, dims).wait()
            in_order = [out_a, out_b] if rank == 0 else [out_b, out_a]
            raises_promptly(("backward",), functools.partial(_one_by_one, *in_order))
        in_step(rank, world)
    # Waited in the same order, the gradients are each input's own.
    a = torch.ones(sum(batches), dims[rank], requires_grad=True)
    b = torch.ones(sum(batches), dims[rank], requires_grad=True)
    out_a = qcomm.all_to_all_pooled(a, batches, dims).wait()
    out_b = qcomm.all_to_all_pooled(b, batches, dims).wait()
    (out_a.sum() + 10.0 * out_b.sum()).backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, torch.ones_like(a)) and torch.equal(b.grad, torch.full_like(b, 10.0))


def _one_by_one(*outputs: torch.Tensor) -> None:
    for out in outputs:
        out.sum().backward()


def case_no_gradient_on_one_rank(rank: int, world: int) -> None:
    """A rank with no tables ([B, 0]) or frozen ones still runs the backward."""
    batches = [2] * world
    int8 = QuantizedCommCodecs(forward=qcomm.load_codec("int8"), backward=qcomm.load_codec("int8"))
    for label, dims, frozen in (("no tables", [0, 8], 0), ("frozen tables", [8, 8], 1)):
        for codecs in (None, int8):
            mine = torch.ones(sum(batches), dims[rank], requires_grad=rank != frozen)
            out = qcomm.all_to_all_pooled(mine, batches, dims, codecs=codecs).wait()
            assert out.requires_grad, f"{label}: the output must take part in the backward"
            start = time.monotonic()
            out.backward(torch.ones_like(out))
            took = time.monotonic() - start
            assert took < PROMPT, f"{label}: the backward waited {took:.1f} s"
            if rank != frozen:
                assert mine.grad is not None and torch.equal(mine.grad, torch.ones_like(mine))
            else:
                assert mine.grad is None
    in_step(rank, world)


def case_stochastic_mx4_seeded_per_rank(rank: int, world: int) -> None:
    """Identical codecs agree whatever each rank's seed; the user's stream is untouched."""
    torch.manual_seed(1000 + rank)
    mx4 = qcomm.load_codec("mx4:rounding=stochastic")
    codecs = QuantizedCommCodecs(forward=mx4, backward=mx4)
    group = torch.distributed.new_group()  # its first call is checked
    x = torch.randn(2 * world, 32)
    # The first call's agreement check runs on this group; the check itself
    # must not draw from the global generator (the codec's own encoding may).
    import qcomm.collectives._agreement as agreement

    drawn: list[bool] = []
    real = agreement.Agreement._exchange

    def watched(self: Any, failed: Any) -> None:
        before = torch.get_rng_state()
        real(self, failed)
        drawn.append(not torch.equal(before, torch.get_rng_state()))

    agreement.Agreement._exchange = watched  # type: ignore[method-assign]
    try:
        qcomm.all_to_all_pooled(x, [2] * world, [32] * world, group=group, codecs=codecs).wait()
    finally:
        agreement.Agreement._exchange = real  # type: ignore[method-assign]
    assert drawn == [False], f"the agreement check drew from the global generator: {drawn}"
    in_step(rank, world)


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (case_wait_order, case_no_gradient_on_one_rank, case_stochastic_mx4_seeded_per_rank)
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


@pytest.fixture(scope="module")
def spawned() -> dict[str, str | None]:
    return run_cases(
        run_case,
        WORLD,
        list(CASES),
        stop_on_failed_check=True,
        timeout=300.0,
        pg_timeout=PG_TIMEOUT,
    )


def check(spawned: dict[str, str | None], case: Callable[[int, int], None]) -> None:
    """Fails the calling test with ``case``'s tracebacks."""
    if failure := spawned[case.__name__]:
        pytest.fail(f"{case.__name__} on {WORLD} ranks:\n{failure}", pytrace=False)


def test_outputs_waited_in_other_orders_do_not_swap_backward_passes(
    spawned: dict[str, str | None],
) -> None:
    check(spawned, case_wait_order)


def test_a_rank_without_tables_or_with_frozen_ones_still_runs_the_backward(
    spawned: dict[str, str | None],
) -> None:
    check(spawned, case_no_gradient_on_one_rank)


def test_stochastic_mx4_agrees_across_ranks_whatever_their_seeds(
    spawned: dict[str, str | None],
) -> None:
    check(spawned, case_stochastic_mx4_seeded_per_rank)


def test_garbage_collection_inside_lease_never_deadlocks(monkeypatch: pytest.MonkeyPatch) -> None:
    nbytes = 2 * _buffers.MIN_BYTES
    shape = (nbytes // 4,)
    real_pick = _buffers._pick

    def pick_after_collecting(pool: list[torch.Tensor], need: int) -> torch.Tensor | None:
        gc.collect()  # what an allocation inside lease() may trigger
        return real_pick(pool, need)

    monkeypatch.setattr(_buffers, "_pick", pick_after_collecting)
    done = threading.Event()

    def lease_twice() -> None:
        earlier = _buffers.lease(shape, torch.float32, torch.device("cpu"))
        cycle: list[Any] = [earlier]
        cycle.append(cycle)  # only the collector frees it
        del earlier, cycle
        _buffers.lease(shape, torch.float32, torch.device("cpu"))
        done.set()

    worker = threading.Thread(target=lease_twice, daemon=True)
    worker.start()
    assert done.wait(20.0), "lease() deadlocked on its own lock when the collector ran inside it"
