r"""
The report of ``qcomm bench``: the terminal table, the JSON file with every
figure, and the plot (bandwidth against message size for each collective,
error against bits per element).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from qcomm.benchmark.codecs import FBGEMM_FORMATS
from qcomm.benchmark.options import OP_TITLES, format_size

__all__ = ["UNITS", "format_report", "jsonable", "write_plot", "write_report"]

# What the JSON's fields mean; written into the file itself.
UNITS = {
    "size_bytes": "each rank's float32 buffer (nccl-tests' S), bytes",
    "latency_s": "median over blocks of the slowest rank's seconds per call",
    "algbw_gbps": "size_bytes / latency_s, in 1e9 bytes/s",
    "busbw_gbps": "algbw_gbps * (n - 1) / n, as nccl-tests for all-to-all and reduce-scatter",
    "speedup": "latency of the baseline (the row named by 'baseline') / latency_s",
    "encode_gbps": "float32 bytes encoded per second, 1e9 bytes/s",
    "decode_gbps": "float32 bytes decoded per second, 1e9 bytes/s",
    "*_roofline_fraction": "throughput / memory-copy throughput of the same float32 tensor",
    "wire_bytes_per_element": "bytes encode puts on the wire per float32 element",
    "compression_ratio": "4 / wire_bytes_per_element",
    "max_rel_error": "max |decoded - x| / max |x| (collectives: against the exact output)",
    "rms_rel_error": "sqrt(sum (decoded - x)^2 / sum x^2)",
    "sqnr_db": "10 log10(sum x^2 / sum (decoded - x)^2); null when exact (infinite)",
    "break_even_gbps": "(1 - wire/logical) / ((encode_s + decode_s) / logical bytes), 1e9 bytes/s",
    "pass": "'fwd': the collective; 'fwd+bwd': the collective and its backward pass together",
    "latency_min_s, latency_max_s": "fastest and slowest of the timed rounds (samples_s)",
    "samples_s": "seconds per call of each round (the slowest rank's), in the order run",
    "link_bound_s": "float32 bytes crossing a rank's port, size_bytes * (n - 1) / n (twice for "
    "fwd+bwd), over the emulated link's rate, divided by the codec's compression ratio",
    "x_link_bound": "latency_s / link_bound_s (1.0: the wire's limit)",
    "vs_torchrec": "latency of TorchRec's alltoall_pooled with fbgemm's codec of the same "
    "format / latency_s",
    "link.*_gbps": "float32 bytes per second the emulated link carried between ranks 0 and 1, "
    "one way, and each way when both send at once, 1e9 bytes/s",
}


def jsonable(value: Any) -> Any:
    r"""
    jsonable(value: Any) -> Any

    ``value`` with every non-finite float replaced by ``None``, since JSON has
    no infinity or NaN (an exact codec's SQNR is infinite).

    Args:
        value (Any): nested dicts, lists and scalars.

    Returns:
        Any: the same structure, valid for ``json.dumps(allow_nan=False)``.

    Examples::

        >>> jsonable({"sqnr_db": float("inf"), "x": [1.0, float("nan")]})
        {'sqnr_db': None, 'x': [1.0, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 1) -> str:
    # The first `right` columns are text, left-aligned; the figures align right.
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [
            c.ljust(w) if i < right else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _codec_table(results: dict[str, Any]) -> str:
    header = [
        "codec",
        "bits/el",
        "ratio",
        "enc GB/s",
        "x copy",
        "dec GB/s",
        "x copy",
        "max rel",
        "rms rel",
        "SQNR dB",
        "break-even GB/s",
    ]
    rows = []
    for r in results["codecs"]:
        if r["status"] != "ok":
            rows.append([r["codec"], "failed", *[""] * (len(header) - 2)])
            continue
        rows.append(
            [
                r["codec"],
                _num(r["bits_per_element"]),
                _num(r["compression_ratio"]),
                _num(r["encode_gbps"]),
                _num(r["encode_roofline_fraction"], 2),
                _num(r["decode_gbps"]),
                _num(r["decode_roofline_fraction"], 2),
                _num(r["max_rel_error"], 2),
                _num(r["rms_rel_error"], 2),
                _num(r["sqnr_db"]),
                _num(r["break_even_gbps"]),
            ]
        )
    return _table(header, rows)


def _collective_tables(results: dict[str, Any], passes: str) -> list[str]:
    tables = []
    sizes = sorted({p["size_bytes"] for p in results["collectives"]})
    for op in dict.fromkeys(p["op"] for p in results["collectives"]):
        points = [p for p in results["collectives"] if p["op"] == op and p["pass"] == passes]
        if not points:
            continue
        labels = list(dict.fromkeys(p["label"] for p in points))
        cells = {(p["label"], p["size_bytes"]): p for p in points}
        rows = []
        for label in labels:
            row = [label]
            for size in sizes:
                p = cells.get((label, size))
                if p is None:
                    row.append("")
                elif p["status"] != "ok":
                    row.append("failed")
                else:
                    speedup = "-" if p["speedup"] is None else f"{p['speedup']:.2f}"
                    row.append(f"{_num(p['busbw_gbps'])} x{speedup}")
            rows.append(row)
        title = OP_TITLES.get(op, op) + ("" if passes == "fwd" else ", forward+backward")
        header = [title, *[format_size(s) for s in sizes]]
        tables.append(_table(header, rows))
    return tables


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


def _times(values: list[float | None], digits: int = 3) -> str:
    return "-" if values[0] is None else f"{values[0]:.{digits}g}"


def _detail_tables(results: dict[str, Any]) -> list[str]:
    # The largest size of each collective, every figure of a row: time with
    # its spread, speed-up and what the compression ratio promises, against
    # the link's bound and against TorchRec.
    points = results["collectives"]
    if not points:
        return []
    size = max(p["size_bytes"] for p in points)
    linked = any(p.get("link_bound_s") for p in points)
    header = ["series", "pass", "ms", "min-max ms", "speed-up", "ratio"]
    header += ["bound ms", "x bound"] if linked else []
    header += ["vs TorchRec"]
    tables = []
    for op in dict.fromkeys(p["op"] for p in points):
        rows = []
        for p in points:
            if p["op"] != op or p["size_bytes"] != size:
                continue
            if p["status"] != "ok":
                rows.append([p["label"], p["pass"], "failed", *[""] * (len(header) - 3)])
                continue
            row = [
                p["label"],
                p["pass"],
                _ms(p["latency_s"]),
                f"{_ms(p['latency_min_s'])}-{_ms(p['latency_max_s'])}",
                "-" if p["speedup"] is None else f"x{p['speedup']:.2f}",
                _num(p.get("compression_ratio")),
            ]
            if linked:
                row += [_ms(p.get("link_bound_s")), _times([p.get("x_link_bound")])]
            row.append("-" if p.get("vs_torchrec") is None else f"x{p['vs_torchrec']:.2f}")
            rows.append(row)
        title = f"{OP_TITLES.get(op, op)}, {format_size(size)} per rank"
        tables.append(title + ":\n" + _table(header, rows, right=2))
    return tables


def _link_line(link: dict[str, Any] | None) -> list[str]:
    if not link:
        return []
    rate = link["rate_bps"]
    measured = (
        f"measured {_num(link.get('one_way_gbps'))} GB/s one way, "
        f"{_num(link.get('both_ways_gbps'))} GB/s each way with both sending"
        if link.get("one_way_gbps")
        else f"not measured ({_first_line(link.get('error'))})"
    )
    return [
        f"Emulated link: {link['spec']} each way ({rate / 8 / 1e9:.3g} GB/s), {measured} "
        f"({format_size(link['bytes'])} of float32 per transfer).",
    ]


def format_report(results: dict[str, Any]) -> str:
    r"""
    format_report(results: dict[str, Any]) -> str

    The terminal report: the codec table, one bandwidth table per collective,
    and the failures with their reasons.

    Args:
        results (dict[str, Any]): what :func:`~qcomm.benchmark.runner.run_rank`
            gathered (the JSON's content).

    Returns:
        str: the text to print.
    """
    meta = results["meta"]
    roof = results["roofline"]
    lines = [
        f"qcomm bench: {meta['world_size']} ranks, {meta['backend']} on {meta['device']}, "
        f"{meta['threads_per_rank']} thread(s) per rank, {meta['duration_s']:.0f} s",
        *_link_line(results.get("link")),
        "",
        f"Codecs on {format_size(roof['bytes'])} of float32 per rank "
        f"(memory copy: {_num(roof['copy_gbps'])} GB/s; 'x copy' = fraction of it; "
        f"errors relative to max|x|):",
        _codec_table(results),
    ]
    for table in _collective_tables(results, "fwd") + _collective_tables(results, "fwd+bwd"):
        lines += ["", table]
    for table in _detail_tables(results):
        lines += ["", table]
    load = (meta.get("load_before"), meta.get("load_after"))
    lines += [
        "",
        "Collectives: bus bandwidth in GB/s of float32 (nccl-tests' busbw) and speed-up "
        "over the no-op codec (TorchRec: over TorchRec without codec; bare: over p2p); "
        "times are the median round, with the fastest and slowest; "
        "'ratio' is the codec's compression ratio, the speed-up the wire alone would give; "
        "'x bound' is the time over the link's bound for that many wire bytes; "
        "'vs TorchRec' is TorchRec's time with fbgemm's codec of the format over qcomm's.",
        "noop's encode and decode return their input: their throughput is the cost of a call.",
    ]
    if load[0] and load[1]:
        lines.append(
            f"Machine load (1-minute average) {load[0][0]:.2f} before, {load[1][0]:.2f} after, "
            f"on {meta.get('cpu_count')} cores."
        )
    failures = [(r["codec"], r["error"]) for r in results["codecs"] if r["status"] != "ok"]
    # One line per collective and reason, listing the sizes it failed at.
    failed_sizes: dict[tuple[str, str], list[str]] = {}
    for p in results["collectives"]:
        if p["status"] != "ok":
            key = (f"{p['label']} {OP_TITLES.get(p['op'], p['op'])}", _first_line(p["error"]))
            failed_sizes.setdefault(key, []).append(format_size(p["size_bytes"]))
    failures += [
        (f"{name} ({', '.join(sizes)})", error) for (name, error), sizes in failed_sizes.items()
    ]
    unavailable = [(k, v) for k, v in results["unavailable"].items() if v]
    if failures or unavailable:
        lines += ["", "Failed or unavailable:"]
        lines += [f"  {name}: {_first_line(error)}" for name, error in [*unavailable, *failures]]
    return "\n".join(lines)


def _first_line(text: str | None, width: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "unknown error"
    return line if len(line) <= width else line[: width - 3] + "..."


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


def write_plot(results: dict[str, Any], path: str) -> None:
    r"""
    write_plot(results: dict[str, Any], path: str) -> None

    Draws bus bandwidth against message size for each collective (one line
    per codec, TorchRec's dashed, a format's rows in one colour) and RMS error
    against wire bits per element (qcomm's codecs as dots, fbgemm's as
    crosses), as a PNG.

    Args:
        results (dict[str, Any]): the run's figures.
        path (str): the PNG file to write.

    Raises:
        ImportError: if matplotlib is not installed.
    """
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
    panels = len(ops) + 1
    cols = 2 if panels > 1 else 1
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.8 * rows + 1.2), squeeze=False)
    flat = list(axes.flat)
    sizes = sorted({p["size_bytes"] for p in results["collectives"]})
    meta = results["meta"]
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    handles: dict[str, Any] = {}
    for ax, op in zip(flat, ops):
        for label in labels:
            line = sorted(
                (p["size_bytes"], p["busbw_gbps"])
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
        ax.set_title(f"{OP_TITLES.get(op, op)}, {meta['world_size']} ranks, {meta['backend']}")
        ax.grid(True, which="major", alpha=0.3)
    ax = flat[len(ops)]
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
    ax.set_title("error against size on the wire (o qcomm, x fbgemm; exact codecs left out)")
    ax.grid(True, which="major", alpha=0.3)
    for extra in flat[panels:]:
        extra.set_visible(False)
    fig.suptitle(
        f"qcomm bench, {meta['started']}: bus bandwidth per codec (solid: qcomm, "
        "dashed: TorchRec alltoall_pooled) and error per codec"
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


def write_report(
    results: dict[str, Any], *, json_path: str | None = None, plot_path: str | None = None
) -> None:
    r"""
    write_report(results: dict[str, Any], *, json_path: str | None = None, plot_path: str | None = None) -> None

    Prints the table on stdout and writes the JSON and the plot if asked.

    Args:
        results (dict[str, Any]): the run's figures.
        json_path (str, optional): where to write them all. Default: ``None``.
        plot_path (str, optional): where to draw the PNG. Default: ``None``.
    """
    print(format_report(results), flush=True)
    if json_path:
        data = jsonable({**results, "units": UNITS})
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"figures written to {json_path}", file=sys.stderr)
    if plot_path:
        write_plot(results, plot_path)
        print(f"plot written to {plot_path}", file=sys.stderr)
