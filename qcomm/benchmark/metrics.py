r"""
The figures of ``qcomm bench``, as pure functions of measured quantities.

Units: sizes in bytes, times in seconds, bandwidths in bytes per second (the
report divides by :data:`GB`, ``1e9``, as nccl-tests does). Message sizes
are named in binary units (``64K`` is 65536 bytes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    "sqnr_db",
]

#: bytes in a gigabyte, as bandwidths are reported (decimal, like nccl-tests)
GB = 1e9


def algorithm_bandwidth(size_bytes: float, seconds: float) -> float:
    r"""
    algorithm_bandwidth(size_bytes: float, seconds: float) -> float

    nccl-tests' algorithm bandwidth :math:`S / t`.

    Args:
        size_bytes (float): :math:`S`, the message size. For all-to-all and
            reduce-scatter nccl-tests takes the whole per-rank buffer (what
            one rank sends, all destinations together); ``qcomm bench``
            takes the float32 size of that buffer whatever the codec puts on
            the wire, so that a codec's gain shows as bandwidth.
        seconds (float): :math:`t`, the latency of one call.

    Returns:
        float: bytes per second.

    Raises:
        ValueError: if ``seconds`` is not positive or ``size_bytes`` is negative.

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

    nccl-tests' bus bandwidth of an all-to-all or a reduce-scatter, or of an
    all-reduce.

    nccl-tests (``doc/PERFORMANCE.md``, "Bus bandwidth") corrects the
    algorithm bandwidth by what each rank's link must carry: of the :math:`S`
    bytes of a rank's buffer, the :math:`1/n` addressed to itself never leaves
    it, so both collectives move :math:`S (n - 1) / n` per link and

    .. math::

        \text{busbw} = \text{algbw} \cdot \frac{n - 1}{n}

    (the same factor nccl-tests lists for AlltoAll and ReduceScatter), which
    compares with the hardware's link speed whatever :math:`n` is. The three
    embedding collectives of ``qcomm bench`` are of these two kinds. An
    all-reduce is a reduce-scatter and an all-gather, twice the traffic:

    .. math::

        \text{busbw} = \text{algbw} \cdot \frac{2 (n - 1)}{n}

    Args:
        algbw (float): the algorithm bandwidth, bytes per second.
        world_size (int): :math:`n`, the number of ranks.
        all_reduce (bool, optional): the all-reduce's factor. Default: ``False``.

    Returns:
        float: bytes per second; ``0`` on a single rank, where nothing travels.

    Raises:
        ValueError: if ``world_size`` is less than 1.

    Examples::

        >>> bus_bandwidth(8.0, 2), bus_bandwidth(8.0, 8)
        (4.0, 7.0)
        >>> bus_bandwidth(8.0, 2, all_reduce=True), bus_bandwidth(8.0, 8, all_reduce=True)
        (8.0, 14.0)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size!r}")
    return algbw * (2 if all_reduce else 1) * (world_size - 1) / world_size


def break_even_bandwidth(
    wire_bytes: float, logical_bytes: float, encode_seconds: float, decode_seconds: float
) -> float:
    r"""
    break_even_bandwidth(wire_bytes: float, logical_bytes: float, encode_seconds: float, decode_seconds: float) -> float

    The link bandwidth below which a codec pays for itself.

    Sending :math:`\ell` logical (float32) bytes over a link of bandwidth
    :math:`B` takes :math:`\ell / B`. With the codec, :math:`w` wire bytes
    travel and encode plus decode cost :math:`c` seconds per logical byte, so
    it takes :math:`w / B + c \ell`. The codec wins when
    :math:`w / B + c \ell < \ell / B`, that is when

    .. math::

        B < B^{*} = \frac{1 - w / \ell}{c}, \qquad
        c = \frac{t_\text{encode} + t_\text{decode}}{\ell}

    with :math:`B^{*}` in bytes per second when :math:`c` is in seconds per
    byte. The model counts the codec's compute as not overlapped with
    communication: it is the break-even of a collective that encodes, sends
    and decodes one after the other. qcomm's collectives overlap the three
    (see :doc:`/collectives`), so they break even at faster links.

    Args:
        wire_bytes (float): :math:`w`, bytes on the wire for the tensor.
        logical_bytes (float): :math:`\ell`, its float32 size.
        encode_seconds (float): time to encode it.
        decode_seconds (float): time to decode it.

    Returns:
        float: :math:`B^{*}` in bytes per second; ``0`` when the codec saves
        nothing (:math:`w \ge \ell`), ``inf`` when it saves bytes for free.

    Raises:
        ValueError: if ``logical_bytes`` is not positive or a time is negative.

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

    The time of a collective call on a link of ``rate`` bytes per second, from
    the bytes it puts on each rank's port and its time where the link is not
    the limit.

    The call needs :math:`L = b / R` of link time and :math:`P` of its own
    work (encoding, decoding, copies, the network stack). The pipeline
    overlaps them, but not perfectly: when they are of the same size they
    get in each other's way. Measured over codecs and links from 1 to 10
    Gbit/s (see ``qcomm bench --link``), the time follows

    .. math::

        T(R) = \sqrt{L^2 + P^2}

    which tends to the larger of the two when one dominates, and is
    :math:`\sqrt{2}` times either when they are equal.

    Args:
        link_bytes (float): :math:`b`, wire bytes through each rank's port
            (the busiest), divided by the link's efficiency.
        rate (float): :math:`R`, the link's rate in bytes per second; ``inf``
            for no link limit.
        cpu_seconds (float): :math:`P`, the call's time when the link is not
            the limit (measured on loopback, or on the emulated link with its
            rate limit lifted).

    Returns:
        float: seconds.

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

    The link rate below which a codec makes a collective faster than the
    no-op codec, by :func:`predicted_time`.

    With :math:`b_0, P_0` the no-op call's link bytes and time without a link
    limit and :math:`b_c, P_c` the codec's, the codec is faster where
    :math:`(b_0^2 - b_c^2) / R^2 > P_c^2 - P_0^2`, that is below

    .. math::

        R^{*} = \sqrt{\frac{b_0^2 - b_c^2}{P_c^2 - P_0^2}}

    Args:
        base_bytes (float): :math:`b_0`.
        base_seconds (float): :math:`P_0`.
        codec_bytes (float): :math:`b_c`.
        codec_seconds (float): :math:`P_c`.

    Returns:
        float: :math:`R^{*}` in bytes per second; ``inf`` when the codec is
        faster at every rate, ``0`` when it saves no bytes.

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

    Signal-to-quantization-noise ratio
    :math:`10 \log_{10}(\sum x_i^2 / \sum (\hat{x}_i - x_i)^2)` in decibels.

    Args:
        signal_energy (float): :math:`\sum x_i^2`.
        noise_energy (float): :math:`\sum (\hat{x}_i - x_i)^2`.

    Returns:
        float: decibels; ``inf`` for an exact result, ``nan`` when there is
        neither signal nor noise.

    Raises:
        ValueError: if an energy is negative.

    Examples::

        >>> sqnr_db(100.0, 1.0)
        20.0
        >>> sqnr_db(1.0, 0.0)
        inf
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
    How far a decoded tensor :math:`\hat{x}` is from its float32 original :math:`x`.

    Args:
        max_rel (float): :math:`\max_i |\hat{x}_i - x_i| / \max_i |x_i|`. The
            largest error relative to the tensor's largest magnitude, not to
            each element's own: per-element relative error is unbounded near
            zero, where every quantizer rounds to an absolute step.
        rms_rel (float): :math:`\sqrt{\sum_i (\hat{x}_i - x_i)^2 / \sum_i x_i^2}`.
        sqnr_db (float): :math:`-20 \log_{10}` of ``rms_rel``; see :func:`sqnr_db`.
    """

    max_rel: float
    rms_rel: float
    sqnr_db: float


def error_stats(reference: torch.Tensor, approx: torch.Tensor) -> ErrorStats:
    r"""
    error_stats(reference: Tensor, approx: Tensor) -> ErrorStats

    Error of ``approx`` against ``reference``, computed in float64.

    Args:
        reference (Tensor): the float32 original :math:`x`.
        approx (Tensor): the decoded :math:`\hat{x}`, same number of elements.

    Returns:
        ErrorStats: maximum and RMS error relative to the reference's scale,
        and the SQNR.

    Raises:
        ValueError: if the element counts differ or ``reference`` is empty.

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
