"""Steadiness of the pooled all-to-all at 64 MiB per rank (one spawn of 2 gloo ranks).

After warm-up, a call makes no fresh memory: its output is leased from kept
memory, its receive buffer and its status message are kept buffers, so no
call pays first-touch page faults (on this machine kind 64 MiB of fresh
huge-page-advised memory costs ~150 ms to fault in, half a call over a
1 Gbit/s link). Counted, never timed: fresh allocations through
``_buffers.empty`` and the ranks' minor page faults per call, with the
output dropped at once and with it held until the next call returns (the
pipeline of ``TrainPipelineSparseDist``).
"""

from __future__ import annotations

import resource
import statistics
from typing import Any

import torch
from dist_utils import run_ranks

import qcomm
from qcomm.collectives import _buffers

WORLD = 2
SIZE = 64 << 20  # float32 bytes per rank
DIM = 128
WARM = 2
CALLS = 6
# A fresh 32 MiB receive buffer alone faults at least 16 times (2 MiB huge
# pages), a fresh 64 MiB output 32 times; a steady call faults a few times
# at most (Python's and gloo's small allocations).
MAX_MEDIAN_FAULTS = 8


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steady_calls(rank: int, world: int) -> dict[str, Any]:
    rows = SIZE // (4 * DIM) // world * world
    x = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rank))
    batches, dims = [rows // world] * world, [DIM] * world
    fresh: list[int] = []
    make = _buffers.empty

    def counted(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        fresh.append(len(fresh))
        return make(shape, dtype, device)

    _buffers.empty = counted  # type: ignore[assignment]
    result: dict[str, Any] = {}
    try:
        for held in (False, True):
            out: torch.Tensor | None = None
            faults = []
            for i in range(WARM + CALLS):
                if i == WARM:
                    del fresh[:]
                before = _faults()
                new = qcomm.all_to_all_pooled(x, batches, dims).wait()
                faults.append(_faults() - before)
                out = new if held else None
                del new
            del out
            result["held" if held else "dropped"] = {
                "fresh": len(fresh),
                "faults": faults[WARM:],
            }
    finally:
        _buffers.empty = make  # type: ignore[assignment]
    return result


def test_pooled_all_to_all_makes_no_fresh_memory_after_warm_up() -> None:
    results = run_ranks(steady_calls, WORLD, timeout=240.0)
    for rank, result in enumerate(results):
        for pattern, figures in result.items():
            assert figures["fresh"] == 0, (
                f"rank {rank}, output {pattern}: {figures['fresh']} fresh buffers "
                f"in {CALLS} calls after warm-up, expected none"
            )
            median = statistics.median(figures["faults"])
            assert median <= MAX_MEDIAN_FAULTS, (
                f"rank {rank}, output {pattern}: page faults per call {figures['faults']}, "
                f"expected a median of at most {MAX_MEDIAN_FAULTS}"
            )
