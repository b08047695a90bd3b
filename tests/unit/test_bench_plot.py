"""The plot of `qcomm bench` reads alone: every speed-up curve named at its
end, no two labels of the first row printed on each other, no empty panel for
1 to 4 collectives, and this CPU's limit drawn and named. Checked on the
matplotlib figure of small synthetic runs, built here."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from matplotlib.legend import Legend  # noqa: E402

import qcomm.benchmark.plot as plot  # noqa: E402
from qcomm.benchmark.results import Advice, record_json  # noqa: E402

OPS = [
    "pooled_embeddings_all_to_all",
    "pooled_embeddings_reduce_scatter",
    "sequence_embeddings_all_to_all",
    "all_reduce",
]
SIZES = [65536, 1048576]
# noop's link bytes and time without a link limit at the largest size: the
# CPU's limit is 4e6 * 8 / 0.003 / 1e9 = 10.67 Gbit/s.
NOOP_BYTES, NOOP_S = 4e6, 0.003
CPU_GBIT = NOOP_BYTES * 8 / NOOP_S / 1e9
# codec -> (compression ratio, time without a link limit): five of the curves
# end within 2% of one another, so their end labels must be spread apart.
MODEL = {
    "noop": (1.0, NOOP_S),
    "bf16": (2.0, 0.0030),
    "fp16": (2.0, 0.00302),
    "int8": (3.2, 0.00304),
    "fp8_e4m3": (3.2, 0.00306),
    "fp8_e5m2": (3.2, 0.0045),
    "fp8_e4m3_tensor": (4.0, 0.0046),
    "int4": (6.4, 0.008),
    "mx4": (7.5, 0.0035),
}
# (codec, source, wire bits per element, RMS error), from a real run: mx4 and
# int4 were printed on each other, fbgemm's points sit on qcomm's.
CODECS = [
    ("noop", "qcomm", 32.0, 0.0),
    ("bf16", "qcomm", 16.0, 0.0017),
    ("fp16", "qcomm", 16.0, 0.00021),
    ("fp8_e4m3", "qcomm", 10.0, 0.024),
    ("fp8_e4m3_tensor", "qcomm", 8.0, 0.42),
    ("fp8_e5m2", "qcomm", 10.0, 0.048),
    ("int4", "qcomm", 5.0, 0.078),
    ("int8", "qcomm", 10.0, 0.0046),
    ("mx4", "qcomm", 4.25, 0.11),
    ("fbgemm:bf16", "fbgemm", 16.0, 0.0017),
    ("fbgemm:fp16", "fbgemm", 16.0, 0.00021),
    ("fbgemm:fp8", "fbgemm", 8.0, 0.42),
    ("fbgemm:int8", "fbgemm", 10.0, 0.0046),
    ("fbgemm:mx4", "fbgemm", 4.25, 0.11),
]
OTHERS = ["torchrec[none]", "torchrec[fbgemm:int8]", "bare:p2p", "bare:native"]


def make_results(ops: int = 3, link: bool = False, local: bool = True) -> dict[str, Any]:
    # What draw() reads of a run's JSON content, and no more.
    collectives = []
    for op, size in itertools.product(OPS[:ops], SIZES):
        scale = size / SIZES[-1]
        for label in [*MODEL, *OTHERS]:
            ratio, unlimited = MODEL.get(label, (1.0, NOOP_S))
            collectives.append(
                {
                    "op": op,
                    "impl": "qcomm" if label in MODEL else label.partition("[")[0].split(":")[0],
                    "codec": label,
                    "label": label,
                    "pass": "fwd",
                    "size_bytes": size,
                    "status": "ok",
                    "busbw_GBps": 0.1 * scale * ratio,
                    "link_bytes": NOOP_BYTES / ratio * scale,
                    "unlimited_s": unlimited * scale,
                    "latency_s": 2 * unlimited * scale,
                    "speedup": ratio**0.5 if link else None,
                    "compression_ratio": ratio,
                }
            )
    codecs = [
        {"codec": c, "source": s, "status": "ok", "bits_per_element": b, "rms_rel_error": e}
        for c, s, b, e in CODECS
    ]
    meta = {"started": "2026-01-01T00:00:00", "backend": "gloo", "world_size": 2, "local": local}
    meta["link_gbps"] = None if link else 10.0
    emulated = {"spec": "1gbit", "rate_bps": 1e9} if link else None
    return {"meta": meta, "link": emulated, "codecs": codecs, "collectives": collectives}


def drawn(results: dict[str, Any]) -> Any:
    fig = plot.draw(results)
    fig.canvas.draw()  # the extents below are those of the drawn figure
    return fig


def overlaps(texts: list[Any]) -> list[tuple[str, str]]:
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts if t.get_visible()]
    return [(a, b) for (a, p), (b, q) in itertools.combinations(boxes, 2) if p.overlaps(q)]


def test_speedup_curves_are_named_at_their_right_end() -> None:
    fig = drawn(make_results())
    ax = fig.axes[0]
    texts = {t.get_text().removesuffix(" (over budget)"): t for t in ax.texts}
    curves = [line for line in ax.lines if len(line.get_xdata()) > 2]
    assert len(curves) == len(MODEL)
    for name in MODEL:
        label = texts[name]  # KeyError: a curve without its label
        # In its curve's colour, right of the right spine, by its curve's end.
        (curve,) = [c for c in curves if c.get_color() == label.get_color()]
        box = label.get_window_extent()
        assert ax.bbox.x1 <= box.x0 <= ax.bbox.x1 + 10
        end = ax.transData.transform((curve.get_xdata()[-1], curve.get_ydata()[-1]))
        assert abs(end[0] - ax.bbox.x1) < 1
        assert box.y0 - 60 < end[1] < box.y1 + 60  # spread, yet near its curve
    # No legend lists the curves: the speed-up panel's names the advice's
    # pick (and the measured dots); the only one with many entries is the
    # bandwidth row's, below the axes.
    for legend in fig.findobj(Legend):
        entries = [t.get_text() for t in legend.get_texts()]
        if legend.axes is ax:
            assert len(entries) <= 2 and any("the advice's pick" in e for e in entries)
        elif legend.axes is fig.axes[1]:
            assert any("error budget" in e for e in entries)
        else:
            assert "bus-bandwidth" in legend.get_title().get_text()
            box = legend.get_window_extent()
            assert not any(box.overlaps(a.get_tightbbox()) for a in fig.axes)


@pytest.mark.parametrize("link", [False, True], ids=["link-gbps", "emulated-link"])
def test_labels_of_the_first_row_do_not_overlap(link: bool) -> None:
    fig = drawn(make_results(link=link))
    speedup, error = fig.axes[:2]
    assert overlaps(speedup.texts) == []
    assert overlaps(error.texts) == []
    shown = [c for c, _, _, e in CODECS if e]
    assert sorted(t.get_text() for t in error.texts) == sorted(shown)
    for label in error.texts:  # each by its own point, inside the axes
        x, y = error.transData.transform(label.xy)
        box = label.get_window_extent()
        assert error.bbox.contains(box.x0, box.y0) and error.bbox.contains(box.x1, box.y1)
        assert box.x0 - 20 < x < box.x1 + 20 and box.y0 - 60 < y < box.y1 + 60
    if link:  # the measured dots are explained in the panel
        legend = speedup.get_legend()
        assert any("measured" in t.get_text() for t in legend.get_texts())


def test_the_overlap_check_sees_unplaced_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the placement, the labels of this run do overlap: the test
    # above can fail.
    monkeypatch.setattr(plot, "_spread_ends", lambda *args: None)
    monkeypatch.setattr(plot, "_place_labels", lambda *args: None)
    fig = drawn(make_results())
    assert overlaps(fig.axes[0].texts) != []
    assert ("int8", "fbgemm:int8") in overlaps(fig.axes[1].texts)


@pytest.mark.parametrize("ops", [1, 2, 3, 4])
def test_no_panel_is_empty_or_hidden(ops: int) -> None:
    fig = drawn(make_results(ops=ops))
    assert len(fig.axes) == 2 + ops
    width = fig.bbox.width
    for ax in fig.axes:
        assert ax.get_visible()
        assert ax.lines or ax.collections
    # Each row fills the width: nothing left blank at either end.
    for row in (fig.axes[:2], fig.axes[2:]):
        assert min(ax.bbox.x0 for ax in row) < 0.1 * width
        assert max(ax.bbox.x1 for ax in row) > 0.9 * width
        for a, b in itertools.combinations(row, 2):
            assert not a.bbox.overlaps(b.bbox)


def test_the_cpu_limit_is_drawn_and_named() -> None:
    fig = drawn(make_results())
    ax = fig.axes[0]
    lines = [line for line in ax.lines if list(line.get_xdata()) == [CPU_GBIT, CPU_GBIT]]
    assert len(lines) == 1
    (name,) = [t for t in ax.texts if t.get_text().startswith("this CPU")]
    assert f"{CPU_GBIT:.3g} Gbit/s" in name.get_text()
    assert "not the link" in name.get_text()
    # By its line.
    x = ax.transData.transform((CPU_GBIT, 1.0))[0]
    box = name.get_window_extent()
    assert min(abs(box.x0 - x), abs(box.x1 - x)) < 10


def test_a_real_cluster_has_no_cpu_limit() -> None:
    # Its times are the real link's: no time without a link limit to model.
    ax = drawn(make_results(local=False)).axes[0]
    assert not [t for t in ax.texts if "CPU" in t.get_text()]
    assert len(ax.texts) == len(MODEL) + 1  # the curves' names and the user's link


def _budgeted(budget: float) -> dict[str, Any]:
    # A run whose advice kept codecs under an RMS budget and picked int8 at
    # 1 Gbit/s and noop at 100.
    results = make_results()
    op = OPS[0]
    results["advice"] = {
        "max_rms_error": budget,
        "rates": [
            {"gbit_per_s": rate, "collectives": [record_json(Advice(op, pick, pick, 1, 1, 0, 0))]}
            for rate, pick in ((1.0, "int8"), (100.0, "noop"))
        ],
    }
    return results


def test_the_plot_draws_the_budget_and_the_pick() -> None:
    fig = drawn(_budgeted(0.03))
    speedup, error = fig.axes[:2]
    # The budget: a horizontal line at 0.03 on the error panel, named.
    flat = [line for line in error.lines if list(line.get_ydata()) == [0.03, 0.03]]
    assert len(flat) == 1 and "error budget" in flat[0].get_label()
    # The pick: a star on int8's curve at 1 Gbit/s (and noop's at 100), named.
    stars = [
        c.get_offsets()[0].tolist()
        for c in speedup.collections
        if len(c.get_offsets()) == 1 and c.get_paths() and c.get_sizes()[0] == 220
    ]
    assert sorted(x for x, _ in stars) == [1.0, 100.0]
    legend = [t.get_text() for t in speedup.get_legend().get_texts()]
    assert any("int8 at 1, noop at 100" in text for text in legend)
    picked = [c for c in error.collections if len(c.get_sizes()) and c.get_sizes()[0] == 260]
    # int8's point (noop, exact, has none on a log scale).
    assert [c.get_offsets()[0].tolist() for c in picked] == [[10.0, 0.0046]]
    # Over the budget (mx4, int4, fp8_e4m3_tensor, fp8_e5m2): faint, and said so.
    over = {t.get_text() for t in speedup.texts if t.get_alpha() == plot._FADED}
    assert over == {f"{c} (over budget)" for c in ("mx4", "int4", "fp8_e4m3_tensor", "fp8_e5m2")}


def test_every_curve_stays_visible_where_curves_coincide() -> None:
    # int8 and fp8_e4m3 (same ratio, cost within 1%), fp16 and bf16: the
    # later of each pair is drawn in another line style, on top.
    fig = drawn(make_results())
    ax = fig.axes[0]
    curves = [line for line in ax.lines if len(line.get_xdata()) > 2]
    styles = {}
    for line in curves:
        (name,) = [t.get_text() for t in ax.texts if t.get_color() == line.get_color()]
        styles[name.removesuffix(" (over budget)")] = line.get_linestyle()
    assert styles["bf16"] != styles["fp16"] and styles["int8"] != styles["fp8_e4m3"]
    # In the error panel qcomm's point is a ring and fbgemm's a cross inside it.
    error = fig.axes[1]
    rings = [c for c in error.collections if len(c.get_facecolors()) == 0]
    assert rings, "qcomm's points are not hollow"
