"""Pooled all-to-all with the no-op codec against a bare ``all_to_all_single``.

Run::

    pytest bench/bench_collectives.py --benchmark-only -s

Two gloo ranks stay up for the whole benchmark and take commands from this
process. Each round runs, one after the other on both ranks, the bare
``dist.all_to_all_single`` of the same bytes (the baseline), TorchRec's
``alltoall_pooled`` and ``qcomm.all_to_all_pooled``, each allocating the
output it returns, and waits for each. For reference it also times the bare
call into an output tensor kept from call to call: on CPU a fresh 64 MiB
tensor costs page faults on first touch about as long as the transfer, which
every call that returns a new tensor pays. Each rank times every call between
a barrier and the call's end; a call's time is the slower rank's.

pytest-benchmark's own statistics time the qcomm call as this process sees
it (a command's round trip to the ranks, about a millisecond more). The ratio
comes from the ranks' own timings of the interleaved calls, so that a busy
machine slows baseline and contender alike; it is printed and recorded in
``extra_info`` (``ratio_qcomm_vs_bare``; target: at most 1.25).
"""

from __future__ import annotations

import multiprocessing
import pathlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import run_ranks  # noqa: E402

import qcomm  # noqa: E402

WORLD = 2
MIB_PER_RANK = 64
DIM = 256  # columns per rank; rows follow from the size
ROUNDS = 10
WARMUP = 2


def _variants(rank: int, world: int) -> dict[str, Callable[[], Any]]:
    rows = MIB_PER_RANK * 2**20 // (4 * DIM)
    batches, dims = [rows // world] * world, [DIM] * world
    x = torch.randn(rows, DIM)
    flat = x.view(-1)
    noop = qcomm.QuantizedCommCodecs()

    def bare() -> None:
        out = torch.empty_like(flat)
        dist.all_to_all_single(out, flat, async_op=True).wait()

    kept = torch.empty_like(flat)

    def bare_kept_output() -> None:
        dist.all_to_all_single(kept, flat, async_op=True).wait()

    def qcomm_call() -> None:
        qcomm.all_to_all_pooled(x, batches, dims, codecs=noop).wait()

    variants: dict[str, Callable[[], Any]] = {
        "bare": bare,
        "bare_kept_output": bare_kept_output,
        "qcomm": qcomm_call,
    }
    try:
        from torchrec.distributed.comm_ops import alltoall_pooled
    except ImportError:
        return variants

    def torchrec_call() -> None:
        alltoall_pooled(x, batches, dims, codecs=noop).wait()

    variants["torchrec"] = torchrec_call
    return variants


def _serve(rank: int, world: int, commands: Any, replies: Any) -> None:
    """Runs on each rank: executes the variant rank 0 reads from ``commands``."""
    variants = _variants(rank, world)
    if rank == 0:
        replies.put(sorted(variants))
    while True:
        box = [commands.get() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
        if name is None:
            return
        dist.barrier()
        start = time.perf_counter()
        variants[name]()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if rank == 0:
            replies.put(took.item())


class Ranks:
    """Two ranks serving :func:`_serve`, driven from this process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands = ctx.Queue()
        self.replies = ctx.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.variants: list[str] = self._reply()

    def _run(self) -> None:
        try:
            # The ranks idle between commands: a long group timeout.
            run_ranks(_serve, WORLD, self.commands, self.replies, timeout=3600.0, pg_timeout=1800.0)
        except BaseException as err:
            self.error = err

    def _reply(self) -> Any:
        while True:
            try:
                return self.replies.get(timeout=1.0)
            except Exception:
                if not self.thread.is_alive():
                    raise RuntimeError(f"the benchmark ranks stopped: {self.error}") from None

    def run(self, name: str) -> float:
        """Runs variant ``name`` once on both ranks; returns the slower rank's seconds."""
        self.commands.put(name)
        return float(self._reply())

    def close(self) -> None:
        self.commands.put(None)
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def ranks() -> Any:
    pool = Ranks()
    yield pool
    pool.close()


def test_all_to_all_pooled_noop_vs_bare(benchmark: Any, ranks: Ranks) -> None:
    times: dict[str, list[float]] = {name: [] for name in ranks.variants}
    baselines = [name for name in ranks.variants if name != "qcomm"]

    def setup() -> None:
        for name in baselines:
            times[name].append(ranks.run(name))

    def target() -> None:
        times["qcomm"].append(ranks.run("qcomm"))

    for _ in range(WARMUP):
        for name in ranks.variants:
            ranks.run(name)
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["qcomm"] / median["bare"]
    benchmark.extra_info.update(
        {
            "world_size": WORLD,
            "mib_per_rank": MIB_PER_RANK,
            **{f"median_s_{name}": m for name, m in median.items()},
            "ratio_qcomm_vs_bare": ratio,
            "target_ratio": 1.25,
        }
    )
    print(f"\nall_to_all_pooled, noop codec, {WORLD} gloo ranks, {MIB_PER_RANK} MiB per rank")
    for name, m in median.items():
        print(f"  {name:<17} {1e3 * m:7.1f} ms  {m / median['bare']:5.2f}x bare")
    print(f"qcomm / bare = {ratio:.3f} (target <= 1.25)")
