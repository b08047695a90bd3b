r"""
The plot of ``qcomm bench``: which codec pays on which link (the model's
curves, the points measured, where this CPU rather than the link limits),
what each costs in error, and what each collective moved. Needs matplotlib,
imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from qcomm.benchmark.advice import (
    advice_rates,
    cpu_limits,
    expected_speedups,
    run_advice,
    speedups,
)
from qcomm.benchmark.candidates import FBGEMM_FORMATS
from qcomm.benchmark.options import OP_TITLES, format_size
from qcomm.benchmark.results import Results, codec_rows, points

__all__ = ["draw", "write_plot"]

# Where a label of the error panel may go, in points from its point, nearest
# first: right, left, then higher and lower rows on either side.
_SPOTS = [(8 * side, 10 * row) for step in range(9) for row in {step, -step} for side in (1, -1)]


def _family(label: str) -> str:
    # Rows of the same format share a colour: "torchrec[fbgemm:fp8]",
    # "fbgemm:fp8" and "fp8_e4m3" are all fp8_e4m3; TorchRec without codec is noop.
    if label.startswith("torchrec["):
        label = label[len("torchrec[") : -1]
    if label == "none":
        return "noop"
    if label.startswith("fbgemm:"):
        return _FBGEMM_FAMILY.get(label[len("fbgemm:") :], label)
    return label


_FBGEMM_FAMILY = {fmt.lower(): name for name, fmt in FBGEMM_FORMATS.items()}
# Curves that coincide (one ratio, one cost: int8 and fp8_e4m3, fp16 and bf16)
# are told apart by their line: the later ones dashed, thinner, on top.
_STYLES = [("-", 2.6), ("--", 1.8), (":", 1.6), ("-.", 1.4)]
# How a codec the error budget leaves out is drawn: faint, so the eye does
# not pick it.
_FADED = 0.3


def _answer(results: Results) -> tuple[float | None, dict[str, dict[float, str]]]:
    """The advice's error budget and its forward pick per collective and link rate."""
    advice = results.advice
    if advice is None:
        try:
            advice = run_advice(results)
        except (KeyError, TypeError, ValueError):  # a run without the advice's figures
            return None, {}
    picks: dict[str, dict[float, str]] = {}
    for rate in advice.rates:
        for a in rate.collectives:
            picks.setdefault(a.op, {})[rate.gbit_per_s] = a.forward
    return advice.max_rms_error, picks


def _over_budget(results: Results, budget: float | None) -> set[str]:
    if budget is None:
        return set()
    return {
        r.codec
        for r in codec_rows(results)
        if r.status == "ok" and r.rms_rel_error is not None and r.rms_rel_error > budget
    }


def _speedup_panel(ax: Any, results: Results, color: dict[str, Any]) -> list[Any]:
    # Expected speed-up against link rate (the model), measured points where
    # the run had an emulated link, the user's link and this CPU's limit
    # marked. Returns the curves' end labels, to spread once laid out.
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    shown = expected_speedups(results, [1.0])  # which op the panel shows
    if not shown:
        ax.text(0.5, 0.5, "no model figures in this run", ha="center", transform=ax.transAxes)
        return []
    op = next(iter(shown))
    # Above this rate the machine's encode, decode and copies, not the link,
    # set the time: the curves flatten.
    cpu = cpu_limits(results).get(op)
    low, high = 0.1, 400.0
    if cpu:  # the limit on the axis, with room either side
        low, high = min(low, cpu / 3), max(high, cpu * 3)
    rates = list(np.logspace(np.log10(low), np.log10(high), 80))
    budget, picks = _answer(results)
    over = _over_budget(results, budget)
    ends = []
    drawn: list[list[float]] = []
    for label, figures in expected_speedups(results, rates)[op].items():
        # None: noise (more than the codec's bytes allow), left as a gap.
        values = [math.nan if v is None else v for v in figures]
        last = [v for v in values if not math.isnan(v)]
        if not last:
            continue
        same = sum(_coincide(values, other) for other in drawn)
        drawn.append(values)
        style, width = _STYLES[same % len(_STYLES)]
        alpha = _FADED if label in over else 1.0
        ax.plot(
            rates, values, color=color[_family(label)], linewidth=width, linestyle=style,
            alpha=alpha, zorder=2 + same,
        )  # fmt: skip
        # Named by its right end (its last figure), in a column right of the
        # axes; _spread_ends moves it up or down once the layout fixes where
        # the curves end.
        name = f"{label} (over budget)" if label in over else label
        ends.append(
            ax.annotate(
                name, (rates[-1], last[-1]), xytext=(4, 0), textcoords="offset points",
                va="center", fontsize=8, color=color[_family(label)], annotation_clip=False,
                alpha=alpha,
            )
        )  # fmt: skip
    _mark_picks(ax, results, op, picks.get(op, {}), color)
    ax.set_xlim(low, high)  # the curves end on the right spine, by their labels

    def mark(rate: float, text: str, top: bool) -> None:
        # A vertical line's name, inside the axes on the side with room: at
        # the top (CPU) or the bottom (link), so the two never meet.
        right = math.log(rate / low) / math.log(high / low) > 0.6
        ax.annotate(
            text, (rate, 0.98 if top else 0.02), xycoords=ax.get_xaxis_transform(),
            xytext=(-4 if right else 4, 0), textcoords="offset points",
            ha="right" if right else "left", va="top" if top else "bottom", fontsize=8,
            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "alpha": 0.7, "linewidth": 0},
        )  # fmt: skip

    if cpu:
        ax.axvline(cpu, color="firebrick", linestyle="-.", linewidth=1.2)
        mark(cpu, f"this CPU: {cpu:.3g} Gbit/s;\nabove it the CPU,\nnot the link, limits", True)
    link = results.link
    size = max(p.size_bytes for p in points(results))
    if link and link.rate_bps:
        rate = link.rate_bps / 1e9
        # The speed-ups measured on the link, as the tables and the advice
        # give them; a figure that is noise is not drawn either.
        measured = {
            label: figure
            for label, figure in speedups(results, rate).get(op, {}).items()
            if figure.measured and not figure.noise
        }
        for label, figure in measured.items():
            ax.scatter([rate], [figure.value], color=color[_family(label)], s=40)
        if measured:  # one grey dot stands for all: a codec's colour is its curve's
            ax.scatter([], [], color="grey", s=40, label=f"measured on the {link.spec} link")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left", fontsize=8)  # the CPU's mark sits at the top
    for rate in advice_rates(results):
        ax.axvline(rate, color="grey", linestyle=":", linewidth=1)
    user = results.bench_meta.link_gbps or (link.rate_bps / 1e9 if link and link.rate_bps else None)
    if user:
        ax.axvline(user, color="black", linestyle="--", linewidth=1.2)
        mark(user, f"your link: {user:g} Gbit/s", False)
    ax.axhline(1.0, color="black", linewidth=0.8, zorder=1)  # under noop's curve
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("link rate, Gbit/s each way (log)")
    ax.set_ylabel("expected speed-up over no codec")
    ax.set_title(
        f"{OP_TITLES.get(op, op)}, {format_size(size)} per rank: which codec pays on which link",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    return ends


def _coincide(a: list[float], b: list[float]) -> bool:
    # Within 3% everywhere both are drawn: one would hide the other.
    both = [(x, y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    return bool(both) and all(abs(x - y) <= 0.03 * max(abs(x), abs(y)) for x, y in both)


def _mark_picks(
    ax: Any, results: Results, op: str, picks: dict[float, str], color: dict[str, Any]
) -> None:
    # The advice's answer on its curve: a star at each rate it advises for.
    if not picks:
        return
    at = sorted(picks)
    figures = expected_speedups(results, at).get(op, {})
    for k, rate in enumerate(at):
        pick = picks[rate]
        value = (figures.get(pick) or [None] * len(at))[k]
        if value is None:
            continue
        ax.scatter(
            [rate], [value], marker="*", s=220, color=color.get(_family(pick), "black"),
            edgecolors="black", linewidths=0.8, zorder=10,
        )  # fmt: skip
    names = ", ".join(f"{picks[r]} at {r:g}" for r in at)
    ax.scatter(
        [], [], marker="*", s=120, color="white", edgecolors="black",
        label=f"the advice's pick (Gbit/s): {names}",
    )  # fmt: skip


def _spread_ends(ax: Any, labels: list[Any], renderer: Any) -> None:
    # Greedy, in display space (where the log scale is already applied): from
    # the lowest curve end up, each label at least a label's height above the
    # one below; then from the top down, so that none leaves the axes' top.
    if not labels:
        return
    ends = [ax.transData.transform(label.xy)[1] for label in labels]
    step = max(label.get_window_extent(renderer).height for label in labels) + 1.0
    order = sorted(range(len(labels)), key=lambda i: ends[i])
    ys = [ends[i] for i in order]
    for k in range(1, len(ys)):
        ys[k] = max(ys[k], ys[k - 1] + step)
    ys[-1] = min(ys[-1], ax.bbox.y1 - step / 2)
    for k in range(len(ys) - 2, -1, -1):
        ys[k] = min(ys[k], ys[k + 1] - step)
    points_per_pixel = 72 / ax.figure.dpi  # offsets in points survive savefig's dpi
    for i, y in zip(order, ys):
        labels[i].set_position((4, (y - ends[i]) * points_per_pixel))


def _error_panel(ax: Any, results: Results, color: dict[str, Any]) -> list[Any]:
    # Returns the points' labels, placed by _place_labels once laid out.
    shown = [
        (r.codec, r.source == "fbgemm", r.bits_per_element, r.rms_rel_error)
        for r in codec_rows(results)
        if r.status == "ok" and r.rms_rel_error and r.bits_per_element is not None
    ]  # an exact codec has no place on a log scale
    xy = [(x, y) for _, _, x, y in shown]
    budget, picks = _answer(results)
    over = _over_budget(results, budget)
    chosen = {pick for by_rate in picks.values() for pick in by_rate.values()}
    labels = []
    for codec, fbgemm, x, y in shown:
        alpha = _FADED if codec in over else 1.0
        if fbgemm:  # a cross, inside qcomm's ring where the two coincide
            ax.scatter(x, y, marker="x", s=50, color=color[_family(codec)], zorder=4, alpha=alpha)
        else:
            ax.scatter(
                x, y, marker="o", s=110, facecolors="none", edgecolors=color[_family(codec)],
                linewidths=1.8, zorder=3, alpha=alpha,
            )  # fmt: skip
        if codec in chosen:
            ax.scatter(
                x, y, marker="*", s=260, color=color[_family(codec)], edgecolors="black",
                linewidths=0.8, zorder=5,
            )  # fmt: skip
        labels.append(
            ax.annotate(
                codec, (x, y), textcoords="offset points", xytext=_SPOTS[0],
                va="center", fontsize=8, alpha=alpha,
            )
        )  # fmt: skip
    ax.set_yscale("log")
    if xy:  # room for the labels around the lowest and highest points
        ax.set_ylim(min(y for _, y in xy) / 3, max(y for _, y in xy) * 3)
    if budget is not None:
        ax.axhline(
            budget, color="firebrick", linestyle="--", linewidth=1.2,
            label=f"error budget: RMS {budget:g} (--max-error); above it, faint, left out",
        )  # fmt: skip
    if chosen:
        ax.scatter(
            [], [], marker="*", s=120, color="white", edgecolors="black",
            label=f"the advice's pick: {', '.join(sorted(chosen))}",
        )  # fmt: skip
    if budget is not None or chosen:
        # Room above the highest point, for the legend to cover no label.
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 15)
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(left=0, right=max([x for x, _ in xy], default=32) + 6)
    ax.set_xlabel("wire bits per element (measured, scales included)")
    ax.set_ylabel("RMS relative error against float32")
    ax.set_title("what it costs: error against size on the wire (o qcomm, x fbgemm)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return labels


def _place_labels(ax: Any, labels: list[Any], renderer: Any) -> None:
    # Each label takes the first of _SPOTS where it stays inside the axes and
    # covers no label placed before it and no point's marker (points of one
    # format, qcomm's and fbgemm's, often coincide). Where none is free it
    # keeps the first spot.
    pixels = ax.figure.dpi / 72
    markers = []
    for label in labels:
        x, y = ax.transData.transform(label.xy)
        markers.append((x - 5 * pixels, y - 5 * pixels, x + 5 * pixels, y + 5 * pixels))
    taken: list[tuple[float, float, float, float]] = []
    frame = ax.bbox
    for label in labels:
        for dx, dy in [*_SPOTS, _SPOTS[0]]:
            label.set_position((dx, dy))
            label.set_horizontalalignment("left" if dx > 0 else "right")
            box = label.get_window_extent(renderer)
            edges = (box.x0 - 1, box.y0 - 1, box.x1 + 1, box.y1 + 1)
            inside = frame.x0 <= edges[0] and edges[2] <= frame.x1
            inside = inside and frame.y0 <= edges[1] and edges[3] <= frame.y1
            if inside and not any(_overlap(edges, other) for other in taken + markers):
                break
        taken.append(edges)


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _bandwidth_panel(
    ax: Any, results: Results, op: str, color: dict[str, Any], handles: dict[str, Any]
) -> None:
    # Bus bandwidth against size: a format in one colour, TorchRec dashed,
    # bare dotted. Adds each series' line to handles, for the row's legend.
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    every = points(results)
    timed = [p for p in every if p.status == "ok" and p.passes == "fwd"]
    sizes = sorted({p.size_bytes for p in every})
    for label in dict.fromkeys(p.label for p in every):
        line = sorted(
            (p.size_bytes, p.busbw_GBps)
            for p in timed
            if p.op == op and p.label == label and p.busbw_GBps is not None
        )
        if not line:
            continue
        torchrec = label.startswith("torchrec")
        bare = label.startswith("bare:")
        (handle,) = ax.plot(
            [s for s, _ in line],
            [b for _, b in line],
            marker="x" if torchrec else "." if bare else "o",
            linestyle="--" if torchrec else ":" if bare else "-",
            color=color[_family(label)],
            linewidth=1.6,
            markersize=5,
        )
        handles.setdefault(label, handle)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size per rank (float32 bytes)")
    ax.set_ylabel("bus bandwidth, GB/s of float32")
    meta = results.meta
    where = f"{results.link.spec} link" if results.link else meta.backend
    ax.set_title(f"{OP_TITLES.get(op, op)}, {meta.world_size} ranks, {where}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


def draw(results: Results | Mapping[str, Any]) -> Any:
    r"""
    draw(results: Results | Mapping[str, Any]) -> matplotlib.figure.Figure

    The bench's figure: expected speed-up against link rate and error against
    wire bits on the first row, one bus-bandwidth panel per collective on the
    second. Needs matplotlib.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = Results.of(results)
    every = points(results)
    ops = list(dict.fromkeys(p.op for p in every))
    labels = list(dict.fromkeys(p.label for p in every))
    families = list(
        dict.fromkeys(_family(name) for name in [*(r.codec for r in codec_rows(results)), *labels])
    )
    tab10, dark2 = colormaps.get_cmap("tab10"), colormaps.get_cmap("Dark2")
    palette = [tab10(i) for i in range(10)] + [dark2(i) for i in range(8)]
    color = {name: palette[i % len(palette)] for i, name in enumerate(families)}
    # Two rows, each laid out on its own (subfigures), so any number of
    # collectives fills the second row's width and no slot stays empty.
    fig = Figure(figsize=(max(15.0, 4.8 * len(ops)), 11.0 if ops else 5.5), layout="constrained")
    canvas: Any = FigureCanvasAgg(fig)  # measures the labels below, and saves the PNG
    rows: Any = fig.subfigures(2, 1, height_ratios=(1.0, 1.2)) if ops else (fig, None)
    top, bottom = rows
    speedup_ax, error_ax = top.subplots(1, 2)
    ends = _speedup_panel(speedup_ax, results, color)
    marks = _error_panel(error_ax, results, color)
    if bottom is not None:
        handles: dict[str, Any] = {}
        for ax, op in zip(bottom.subplots(1, len(ops), squeeze=False)[0], ops):
            _bandwidth_panel(ax, results, op, color, handles)
        bottom.legend(
            list(handles.values()), list(handles), loc="outside lower center",
            ncol=min(9, max(1, len(handles))), fontsize=8, frameon=False,
            title="bus-bandwidth panels: qcomm solid, TorchRec dashed, bare dotted",
            title_fontsize=8,
        )  # fmt: skip
    fig.suptitle(
        f"qcomm bench, {results.meta.started}: which codec on which link, what it costs, "
        "and what each collective moved in this run"
    )
    # The labels go where they do not overlap only once the layout is
    # final: lay out (the end labels, still at their curves, get their
    # room on the right), freeze it, then move them.
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    renderer = canvas.get_renderer()
    _spread_ends(speedup_ax, ends, renderer)
    _place_labels(error_ax, marks, renderer)
    return fig


def write_plot(results: Results | Mapping[str, Any], path: str) -> None:
    r"""
    write_plot(results: Results | Mapping[str, Any], path: str) -> None

    Draws the bench's figure (:func:`draw`) into a PNG file.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
        path (str): the PNG file to write.
    """
    draw(results).savefig(path, dpi=110)
