r"""
The figures ``qcomm bench`` derives from what it measured, once every point
is in: speed-ups over each implementation's baseline, what a point is worth
against the link's bound, against TorchRec and against PyTorch's hooks, the
model's predictions, and the link rates below which a codec pays.
"""

from __future__ import annotations

import math

from qcomm.benchmark.candidates import FBGEMM_FORMATS
from qcomm.benchmark.metrics import TCP_EFFICIENCY, collective_break_even, predicted_time
from qcomm.benchmark.options import DenseOp
from qcomm.benchmark.results import LinkFigures
from qcomm.benchmark.rows import CodecRow, Point

__all__ = [
    "Unlimited",
    "add_break_evens",
    "add_comparisons",
    "add_pytorch_ratios",
    "add_speedups",
    "rounds",
    "series_ratio",
    "torchrec_label",
]

#: per :attr:`Point.key <qcomm.benchmark.rows.Point.key>`, a call's median
#: round and every round with no link limit
Unlimited = dict[tuple[str, int, str, str], tuple[float, list[float]]]


def _over(theirs: float | None, ours: float | None) -> float | None:
    return None if theirs is None or ours is None else theirs / ours


def add_speedups(points: list[Point]) -> None:
    r"""
    add_speedups(points: list[Point]) -> None

    Sets every point's ``baseline`` and ``speedup``: the baseline of each
    implementation and pass is its first series (qcomm's no-op codec,
    TorchRec without codecs, the bare p2p exchange).

    Args:
        points (list[Point]): the points of one collective at one size.
    """
    baseline: dict[tuple[str, str], Point] = {}
    for p in points:
        base = baseline.setdefault((p.impl, p.passes), p)
        p.baseline = base.label
        ok = p.status == "ok" and base.status == "ok"
        p.speedup = _over(base.latency_s, p.latency_s) if ok else None


def rounds(p: Point) -> tuple[float, list[float]] | None:
    r"""
    rounds(p: Point) -> tuple[float, list[float]] | None

    A point's median round and every round; ``None`` if it was not timed.

    Args:
        p (Point): the point.
    """
    if p.latency_s is None or p.samples_s is None:
        return None
    return p.latency_s, list(p.samples_s)


def torchrec_label(label: str) -> str | None:
    r"""
    torchrec_label(label: str) -> str | None

    The TorchRec series of the same format as qcomm's codec ``label``; ``None``
    if fbgemm has none.

    Args:
        label (str): qcomm's codec.

    Examples::

        >>> torchrec_label("noop"), torchrec_label("int8"), torchrec_label("int8:row_dim=64")
        ('torchrec[none]', 'torchrec[fbgemm:int8]', None)
    """
    if label == "noop":
        return "torchrec[none]"
    name = label.partition(":")[0]
    fmt = FBGEMM_FORMATS.get(name)
    return None if fmt is None or label != name else f"torchrec[fbgemm:{fmt.lower()}]"


def series_ratio(p: Point, row: CodecRow | None, ranks_per_host: int = 1) -> float | None:
    r"""
    series_ratio(p: Point, row: CodecRow | None, ranks_per_host: int = 1) -> float | None

    The compression ratio of a series on the link between hosts: noop's
    bytes there over the series'. One codec's is its row's. Codecs by host
    send their ``other_host`` codecs' bytes between hosts: the forward
    codec's, and where both passes cross (forward and backward, or the
    all-reduce's reduce-scatter and all-gather) the mean of the two codecs'
    bytes; their all-reduce is hierarchical, so each host's ranks send
    ``1 / ranks_per_host`` of what the flat all-reduce sends between hosts.

    Args:
        p (Point): the series at one size and pass.
        row (CodecRow, optional): its codec's row; ``None`` if there is none.
        ranks_per_host (int, optional): :math:`K`. Default: ``1``.

    Examples::

        >>> row = CodecRow(codec="other_host=int8/fp16", source="qcomm", status="ok",
        ...                compression_ratio=4.0, backward_compression_ratio=2.0,
        ...                crossing_share=0.5)
        >>> point = Point(op="all_reduce", impl="qcomm", codec=row.codec, label=row.codec,
        ...               passes="fwd", size_bytes=64, status="ok")
        >>> round(series_ratio(point, row, ranks_per_host=2), 3)  # 2 / (1/4 + 1/2), twice
        5.333
    """
    if p.impl == "bare" or p.codec in ("none", "noop"):
        return 1.0
    if row is None or row.status != "ok":
        return None
    forward = row.compression_ratio
    if row.crossing_share is None or forward is None:
        return forward
    backward = row.backward_compression_ratio or forward
    dense = p.op == DenseOp.ALL_REDUCE.value
    if p.passes == "fwd" and not dense:
        return forward
    both = 2 / (1 / forward + 1 / backward)
    return both * ranks_per_host if dense else both


def _hosts_of(row: CodecRow | None, world_size: int, ranks_per_host: int) -> int:
    # The ranks per host codecs by host went by: their spec's ranks_per_host
    # where it gives one, which their crossing share follows.
    if row is None or row.crossing_share is None:
        return ranks_per_host
    return max(1, round(world_size * (1 - row.crossing_share)))


def add_comparisons(
    points: list[Point],
    codec_rows: list[CodecRow],
    link: LinkFigures | None,
    world_size: int,
    unlimited: Unlimited | None,
    ranks_per_host: int = 1,
) -> None:
    r"""
    add_comparisons(points: list[Point], codec_rows: list[CodecRow], link: LinkFigures | None, world_size: int, unlimited: Unlimited | None, ranks_per_host: int = 1) -> None

    Sets what each point is worth: against the link's bound (the float32
    bytes that cross each host's port, shrunk by the series' ratio,
    :func:`series_ratio`), against TorchRec's all-to-all with fbgemm's codec
    of the same format, and the model's figures
    (:func:`~qcomm.benchmark.metrics.predicted_time`): the bytes each call
    puts on a port, its time without a link limit, and with an emulated link
    the time the model predicts there; then :func:`add_break_evens`.

    Args:
        points (list[Point]): every point of the run.
        codec_rows (list[CodecRow]): the codecs' rows, for their ratios.
        link (LinkFigures, optional): the emulated link's figures, ``None`` without one.
        world_size (int): ranks.
        unlimited (Unlimited, optional): qcomm's times with the link's limit
            lifted; ``None``: the points' own times have no link limit
            (loopback); empty: none is known (a launcher's ranks).
        ranks_per_host (int, optional): :math:`K`, ranks sharing a host and
            its port; ``1``: every rank has a port of its own. Default: ``1``.
    """
    rows = {r.codec: r for r in codec_rows}
    rate = link.rate_bps if link else None
    measured = link.both_ways_GBps if link else None
    efficiency = measured * 1e9 * 8 / rate if rate and measured else TCP_EFFICIENCY
    latency = {p.key: p.latency_s for p in points if p.status == "ok"}
    # What a host's port carries of a call: its ranks' blocks for the ranks
    # of other hosts.
    k = ranks_per_host
    share = k * (world_size - k) / world_size
    for p in points:
        row = rows.get(p.codec)
        ratio = series_ratio(p, row, _hosts_of(row, world_size, k))
        p.compression_ratio = ratio
        if ratio and world_size > 1:
            # The backward pass sends as much again, the other way round.
            transfers = 2 if p.passes == "fwd+bwd" else 1
            if p.op == DenseOp.ALL_REDUCE.value:  # a reduce-scatter and an all-gather
                transfers *= 2
            crossing = transfers * p.size_bytes * share
            p.link_bytes = crossing / ratio / efficiency
            if rate:
                p.link_bound_s = crossing * 8 / rate / ratio
                if p.status == "ok":
                    p.x_link_bound = _over(p.latency_s, p.link_bound_s)
        if p.impl == "qcomm" and p.status == "ok":
            spread = unlimited.get(p.key) if unlimited is not None else rounds(p)
            if spread is not None:
                p.unlimited_s, p.unlimited_samples_s = spread
            if rate and p.unlimited_s and p.link_bytes is not None:
                p.predicted_s = predicted_time(p.link_bytes, rate / 8, p.unlimited_s)
                p.measured_over_predicted = _over(p.latency_s, p.predicted_s)
        other = torchrec_label(p.label) if p.impl == "qcomm" else None
        theirs = latency.get((p.op, p.size_bytes, p.passes, other)) if other else None
        if theirs and p.status == "ok":
            p.vs_torchrec = _over(theirs, p.latency_s)
    add_break_evens(points)


def add_break_evens(points: list[Point]) -> None:
    r"""
    add_break_evens(points: list[Point]) -> None

    Sets, by the model, the link rate below which each qcomm codec beats
    qcomm's no-op codec at the same op, size and pass
    (:func:`~qcomm.benchmark.metrics.collective_break_even`).

    Args:
        points (list[Point]): every point, with their link bytes and times
            without a link limit (:func:`add_comparisons`).
    """
    base: dict[tuple[str, int, str], tuple[Point, float, float]] = {}
    for p in points:
        if p.label == "noop" and p.unlimited_s and p.link_bytes is not None:
            base[p.op, p.size_bytes, p.passes] = (p, p.link_bytes, p.unlimited_s)
    for p in points:
        noop = base.get((p.op, p.size_bytes, p.passes))
        if p.impl != "qcomm" or noop is None or p is noop[0] or not p.unlimited_s:
            continue
        if p.link_bytes is None:  # the codec's own row failed: no ratio to weigh
            continue
        rate = collective_break_even(noop[1], noop[2], p.link_bytes, p.unlimited_s)
        # JSON has no infinity: "faster at every rate" is a flag of its own.
        p.pays_at_every_rate = math.isinf(rate)
        p.break_even_gbit_per_s = None if math.isinf(rate) else rate * 8 / 1e9


def add_pytorch_ratios(points: list[Point]) -> None:
    r"""
    add_pytorch_ratios(points: list[Point]) -> None

    Sets on every all-reduce point ``vs_allreduce_hook`` and
    ``vs_fp16_compress_hook``: that PyTorch hook's time
    (:data:`~qcomm.benchmark.series.PYTORCH_HOOKS`) over the point's, at the
    same size and pass (``None`` where either failed).

    Args:
        points (list[Point]): the collectives' points.

    Examples::

        >>> rows = [
        ...     Point(op="all_reduce", impl=impl, codec=codec, label=label, passes="fwd",
        ...           size_bytes=8, status="ok", latency_s=t)
        ...     for impl, codec, label, t in [
        ...         ("qcomm", "int8", "int8", 1.0),
        ...         ("pytorch", "allreduce_hook", "pytorch[allreduce_hook]", 3.0),
        ...         ("pytorch", "fp16_compress_hook", "pytorch[fp16_compress_hook]", 1.5),
        ...     ]
        ... ]
        >>> add_pytorch_ratios(rows)
        >>> rows[0].vs_allreduce_hook, rows[0].vs_fp16_compress_hook
        (3.0, 1.5)
    """
    ours = [p for p in points if p.op == DenseOp.ALL_REDUCE.value]
    times = {(p.size_bytes, p.passes, p.label): p.latency_s for p in ours if p.status == "ok"}

    def versus(p: Point, hook: str) -> float | None:
        theirs = times.get((p.size_bytes, p.passes, f"pytorch[{hook}]"))
        return _over(theirs, p.latency_s) if p.status == "ok" else None

    for p in ours:
        p.vs_allreduce_hook = versus(p, "allreduce_hook")
        p.vs_fp16_compress_hook = versus(p, "fp16_compress_hook")
