r"""
The report of ``qcomm bench``: the terminal tables, the JSON file with every
figure, and the plot. How to read them: :doc:`/bench`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from qcomm._table import format_table
from qcomm.benchmark.advice import is_noise, speedup_table
from qcomm.benchmark.options import OP_TITLES, LossGap, format_size
from qcomm.benchmark.plot import write_plot
from qcomm.benchmark.results import (
    BenchMeta,
    DlrmTrain,
    LinkFigures,
    LinkRate,
    MlpModel,
    MlpTrain,
    Results,
    Roofline,
    RunAdvice,
    RunMeta,
    TrainPick,
    codec_rows,
    points,
    record_json,
    train_rows,
)
from qcomm.benchmark.rows import CodecRow, DlrmRow, MlpRow, Point, TrainRow, units
from qcomm.benchmark.train_adaptive import format_settled

__all__ = [
    "TRAIN_MLP_UNITS",
    "TRAIN_UNITS",
    "UNITS",
    "format_report",
    "format_train_report",
    "jsonable",
    "write_report",
]

# What the JSON's keys mean, written into the file itself: the rows' from
# their fields, and those of the rest of the file.
UNITS = {
    **units(CodecRow, Point),
    "link.*_GBps": "float32 bytes per second the emulated link carried between ranks 0 and 1, "
    "one way, and each way when both send at once, 1e9 bytes/s",
    "meta.data_scale": "the codecs' and collectives' inputs are standard normal times this",
    "advice": "the answer: the error budget (max_rms_error), and per link rate (gbit_per_s) "
    "the registry string and per collective the pair, its spec, its expected speed-ups "
    "(forward and backward together, and forward) and forward errors, whether the speed-ups "
    "were measured on that link in this run or predicted by the model, the faster codecs the "
    "budget left out, those as fast within the run's spread with more error (close), those "
    "whose figure exceeded their compression ratio (noise), and the training example's "
    "held-out loss gap (loss_gap)",
}

# The same for a --train run (its rows: train.series), and --train-model mlp.
TRAIN_UNITS = units(DlrmRow)
TRAIN_MLP_UNITS = units(MlpRow)


def jsonable(value: Any) -> Any:
    r"""
    jsonable(value: Any) -> Any

    A copy with every row turned into its dict (:func:`~qcomm.benchmark.rows.to_json`)
    (and every record of :mod:`~qcomm.benchmark.results` into its JSON dict)
    and every non-finite float replaced by ``None``: JSON has no infinity or
    NaN (an exact codec's SQNR is infinite).

    Args:
        value (Any): nested dicts, lists, rows, records and scalars.

    Examples::

        >>> jsonable({"sqnr_db": float("inf"), "x": [1.0, float("nan")]})
        {'sqnr_db': None, 'x': [1.0, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (CodecRow, Point, TrainRow)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return jsonable(record_json(value))
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


def _codec_table(results: Results) -> str:
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
        "spread",
    ]
    rows = []
    for r in codec_rows(results):
        if r.status != "ok":
            rows.append([r.codec, "failed", *[""] * (len(header) - 2)])
            continue
        rows.append(
            [
                r.codec,
                _num(r.bits_per_element),
                _num(r.compression_ratio),
                _num(r.encode_GBps),
                _num(r.encode_roofline_fraction, 2),
                _num(r.decode_GBps),
                _num(r.decode_roofline_fraction, 2),
                _num(r.max_rel_error, 2),
                _num(r.rms_rel_error, 2),
                _num(r.sqnr_db),
                _num(r.break_even_GBps),
                f"{100 * (r.spread or 0.0):.0f}%",
            ]
        )
    return format_table(header, rows, text_columns=1)


def _collective_tables(results: Results, passes: str) -> list[str]:
    tables = []
    every = points(results)
    sizes = sorted({p.size_bytes for p in every})
    for op in dict.fromkeys(p.op for p in every):
        these = [p for p in every if p.op == op and p.passes == passes]
        if not these:
            continue
        labels = list(dict.fromkeys(p.label for p in these))
        cells = {(p.label, p.size_bytes): p for p in these}
        rows = []
        for label in labels:
            row = [label]
            for size in sizes:
                p = cells.get((label, size))
                if p is None:
                    row.append("")
                elif p.status != "ok":
                    row.append("failed")
                else:
                    row.append(f"{_num(p.busbw_GBps)} {_speedup(p)}")
            rows.append(row)
        title = OP_TITLES.get(op, op) + ("" if passes == "fwd" else ", forward+backward")
        header = [title, *[format_size(s) for s in sizes]]
        tables.append(format_table(header, rows, text_columns=1))
    return tables


def _speedup(p: Point) -> str:
    # A codec's speed-up over the no-op codec (or TorchRec's over TorchRec
    # without codec) above its compression ratio is noise; the bare series
    # compare transports, which no ratio bounds.
    if p.speedup is None:
        return "-"
    if p.impl != "bare" and is_noise(p.speedup, p.compression_ratio):
        return "noise"
    return f"x{p.speedup:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


def _times(values: list[float | None], digits: int = 3) -> str:
    return "-" if values[0] is None else f"{values[0]:.{digits}g}"


def _detail_tables(results: Results) -> list[str]:
    # The largest size of each collective, every figure of a row: time with
    # its spread, speed-up and what the compression ratio promises, against
    # the link's bound and against TorchRec.
    every = points(results)
    if not every:
        return []
    size = max(p.size_bytes for p in every)
    linked = any(p.link_bound_s for p in every)
    modelled = any(p.predicted_s for p in every)
    header = ["series", "pass", "ms", "min-max ms", "speed-up", "ratio"]
    header += ["bound ms", "x bound"] if linked else []
    header += ["unlimited ms", "predicted ms", "meas/pred"] if modelled else []
    header += ["pays below Gbit/s", "vs TorchRec"]
    tables = []
    for op in dict.fromkeys(p.op for p in every):
        rows = []
        for p in every:
            if p.op != op or p.size_bytes != size:
                continue
            if p.status != "ok":
                rows.append([p.label, p.passes, "failed", *[""] * (len(header) - 3)])
                continue
            row = [
                p.label,
                p.passes,
                _ms(p.latency_s),
                f"{_ms(p.latency_min_s)}-{_ms(p.latency_max_s)}",
                _speedup(p),
                _num(p.compression_ratio),
            ]
            if linked:
                row += [_ms(p.link_bound_s), _times([p.x_link_bound])]
            if modelled:
                row += [
                    _ms(p.unlimited_s),
                    _ms(p.predicted_s),
                    _times([p.measured_over_predicted]),
                ]
            row.append("always" if p.pays_at_every_rate else _gbit(p.break_even_gbit_per_s))
            row.append("-" if p.vs_torchrec is None else f"x{p.vs_torchrec:.2f}")
            rows.append(row)
        title = f"{OP_TITLES.get(op, op)}, {format_size(size)} per rank"
        tables.append(title + ":\n" + format_table(header, rows, text_columns=2))
    return tables


def _against_pytorch(results: Results) -> list[str]:
    # qcomm's DDP hook against PyTorch's own hooks, at the largest size of
    # the all-reduce, all from this run.
    ours = [
        p
        for p in points(results)
        if p.op == "all_reduce" and p.impl == "qcomm" and p.status == "ok"
    ]
    if not ours:
        return []
    size = max(p.size_bytes for p in ours)
    lines = [
        f"All-reduce, {format_size(size)} per rank: qcomm's DDP hook against PyTorch's, "
        f"same run (their time over qcomm's):"
    ]
    for p in ours:
        if p.size_bytes == size and p.passes == "fwd":
            ratios = [p.vs_allreduce_hook, p.vs_fp16_compress_hook]
            shown = ["-" if r is None else f"x{r:.2f}" for r in ratios]
            lines.append(
                f"  {p.label}: {_ms(p.latency_s)} ms; {shown[0]} against allreduce_hook "
                f"(DDP's default), {shown[1]} against fp16_compress_hook"
            )
    return lines


def _gbit(value: float | None) -> str:
    if value is None:
        return "-"
    return "never" if value == 0 else _num(value)


def _gap_text(gap: LossGap | None) -> str:
    if not gap:
        return ""
    half, value = gap.ci95, gap.held_out_gap
    interval = f" [{value - half:+.4f}, {value + half:+.4f}]" if half is not None else ""
    significant = "significant" if gap.significant else "not significant"
    return (
        f"; training loss gap {value:+.4f}{interval}, {significant} "
        f"(training example, {gap.config})"
    )


def _advice(results: Results) -> list[str]:
    # The advice is the run's (advice.py made it): a run without one has none to show.
    advice = results.advice
    if advice is None or not any(rate.collectives for rate in advice.rates):
        return []
    real = results.meta.local is False
    lines = [
        f"Advice (qcomm's codecs; {advice.budget}; from this run's figures, see docs/bench.rst):"
    ]
    if advice.training_results:
        lines.append(f"  (training loss gaps from {advice.training_results})")
    for rate in advice.rates:
        chosen = rate.collectives
        if not chosen:
            continue
        gbit = rate.gbit_per_s
        if rate.provisional:
            lines.append(
                f"  PROVISIONAL at {gbit:g} Gbit/s: faster candidates are within this "
                f"run's spread between rounds (x{rate.spread:.2f}) of a pick, so its "
                f"figures cannot separate the candidates; more --rounds (or a run "
                f"without --quick) can pick otherwise"
            )
        if real:
            lines.append("  on this cluster's link (measured in this run):")
        elif chosen[0].measured:
            lines.append(f"  on the emulated {gbit:g} Gbit/s link (measured in this run):")
        else:
            lines.append(
                f"  expected on a link of {gbit:g} Gbit/s each way (the model's prediction):"
            )
        for a in chosen:
            lines.append(
                f"    {OP_TITLES.get(a.op, a.op)}: {a.pair}, x{a.speedup:.2f} forward "
                f"and backward (forward x{a.forward_speedup:.2f}); forward error RMS "
                f"{_num(a.rms_rel_error, 2)} of the data's RMS, largest "
                f"{_num(a.max_rel_error, 2)} of its max|x|{_gap_text(a.loss_gap)}"
            )
            if a.left_out:
                lines.append(f"      left out by the error budget: {', '.join(a.left_out)}")
            if a.close:
                lines.append(
                    f"      faster, but not by more than this run's spread between rounds "
                    f"(x{a.spread:.2f}) and with more error: {', '.join(a.close)}"
                )
            if a.noise:
                lines.append(
                    f"      not used, their figures exceed what their bytes allow (noise): "
                    f"{', '.join(a.noise)}"
                )
        spec = rate.registry
        lines.append(f"    QCOMM_CODECS='{spec}'  or  qcomm.build_registry(\"{spec}\")")
        if real:
            break
    # The speed-ups it chose from first, the picks and the string to paste last.
    return _speedup_table(results, advice) + lines


def _speedup_table(results: Results, advice: RunAdvice) -> list[str]:
    table = speedup_table(results, [rate.gbit_per_s for rate in advice.rates])
    if table is None:
        return []
    header = ["codec", *[f"{gbit:g} Gbit/s" for gbit in table.rates]]
    cells = [
        [label, *["noise" if f.noise else f"x{f.value:.2f}" for f in figures]]
        for label, figures in table.rows.items()
    ]
    how = "measured" if table.measured else "expected"
    op = table.op
    return [
        f"Speed-up over noop, {OP_TITLES.get(op, op)}, {how} ('noise': above the codec's "
        f"compression ratio; the plot has every rate):",
        "  " + format_table(header, cells, text_columns=1).replace("\n", "\n  "),
        "",
    ]


def _warnings(results: Results) -> list[str]:
    meta = results.bench_meta
    out = []
    load, cores = meta.load_before, meta.cpu_count or 1
    if load and load[0] > 0.5 * cores:
        out.append(
            f"Warning: the machine was busy before the run (load {load[0]:.2f} on {cores} "
            f"cores): timings are slower and noisier than on an idle one."
        )
    wide = [r.codec for r in codec_rows(results) if (r.spread or 0.0) > SPREAD_WARNING]
    wide += [
        f"{p.label} {OP_TITLES.get(p.op, p.op)} {format_size(p.size_bytes)}"
        for p in points(results)
        if p.status == "ok" and (p.spread or 0.0) > SPREAD_WARNING
    ]
    if wide:
        shown = ", ".join(wide[:6]) + (f" and {len(wide) - 6} more" if len(wide) > 6 else "")
        out.append(
            f"Warning: {len(wide)} figure(s) spread over more than "
            f"{100 * SPREAD_WARNING:.0f}% between repetitions ({shown}): the machine was "
            f"busy; rerun, or give --budget and --rounds more time."
        )
    return out


#: relative spread (interquartile range over median) above which a figure is flagged
SPREAD_WARNING = 0.2


def _link_line(link: LinkRate | None) -> list[str]:
    if not isinstance(link, LinkFigures):
        return []
    rate = link.rate_bps or 0.0
    measured = (
        f"measured {_num(link.one_way_GBps)} GB/s one way, "
        f"{_num(link.both_ways_GBps)} GB/s each way with both sending"
        if link.one_way_GBps
        else f"not measured ({_first_line(link.error)})"
    )
    if link.same_host_both_ways_GBps:
        measured += f"; inside a host {_num(link.same_host_both_ways_GBps)} GB/s each way"
    return [
        f"Emulated link: {link.spec} each way ({rate / 8 / 1e9:.3g} GB/s), {measured} "
        f"({format_size(link.bytes or 0)} of float32 per transfer).",
    ]


def _ranks(meta: BenchMeta) -> str:
    per_host, world = meta.ranks_per_host, meta.world_size or 0
    if not per_host:
        return f"{world} ranks"
    return f"{world} ranks as {world // per_host} hosts of {per_host}"


def _by_host_note(results: Results) -> list[str]:
    # What a row of codecs by host is of: said once, under the tables.
    shares = [r.crossing_share for r in codec_rows(results) if r.crossing_share is not None]
    if not shares:
        return []
    per_host = results.bench_meta.ranks_per_host or 1
    hierarchical = (
        f" (their all-reduce is hierarchical: {per_host} times fewer bytes between hosts, "
        f"besides the codec's)"
        if per_host > 1
        else ""
    )
    return [
        f"Codecs by host (same_host=...+other_host=..., {per_host} rank(s) per host): a rank "
        f"sends {100 * shares[0]:.0f}% of its elements to other hosts, through the other_host "
        f"codec, the rest through the same_host one; their codec row's times and errors are of "
        f"all of them, its wire figures (bits/el, ratio) of what crosses hosts; a collective's "
        f"ratio is noop's bytes between hosts over theirs{hierarchical}."
    ]


def format_report(results: Results | Mapping[str, Any]) -> str:
    r"""
    format_report(results: Results | Mapping[str, Any]) -> str

    The terminal report: the codec table, the collectives' tables, the
    legend, the machine's load, warnings, the failures with their reasons,
    and last the advice: the results' own (:func:`~qcomm.benchmark.advice.run_advice`
    made it), none where they have none.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or the JSON's content.
    """
    results = Results.of(results)
    meta = results.bench_meta
    roof = results.roofline or Roofline()
    lines = [
        f"qcomm bench: {_ranks(meta)}, {meta.backend} on {meta.device}, "
        f"{meta.threads_per_rank} thread(s) per rank, {meta.duration_s or 0.0:.0f} s",
        *_link_line(results.link),
        "",
        f"Codecs on {format_size(roof.bytes or 0)} of float32 per rank "
        f"(memory copy: {_num(roof.copy_GBps)} GB/s; 'x copy' = fraction of it; "
        f"each error relative to the data's own: rms rel = RMS error / RMS of x, "
        f"max rel = largest error / max|x|):",
        _codec_table(results),
    ]
    for table in _collective_tables(results, "fwd") + _collective_tables(results, "fwd+bwd"):
        lines += ["", table]
    for table in _detail_tables(results):
        lines += ["", table]
    against = _against_pytorch(results)
    if against:
        lines += ["", *against]
    lines += [
        "",
        "Collectives: bus bandwidth in GB/s of float32 (nccl-tests' busbw) and speed-up "
        "over the no-op codec (TorchRec: over TorchRec without codec; bare: over p2p); "
        "times are the median round, with the fastest and slowest; "
        "'ratio' is the codec's compression ratio, the speed-up the wire alone would give "
        "('noise' where a measured speed-up exceeds it by over 5%: the run's noise, not used); "
        "'x bound' is the time over the link's bound for that many wire bytes; "
        "'unlimited' is the time with no link limit (loopback, or the emulated link with its "
        "rate limit lifted), 'predicted' the model's time at the link's rate (see docs/bench.rst), "
        "'pays below' the link rate under which the codec beats noop by the model; "
        "'vs TorchRec' is TorchRec's time with fbgemm's codec of the format over qcomm's.",
        "noop's encode and decode return their input: their throughput is the cost of a call.",
        *_by_host_note(results),
        *_load_line(meta),
    ]
    lines += _warnings(results)
    failures = [(r.codec, r.error) for r in codec_rows(results) if r.status != "ok"]
    # One line per collective and reason, listing the sizes it failed at.
    failed_sizes: dict[tuple[str, str], list[str]] = {}
    for p in points(results):
        if p.status != "ok":
            key = (f"{p.label} {OP_TITLES.get(p.op, p.op)}", _first_line(p.error))
            failed_sizes.setdefault(key, []).append(format_size(p.size_bytes))
    failures += [
        (f"{name} ({', '.join(sizes)})", error) for (name, error), sizes in failed_sizes.items()
    ]
    reasons = dataclasses.asdict(results.unavailable) if results.unavailable else {}
    unavailable = [(k, v) for k, v in reasons.items() if v]
    if failures or unavailable:
        lines += ["", "Failed or unavailable:"]
        lines += [f"  {name}: {_first_line(error)}" for name, error in [*unavailable, *failures]]
    # The answer comes last, where the eye lands when the run ends.
    advice = _advice(results)
    if advice:
        lines += ["", *advice]
    return "\n".join(lines)


def _versus(row: TrainRow) -> float | None:
    # The speed-up over the row's counterpart: TorchRec's codecs, or PyTorch's fp16 hook.
    if isinstance(row, MlpRow):
        return row.vs_fp16_hook
    return row.vs_torchrec if isinstance(row, DlrmRow) else None


def _load_line(meta: RunMeta) -> list[str]:
    # The machine's load before and after the run, where the system says.
    load = (getattr(meta, "load_before", None), getattr(meta, "load_after", None))
    if not (load[0] and load[1]):
        return []
    return [
        f"Machine load (1-minute average) {load[0][0]:.2f} before, {load[1][0]:.2f} after, "
        f"on {meta.cpu_count} cores."
    ]


def _train_what(results: Results, train: DlrmTrain | MlpTrain) -> list[str]:
    # The run's first lines: ranks, where they talk, and the model.
    meta, model, link = results.meta, train.model, results.link
    where = f"an emulated {link.spec} link each way" if link else "loopback"
    if not meta.local:
        where = "the launcher's network"
    timed = sum(model.steps_per_round)
    steps = (
        f"{model.steps} steps per series: {model.warm_up_steps} warm-up, {timed} timed "
        f"in {len(model.steps_per_round)} interleaved rounds."
    )
    if isinstance(model, MlpModel):
        under = (
            "FSDP2 (fully_shard per Linear)" if model.name == "fsdp" else "DistributedDataParallel"
        )
        what = (
            f"MLP under {under}: {model.layers} hidden layers of "
            f"{model.width} (Linear+ReLU), {model.parameters:,} parameters "
            f"({model.gradient_bytes / 2**20:.3g} MiB of float32 gradients a step), batch "
            f"{model.batch_per_rank} per rank; {steps}"
        )
    else:
        loop = (
            "TorchRec's TrainPipelineSparseDist"
            if model.loop == "pipeline"
            else "a plain loop (forward, backward, optimizer)"
        )
        shardings = f"{model.table_wise} table-wise, {model.row_wise} row-wise"
        if model.column_wise:
            shardings += f", {model.column_wise} column-wise"
        what = (
            f"TorchRec DLRM: {model.tables} tables of {model.rows} rows x {model.dim} "
            f"({shardings}), batch "
            f"{model.batch_per_rank} per rank, trained in {loop}; {steps}"
        )
    return [
        f"qcomm bench --train: {meta.world_size} ranks, {meta.backend} on "
        f"{meta.device} over {where}, {meta.threads_per_rank} thread(s) per rank, "
        f"{meta.duration_s or 0.0:.0f} s",
        what,
        "",
    ]


def _train_table(rows: list[DlrmRow] | list[MlpRow], mlp: bool, fsdp: bool = False) -> str:
    baseline, versus = ("default", "x fp16 hook") if mlp else ("fp32", "x TorchRec")
    if fsdp:
        baseline, versus = "float32", "x bf16"
    header = ["series", "step ms", "min-max ms", "spread", f"x {baseline}", versus]
    header += ["comm share", "loss", f"gap to {baseline}", "graph breaks"]
    compiled = any(isinstance(r, DlrmRow) and r.compile for r in rows)
    if compiled:
        header.append("x eager")
    table = []
    for r in rows:
        if r.status != "ok":
            table.append([r.label, r.status, *[""] * (len(header) - 2)])
            continue
        vs = _versus(r)
        eager = r.vs_eager if isinstance(r, DlrmRow) else None
        table.append(
            [
                r.label,
                _ms(r.step_s),
                f"{_ms(r.step_min_s)}-{_ms(r.step_max_s)}",
                f"{100 * (r.spread or 0.0):.0f}%",
                "-" if r.speedup is None else f"x{r.speedup:.2f}",
                "-" if vs is None else f"x{vs:.2f}",
                "-" if r.comm_share is None else f"{100 * r.comm_share:.0f}%",
                "-" if r.loss is None else f"{r.loss:.5f}",
                "-" if r.loss_gap is None else f"{r.loss_gap:+.2g}",
                "-" if r.graph_breaks is None else str(r.graph_breaks),
                *([] if not compiled else ["-" if eager is None else f"x{eager:.2f}"]),
            ]
        )
    return format_table(header, table, text_columns=1)


def _train_legend(train: DlrmTrain | MlpTrain) -> list[str]:
    if isinstance(train, MlpTrain) and train.model.name == "fsdp":
        return [
            "step: the median round of the slowest rank's time per step (forward, backward, "
            "SGD); 'x float32': FSDP float32's step over the series'; 'x bf16': FSDP bf16 mixed "
            "precision's over the series'; 'comm share': 1 - (one rank alone, no collective) / "
            "step; loss: the last step's MSE, mean over ranks, every series from the same "
            "weights on the same batches."
        ]
    if isinstance(train, MlpTrain):
        return [
            "step: the median round of the slowest rank's time per step (forward, backward, "
            "SGD); 'x default': the default hook's step over the series'; 'x fp16 hook': "
            "fp16_compress_hook's over the series'; 'comm share': 1 - (one rank alone, no "
            "collective) / step; loss: the last step's MSE, mean over ranks, every series from "
            "the same weights on the same batches. qcomm's hook overlaps the backward pass; "
            "its synchronous row waits for every bucket, which shows what the overlap buys."
        ]
    advice = train.advice or TrainPick()
    rate = advice.gbit_per_s
    for_link = "loopback" if rate is None else f"a {rate:g} Gbit/s link"
    lines = [
        f"Advice's pick for {for_link} (a rule, see docs/bench.rst): "
        f"{advice.registry or 'no codec'}.",
        "step: the median round of the slowest rank's time per step (forward, backward, "
        "optimizers); 'x fp32': fp32's step over the series'; 'x TorchRec': TorchRec's "
        "codecs with the same all-to-all pair over the series'; 'comm share': 1 - (one "
        "rank alone, no collective) / step; loss: the last step's, mean over ranks, every "
        "series from the same weights on the same batches; 'graph breaks': torch.compile's "
        "in the series' steps.",
    ]
    if any(r.compile for r in train.series):
        backend = next(r.compile for r in train.series if r.compile)
        lines.append(
            f"', compiled': the dense part (dense arch, interaction, over arch) under "
            f"torch.compile ({backend}), the sharded embeddings eager; the warm-up steps "
            f"compile; 'x eager': the same series' eager step over the compiled one's."
        )
    if train.model.loop == "pipeline":
        lines.append(
            "Every series but the one-rank reference (no sharded module to pipeline: a "
            "plain loop) runs in TorchRec's pipeline."
        )
    if not train.reduce_scatter_on_qcomm:
        lines.append(
            f"TorchRec's reduce-scatter with a qcomm codec ran on TorchRec's transport: "
            f"{_first_line(train.reduce_scatter_refused)}."
        )
    return lines


def format_train_report(results: Results | Mapping[str, Any]) -> str:
    r"""
    format_train_report(results: Results | Mapping[str, Any]) -> str

    The terminal report of ``qcomm bench --train``: one row per series,
    the advice's pick (DLRM), what the figures mean, and the failures.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or the JSON's content.

    Raises:
        ValueError: if ``results`` are not of a ``--train`` run.
    """
    results = Results.of(results)
    train = results.train
    if train is None:
        raise ValueError("format_train_report: expected the results of a --train run")
    rows = train_rows(results)
    lines = _train_what(results, train)
    fsdp = isinstance(train, MlpTrain) and train.model.name == "fsdp"
    lines += [_train_table(rows, isinstance(train, MlpTrain), fsdp), ""]
    if isinstance(train, DlrmTrain):
        lines += format_settled(train.series)
    lines += _train_legend(train)
    lines += _load_line(results.meta)
    wide = [r.label for r in rows if r.status == "ok" and (r.spread or 0.0) > SPREAD_WARNING]
    if wide:
        lines.append(
            f"Warning: {', '.join(wide)} spread over more than {100 * SPREAD_WARNING:.0f}% "
            f"between rounds: the machine was busy; rerun, or give --rounds and "
            f"--train-steps more."
        )
    failures = [r for r in rows if r.status != "ok"]
    if failures:
        lines += ["", "Failed or skipped:"]
        lines += [f"  {r.label}: {_first_line(r.error)}" for r in failures]
    return "\n".join(lines)


def _first_line(text: str | None, width: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "unknown error"
    return line if len(line) <= width else line[: width - 3] + "..."


def write_report(
    results: Results | Mapping[str, Any],
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
) -> None:
    r"""
    write_report(results: Results | Mapping[str, Any], *, json_path: str | None = None, plot_path: str | None = None) -> None

    Writes the JSON and the plot if asked, then prints the report on stdout,
    last, so that the run ends with its advice.
    Should the JSON file fail to be written (its folder removed since the
    run started, a full disk), the figures go to a temporary file named on
    stderr rather than being lost.

    Args:
        results (Results | Mapping[str, Any]): the run's figures.
        json_path (str, optional): where to write them all. Default: ``None``.
        plot_path (str, optional): where to draw the PNG. Default: ``None``.
    """
    results = Results.of(results)
    train = results.train is not None
    report = (format_train_report if train else format_report)(results)
    try:
        if json_path:
            _write_json(results, json_path, train)
        if plot_path:
            write_plot(results, plot_path)
            print(f"plot written to {plot_path}", file=sys.stderr)
    finally:
        # The report ends with the answer: nothing of ours is printed after it.
        sys.stderr.flush()
        print(report, flush=True)


def _write_json(results: Results, json_path: str, train: bool) -> None:
    units = UNITS
    if train:
        units = TRAIN_MLP_UNITS if results.mlp else TRAIN_UNITS
    text = json.dumps(jsonable({**results.to_json(), "units": units}), indent=2, allow_nan=False)
    try:
        with open(json_path, "w") as f:
            f.write(text + "\n")
        print(f"figures written to {json_path}", file=sys.stderr)
    except OSError as err:
        fd, fallback = tempfile.mkstemp(prefix="qcomm-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        print(
            f"could not write {json_path}: {err.strerror or err}; "
            f"figures written to {fallback} instead",
            file=sys.stderr,
        )
