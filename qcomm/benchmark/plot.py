r"""
The plot of ``qcomm bench``: which codec pays on which link (the model's
curves, the points measured), what each costs in error, and what each
collective moved. Needs matplotlib, imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from typing import Any

from qcomm.benchmark.advice import advice_rates, expected_speedups
from qcomm.benchmark.candidates import FBGEMM_FORMATS
from qcomm.benchmark.options import OP_TITLES, format_size

__all__ = ["write_plot"]


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


def _label_offsets(points: list[tuple[float, float]]) -> list[int]:
    # Stack the labels of points that (nearly) coincide instead of overprinting.
    offsets = []
    for i, (x, y) in enumerate(points):
        near = sum(1 for (u, v) in points[:i] if abs(u - x) < 1.0 and max(v, y) / min(v, y) < 1.6)
        offsets.append(near)
    return offsets


def _speedup_panel(ax: Any, results: dict[str, Any], color: dict[str, Any]) -> dict[str, Any]:
    # Expected speed-up against link rate (the model), measured points where
    # the run had an emulated link, the user's link marked.
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    rates = list(np.logspace(np.log10(0.1), np.log10(400.0), 80))
    curves = expected_speedups(results, rates)
    handles: dict[str, Any] = {}
    if not curves:
        ax.text(0.5, 0.5, "no model figures in this run", ha="center", transform=ax.transAxes)
        return handles
    op = next(iter(curves))
    for label, values in curves[op].items():
        (handles[label],) = ax.plot(
            rates, values, color=color[_family(label)], label=label, linewidth=1.8
        )
    link = results.get("link")
    size = max(p["size_bytes"] for p in results["collectives"])
    if link and link.get("rate_bps"):
        measured = [
            p
            for p in results["collectives"]
            if p["op"] == op
            and p["impl"] == "qcomm"
            and p["pass"] == "fwd"
            and p["size_bytes"] == size
            and p.get("speedup")
        ]
        for p in measured:
            ax.scatter(
                [link["rate_bps"] / 1e9], [p["speedup"]], color=color[_family(p["label"])], s=40
            )
    for rate in advice_rates(results):
        ax.axvline(rate, color="grey", linestyle=":", linewidth=1)
    user = results["meta"].get("link_gbps") or (
        link["rate_bps"] / 1e9 if link and link.get("rate_bps") else None
    )
    if user:
        ax.axvline(user, color="black", linestyle="--", linewidth=1.2)
        ax.annotate(
            f"your link: {user:g} Gbit/s", (user, 1.0), textcoords="offset points",
            xytext=(4, 6), fontsize=8,
        )  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("link rate, Gbit/s each way (log)")
    ax.set_ylabel("expected speed-up over no codec")
    dots = " (dots: measured on the emulated link)" if link else ""
    ax.set_title(
        f"{OP_TITLES.get(op, op)}, {format_size(size)} per rank: "
        f"which codec pays on which link{dots}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    return handles


def _error_panel(ax: Any, results: dict[str, Any], color: dict[str, Any]) -> None:
    shown = [
        r for r in results["codecs"] if r["status"] == "ok" and r.get("rms_rel_error")
    ]  # an exact codec has no place on a log scale
    xy = [(r["bits_per_element"], r["rms_rel_error"]) for r in shown]
    for r, (x, y), stacked in zip(shown, xy, _label_offsets(xy)):
        fbgemm = r["source"] == "fbgemm"
        ax.scatter(
            x, y, marker="x" if fbgemm else "o", s=60, color=color[_family(r["codec"])], zorder=3
        )
        ax.annotate(
            r["codec"],
            (x, y),
            textcoords="offset points",
            xytext=(10, 6 - 12 * stacked),
            fontsize=8,
        )
    ax.set_yscale("log")
    if xy:  # room for the labels around the lowest and highest points
        ax.set_ylim(min(y for _, y in xy) / 3, max(y for _, y in xy) * 2)
    ax.set_xlim(left=0, right=max([x for x, _ in xy], default=32) + 6)
    ax.set_xlabel("wire bits per element (measured, scales included)")
    ax.set_ylabel("RMS relative error against float32")
    ax.set_title("what it costs: error against size on the wire (o qcomm, x fbgemm)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


def write_plot(results: dict[str, Any], path: str) -> None:
    # Speed-up against link rate, error against wire bits, and bus bandwidth
    # against size (a format in one colour, TorchRec dashed, bare dotted).
    # Needs matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    points = [p for p in results["collectives"] if p["status"] == "ok" and p["pass"] == "fwd"]
    ops = list(dict.fromkeys(p["op"] for p in results["collectives"]))
    labels = list(dict.fromkeys(p["label"] for p in results["collectives"]))
    families = list(
        dict.fromkeys(_family(name) for name in [*(r["codec"] for r in results["codecs"]), *labels])
    )
    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + [
        plt.get_cmap("Dark2")(i) for i in range(8)
    ]
    color = {name: palette[i % len(palette)] for i, name in enumerate(families)}
    panels = 2 + len(ops)
    cols = 2
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.8 * rows + 1.2), squeeze=False)
    flat = list(axes.flat)
    handles = _speedup_panel(flat[0], results, color)
    _error_panel(flat[1], results, color)
    sizes = sorted({p["size_bytes"] for p in results["collectives"]})
    meta = results["meta"]
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax, op in zip(flat[2:], ops):
        for label in labels:
            line = sorted(
                (p["size_bytes"], p["busbw_GBps"])
                for p in points
                if p["op"] == op and p["label"] == label
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
                label=label,
                linewidth=1.6,
                markersize=5,
            )
            handles.setdefault(label, handle)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("message size per rank (float32 bytes)")
        ax.set_ylabel("bus bandwidth, GB/s of float32")
        where = f"{results['link']['spec']} link" if results.get("link") else meta["backend"]
        ax.set_title(f"{OP_TITLES.get(op, op)}, {meta['world_size']} ranks, {where}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    for extra in flat[panels:]:
        extra.set_visible(False)
    fig.suptitle(
        f"qcomm bench, {meta['started']}: which codec on which link, what it costs, "
        "and what each collective moved in this run"
    )
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="lower center",
        ncol=min(7, max(1, len(handles))),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
