r"""
The formulas of ``qcomm bench``'s figures, as pure functions; what they mean
and why is in :doc:`/bench`. Sizes are in bytes, times in seconds,
bandwidths in bytes per second (the report divides by :data:`GB`).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the formulas are pure; the advice reads them without torch
    import torch

__all__ = [
    "GB",
    "TCP_EFFICIENCY",
    "collective_break_even",
    "predicted_time",
    "ErrorStats",
    "algorithm_bandwidth",
    "break_even_bandwidth",
    "bus_bandwidth",
    "error_stats",
    "relative_spread",
    "sqnr_db",
]

#: bytes in a gigabyte, as bandwidths are reported (decimal, like nccl-tests)
GB = 1e9


def algorithm_bandwidth(size_bytes: float, seconds: float) -> float:
    r"""
    algorithm_bandwidth(size_bytes: float, seconds: float) -> float

    nccl-tests' algorithm bandwidth :math:`S / t`.

    Args:
        size_bytes (float): :math:`S`, a rank's float32 buffer, whatever the wire carries.
        seconds (float): :math:`t`, positive.

    Examples::

        >>> algorithm_bandwidth(1e9, 0.5)
        2000000000.0
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be non-negative, got {size_bytes!r}")
    return size_bytes / seconds


def bus_bandwidth(algbw: float, world_size: int, *, all_reduce: bool = False) -> float:
    r"""
    bus_bandwidth(algbw: float, world_size: int, *, all_reduce: bool = False) -> float

    nccl-tests' bus bandwidth: ``algbw`` times :math:`(n - 1) / n` for an
    all-to-all or a reduce-scatter, twice that for an all-reduce.

    Args:
        algbw (float): the algorithm bandwidth.
        world_size (int): :math:`n`, the number of ranks.
        all_reduce (bool, optional): the all-reduce's factor. Default: ``False``.

    Raises:
        ValueError: if ``world_size`` is less than 1.

    Examples::

        >>> bus_bandwidth(8.0, 2), bus_bandwidth(8.0, 8), bus_bandwidth(8.0, 8, all_reduce=True)
        (4.0, 7.0, 14.0)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size!r}")
    return algbw * (2 if all_reduce else 1) * (world_size - 1) / world_size


def break_even_bandwidth(
    wire_bytes: float, logical_bytes: float, encode_seconds: float, decode_seconds: float
) -> float:
    r"""
    break_even_bandwidth(wire_bytes: float, logical_bytes: float, encode_seconds: float, decode_seconds: float) -> float

    The link bandwidth :math:`B^{*} = (1 - w / \ell) / c` below which a codec
    pays for itself when nothing overlaps (see :doc:`/bench`); ``0`` when it
    saves nothing, ``inf`` when it saves bytes for free.

    Args:
        wire_bytes (float): :math:`w`.
        logical_bytes (float): :math:`\ell`, positive.
        encode_seconds (float): encode time, with ``decode_seconds`` over :math:`\ell`: :math:`c`.
        decode_seconds (float): decode time.

    Examples::

        >>> break_even_bandwidth(1.0, 4.0, 0.25, 0.5)  # (1 - 1/4) / (0.75 / 4)
        4.0
        >>> break_even_bandwidth(4.0, 4.0, 0.1, 0.1)
        0.0
    """
    if not logical_bytes > 0:
        raise ValueError(f"logical_bytes must be positive, got {logical_bytes!r}")
    if encode_seconds < 0 or decode_seconds < 0:
        raise ValueError(
            f"encode_seconds and decode_seconds must be non-negative, "
            f"got {encode_seconds!r} and {decode_seconds!r}"
        )
    saved = 1.0 - wire_bytes / logical_bytes
    if saved <= 0:
        return 0.0
    per_byte = (encode_seconds + decode_seconds) / logical_bytes
    return math.inf if per_byte == 0 else saved / per_byte


#: the share of a link's rate that one TCP stream's payload gets (headers,
#: acknowledgements), used where the link's throughput was not measured
TCP_EFFICIENCY = 0.95


def predicted_time(link_bytes: float, rate: float, cpu_seconds: float) -> float:
    r"""
    predicted_time(link_bytes: float, rate: float, cpu_seconds: float) -> float

    The model's time of a collective call on a link of ``rate`` bytes per
    second, :math:`\sqrt{(b / R)^2 + P^2}` (see :doc:`/bench`).

    Args:
        link_bytes (float): :math:`b`, wire bytes through each rank's port,
            over the link's efficiency.
        rate (float): :math:`R`; ``inf`` for no link limit.
        cpu_seconds (float): :math:`P`, the call's time when the link is not
            the limit.

    Raises:
        ValueError: if ``rate`` is not positive or a figure is negative.

    Examples::

        >>> predicted_time(3e6, 1e9, 0.004)  # 3 ms of link, 4 ms of work
        0.005
    """
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    if link_bytes < 0 or cpu_seconds < 0:
        raise ValueError(
            f"link_bytes and cpu_seconds must be non-negative, got {link_bytes!r}, {cpu_seconds!r}"
        )
    return math.hypot(link_bytes / rate, cpu_seconds)


def collective_break_even(
    base_bytes: float, base_seconds: float, codec_bytes: float, codec_seconds: float
) -> float:
    r"""
    collective_break_even(base_bytes: float, base_seconds: float, codec_bytes: float, codec_seconds: float) -> float

    The link rate :math:`R^{*}` below which a codec makes a collective
    faster than the no-op codec, by :func:`predicted_time`; ``inf`` when it
    is faster at every rate, ``0`` when it saves no bytes.

    Args:
        base_bytes (float): :math:`b_0`, the no-op codec's link bytes.
        base_seconds (float): :math:`P_0`, its time without a link limit.
        codec_bytes (float): :math:`b_c`, the codec's link bytes.
        codec_seconds (float): :math:`P_c`, its time without a link limit.

    Examples::

        >>> round(collective_break_even(4e6, 0.003, 1e6, 0.005) / 1e9, 4)  # sqrt(15e12 / 16e-6)
        0.9682
        >>> collective_break_even(4e6, 0.005, 1e6, 0.003)
        inf
    """
    saved = base_bytes**2 - codec_bytes**2
    cost = codec_seconds**2 - base_seconds**2
    if saved <= 0:
        return 0.0
    if cost <= 0:
        return math.inf
    return math.sqrt(saved / cost)


def sqnr_db(signal_energy: float, noise_energy: float) -> float:
    r"""
    sqnr_db(signal_energy: float, noise_energy: float) -> float

    Signal-to-quantization-noise ratio, :math:`10 \log_{10}` of the energies'
    ratio, in decibels: ``inf`` when exact, ``nan`` when both are zero.

    Args:
        signal_energy (float): non-negative.
        noise_energy (float): non-negative.

    Examples::

        >>> sqnr_db(100.0, 1.0), sqnr_db(1.0, 0.0)
        (20.0, inf)
    """
    if signal_energy < 0 or noise_energy < 0:
        raise ValueError(
            f"energies must be non-negative, got signal {signal_energy!r}, noise {noise_energy!r}"
        )
    if noise_energy == 0:
        return math.nan if signal_energy == 0 else math.inf
    if signal_energy == 0:
        return -math.inf
    return 10.0 * math.log10(signal_energy / noise_energy)


class ErrorStats(NamedTuple):
    r"""
    How far a decoded tensor is from its float32 original (see :doc:`/bench`).

    Args:
        max_rel (float): the largest error over the original's largest magnitude.
        rms_rel (float): the error's RMS over the original's RMS.
        sqnr_db (float): :func:`sqnr_db`.
    """

    max_rel: float
    rms_rel: float
    sqnr_db: float


def error_stats(reference: torch.Tensor, approx: torch.Tensor) -> ErrorStats:
    r"""
    error_stats(reference: Tensor, approx: Tensor) -> ErrorStats

    The error of ``approx`` against ``reference``, computed in float64.

    Args:
        reference (Tensor): the original, not empty.
        approx (Tensor): as many elements as ``reference``.

    Examples::

        >>> import torch
        >>> x = torch.tensor([1.0, -2.0, 4.0])
        >>> stats = error_stats(x, torch.tensor([1.0, -2.0, 3.0]))  # error 1, max|x| 4, sum x^2 21
        >>> stats.max_rel, round(stats.rms_rel, 4), round(stats.sqnr_db, 2)
        (0.25, 0.2182, 13.22)
    """
    if reference.numel() != approx.numel():
        raise ValueError(
            f"approx must have as many elements as reference ({reference.numel()}), "
            f"got {approx.numel()}"
        )
    if reference.numel() == 0:
        raise ValueError("reference must not be empty")
    import torch

    x = reference.detach().reshape(-1).to(torch.float64)
    noise = approx.detach().reshape(-1).to(device=x.device, dtype=torch.float64) - x
    scale = x.abs().max().item()
    worst = noise.abs().max().item()
    signal_energy = float(x.square().sum().item())
    noise_energy = float(noise.square().sum().item())
    max_rel = worst / scale if scale > 0 else (0.0 if worst == 0 else math.inf)
    if signal_energy > 0:
        rms_rel = math.sqrt(noise_energy / signal_energy)
    else:
        rms_rel = 0.0 if noise_energy == 0 else math.inf
    return ErrorStats(max_rel, rms_rel, sqnr_db(signal_energy, noise_energy))


def relative_spread(samples: list[float]) -> float:
    r"""
    relative_spread(samples: list[float]) -> float

    How much repeated timings disagree: the interquartile range over the
    median (0.2: the middle half spans 20% of the median).

    Args:
        samples (list[float]): timings; fewer than 2 give 0.

    Examples::

        >>> relative_spread([1.0, 1.0, 1.0]), relative_spread([1.0, 2.0, 3.0])
        (0.0, 0.5)
    """
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    median = statistics.median(samples)
    return (q3 - q1) / median if median > 0 else 0.0
