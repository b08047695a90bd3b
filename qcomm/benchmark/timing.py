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

__all__ = [
    "MIN_SAMPLE_S",
    "calls_for_budget",
    "synchronize",
    "time_calls",
    "time_samples",
]


def synchronize(device: torch.device) -> None:
    r"""
    synchronize(device: torch.device) -> None

    Waits for the work queued on a device (CUDA runs asynchronously).

    Args:
        device (torch.device): the device.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_for_budget(
    seconds_per_call: float, budget: float, min_calls: int = 1, max_calls: int = 1000
) -> int:
    r"""
    calls_for_budget(seconds_per_call: float, budget: float, min_calls: int = 1, max_calls: int = 1000) -> int

    How many calls fit a budget, clamped to ``[min_calls, max_calls]``.

    Args:
        seconds_per_call (float): one call's time.
        budget (float): seconds.
        min_calls (int, optional): the fewest calls. Default: ``1``.
        max_calls (int, optional): the most calls. Default: ``1000``.

    Examples::

        >>> calls_for_budget(0.01, 0.1), calls_for_budget(1.0, 0.1, min_calls=3)
        (10, 3)
    """
    if seconds_per_call <= 0 or not math.isfinite(seconds_per_call):
        return max_calls if seconds_per_call <= 0 else min_calls
    return max(min_calls, min(max_calls, int(budget / seconds_per_call)))


#: the shortest stretch of back-to-back calls timed as one sample (shorter
#: calls are timed in groups, so that hiccups of the clock and the scheduler
#: of a few microseconds do not make up the figure)
MIN_SAMPLE_S = 2e-3


def time_samples(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    budget: float,
    min_calls: int = 3,
    max_calls: int = 1000,
) -> list[float]:
    r"""
    time_samples(fn: Callable[[], Any], device: torch.device, *, budget: float, min_calls: int = 3, max_calls: int = 1000) -> list[float]

    Seconds per call, sample by sample, after a warm-up call; a sample is at
    least :data:`MIN_SAMPLE_S` of back-to-back calls.

    Args:
        fn (Callable[[], Any]): no collectives: ranks may repeat it unequally often.
        device (torch.device): synchronized after each sample.
        budget (float): seconds of samples.
        min_calls (int, optional): the fewest samples. Default: ``3``.
        max_calls (int, optional): the most samples. Default: ``1000``.

    Examples::

        >>> import torch
        >>> len(time_samples(lambda: None, torch.device("cpu"), budget=0.0, min_calls=4))
        4
    """
    start = time.perf_counter()
    fn()
    synchronize(device)
    warm = time.perf_counter() - start
    repeat = max(1, math.ceil(MIN_SAMPLE_S / warm)) if warm > 0 else 1000
    samples = []
    for _ in range(calls_for_budget(warm * repeat, budget, min_calls, max_calls)):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / repeat)
    return samples


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

    The median of :func:`time_samples`, which takes the same arguments: a
    call that another process interrupted does not skew it.

    Args:
        fn (Callable[[], Any]): no collectives.
        device (torch.device): the device.
        budget (float): seconds.
        min_calls (int, optional): Default: ``3``.
        max_calls (int, optional): Default: ``1000``.

    Examples::

        >>> import torch
        >>> time_calls(lambda: None, torch.device("cpu"), budget=0.001) >= 0
        True
    """
    samples = time_samples(fn, device, budget=budget, min_calls=min_calls, max_calls=max_calls)
    return statistics.median(samples)
