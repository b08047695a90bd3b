r"""
What a compiled pooled all-to-all overlaps: on local gloo ranks, the time of
one step that starts the call, runs some compute, and waits for it, eager
and under ``torch.compile`` (inductor), beside the compute alone and the call
alone, measured in the same run.

A step that overlaps perfectly takes the longer of the two parts; one that
does not, their sum. The figures of ``docs/compile.rst`` come from this
script.

Usage::

    python examples/compile_overlap.py                  # 2 ranks, 4 MiB per rank, int8/bf16
    python examples/compile_overlap.py --mib 1 --codecs noop --rounds 21
    python examples/compile_overlap.py --link 1gbit --compute 1400   # emulated link (root)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import qcomm
from qcomm.benchmark.link import Link, parse_rate


def _timed(step: Callable[[], object], steps: int, rounds: int) -> list[float]:
    """Median milliseconds per step of each round (every rank in step, a barrier apart)."""
    for _ in range(3):
        step()  # warm-up, compilation included
    medians = []
    for _ in range(rounds):
        dist.barrier()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times) * 1e3)
    return medians


def _rank(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    codecs = None if args.codecs == "noop" else qcomm.load_pair(args.codecs)
    dim = 64
    batch = max(1, args.mib * 2**20 // (4 * dim * world))
    x = torch.randn(batch * world, dim)
    a = torch.randn(args.compute, args.compute)

    def compute() -> torch.Tensor:
        return a @ a

    def call() -> torch.Tensor:
        return qcomm.all_to_all_pooled(x, [batch] * world, [dim] * world, codecs=codecs).wait()

    def overlapped() -> tuple[torch.Tensor, torch.Tensor]:
        pending = qcomm.all_to_all_pooled(x, [batch] * world, [dim] * world, codecs=codecs)
        return compute(), pending.wait()

    # inductor's memory-driven reordering may move the compute after the
    # wait; its option keeps the program's order (docs/compile.rst).
    in_order = {"reorder_for_peak_memory": False}
    rows = {
        "compute alone": _timed(compute, args.steps, args.rounds),
        "call alone": _timed(call, args.steps, args.rounds),
        "call alone, compiled": _timed(
            torch.compile(call, fullgraph=True), args.steps, args.rounds
        ),
        "call + compute, eager": _timed(overlapped, args.steps, args.rounds),
        "call + compute, compiled": _timed(
            torch.compile(overlapped, fullgraph=True), args.steps, args.rounds
        ),
        "call + compute, compiled in order": _timed(
            torch.compile(overlapped, fullgraph=True, options=in_order), args.steps, args.rounds
        ),
    }
    if rank == 0:
        where = f"an emulated {args.link} link" if args.link else "loopback"
        print(
            f"{world} ranks on {where}, {args.mib} MiB per rank, codecs {args.codecs}, ms per step"
        )
        print(f"{'':34} {'median':>8} {'min':>8} {'max':>8}")
        for name, values in rows.items():
            median = statistics.median(values)
            print(f"{name:34} {median:8.2f} {min(values):8.2f} {max(values):8.2f}")
        compute_ms = statistics.median(rows["compute alone"])
        for mode in ("eager", "compiled", "compiled in order"):
            # Against the call of the same kind, eager or compiled.
            call_ms = statistics.median(
                rows["call alone" + ("" if mode == "eager" else ", compiled")]
            )
            both = statistics.median(rows[f"call + compute, {mode}"])
            print(f"{mode}: {both / (compute_ms + call_ms):.2f} of compute + call apart")
    dist.destroy_process_group()


def _launch(args: argparse.Namespace) -> None:
    """Runs every rank as a child process of this script, on the link if one is given."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(port))
    env["WORLD_SIZE"] = str(args.world_size)
    link = Link(args.world_size, parse_rate(args.link)) if args.link else None
    with link or contextlib.nullcontext():
        env["MASTER_ADDR"] = link.address(0) if link else "127.0.0.1"
        if link:
            env["GLOO_SOCKET_IFNAME"] = link.interface
        children = []
        for rank in range(args.world_size):
            argv = [sys.executable, __file__, *sys.argv[1:], "--rank", str(rank)]
            children.append(subprocess.Popen(link.command(rank, argv) if link else argv, env=env))
        if any(child.wait() for child in children):
            raise SystemExit("a rank failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=int, default=4, help="MiB each rank sends")
    parser.add_argument("--codecs", default="int8/bf16", help="a pair spec, or noop")
    parser.add_argument("--compute", type=int, default=384, help="side of the square matmul")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--link", help="an emulated link's rate, e.g. 1gbit (needs root)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        _launch(args)
    else:
        _rank(args.rank, args.world_size, args)


if __name__ == "__main__":
    main()
