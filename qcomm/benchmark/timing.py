r"""
Time-budgeted timing: as many calls as fit a budget, so that a 64 KiB message
gets hundreds of repetitions and a 64 MiB one a few, and the whole run keeps
to a predictable length on any machine.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["calls_for_budget", "synchronize", "time_calls"]


def synchronize(device: torch.device) -> None:
    r"""
    synchronize(device: torch.device) -> None

    Waits for the work queued on ``device`` (CUDA kernels run asynchronously;
    CPU work is done when the call returns).

    Args:
        device (torch.device): the device measured.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_for_budget(
    seconds_per_call: float, budget: float, min_calls: int = 1, max_calls: int = 1000
) -> int:
    r"""
    calls_for_budget(seconds_per_call: float, budget: float, min_calls: int = 1, max_calls: int = 1000) -> int

    How many calls of a measured length fit a time budget.

    Args:
        seconds_per_call (float): the length of one call (e.g. its warm-up).
        budget (float): seconds to spend.
        min_calls (int, optional): at least this many. Default: ``1``.
        max_calls (int, optional): at most this many. Default: ``1000``.

    Returns:
        int: ``budget / seconds_per_call`` rounded down, clamped to
        ``[min_calls, max_calls]``.

    Examples::

        >>> calls_for_budget(0.01, 0.1)
        10
        >>> calls_for_budget(1.0, 0.1, min_calls=3)
        3
    """
    if seconds_per_call <= 0 or not math.isfinite(seconds_per_call):
        return max_calls if seconds_per_call <= 0 else min_calls
    return max(min_calls, min(max_calls, int(budget / seconds_per_call)))


def time_calls(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    budget: float,
    min_calls: int = 3,
    max_calls: int = 1000,
) -> float:
    r"""
    time_calls(fn: Callable[[], Any], device: torch.device, *, budget: float, min_calls: int = 3, max_calls: int = 1000) -> float

    Median seconds of one call of ``fn``, after a warm-up call, over as many
    calls as fit ``budget``. The median keeps a call that another process
    interrupted from skewing the figure.

    Args:
        fn (Callable[[], Any]): the call measured; must not need collectives
            (every rank may repeat it a different number of times).
        device (torch.device): where ``fn`` runs.
        budget (float): seconds to spend after the warm-up.
        min_calls (int, optional): timed calls at least. Default: ``3``.
        max_calls (int, optional): timed calls at most. Default: ``1000``.

    Returns:
        float: median seconds per call.

    Examples::

        >>> import torch
        >>> time_calls(lambda: None, torch.device("cpu"), budget=0.001) >= 0
        True
    """
    start = time.perf_counter()
    fn()
    synchronize(device)
    warm = time.perf_counter() - start
    times = []
    for _ in range(calls_for_budget(warm, budget, min_calls, max_calls)):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
