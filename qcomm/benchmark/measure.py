r"""
The measurements of ``qcomm bench``, step by step on every rank
(:func:`run_rank`), and the figures derived from them.

After each step the ranks agree over the control group on whether it failed:
a codec that raises is a failed row, and the run goes on. Order: the
memory-copy roofline, each codec on its own, then for each size and
collective each implementation and codec, ``noop`` first as the baseline.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import qcomm
from qcomm.benchmark.advice import advice_json
from qcomm.benchmark.candidates import FBGEMM_FORMATS, Candidate, load_candidates, measure_codec
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.metrics import (
    GB,
    TCP_EFFICIENCY,
    algorithm_bandwidth,
    break_even_bandwidth,
    bus_bandwidth,
    collective_break_even,
    error_stats,
    predicted_time,
    relative_spread,
)
from qcomm.benchmark.options import OP_TITLES, BenchConfig, format_size
from qcomm.benchmark.report import write_report
from qcomm.benchmark.series import (
    BARE,
    Case,
    Series,
    add_pytorch_ratios,
    all_reduce_series,
    bare_series,
    base_input,
    make_case,
    qcomm_collective,
    run_series,
    torchrec_all_to_all,
)
from qcomm.benchmark.session import EXIT_CODEC_FAILED, Session
from qcomm.benchmark.timing import calls_for_budget, synchronize, time_calls
from qcomm.ops import BenchOp, CommOp, DenseOp
from qcomm.types import QuantizedCommCodecs, codec_info

__all__ = ["run_rank"]

_Outcome = tuple[list[Any] | None, str | None]


class _Progress:
    # tqdm on rank 0's stderr; without tqdm, no bar.
    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc="qcomm bench", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_ECHO = re.compile(r"timed out|\brank \d+ failed", re.IGNORECASE)


def _failure(gathered: list[tuple[bool, Any]]) -> str | None:
    messages = [(rank, str(msg)) for rank, (ok, msg) in enumerate(gathered) if not ok]
    if not messages:
        return None
    if len({msg for _, msg in messages}) == 1 and len(messages) == len(gathered):
        return messages[0][1]
    # A rank that fails makes its peers time out in the collective, or raise
    # naming it: the cause first, its echoes after it.
    messages.sort(key=lambda item: bool(_ECHO.search(item[1])))
    return "; ".join(f"rank {rank}: {msg}" for rank, msg in messages)


def _attempt(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception as err:  # reported as a failed row; the run goes on
        return False, f"{type(err).__name__}: {err}"


def _agreed(session: Session, fn: Callable[[], Any]) -> _Outcome:
    gathered = session.gather(_attempt(fn))
    problem = _failure(gathered)
    return (None, problem) if problem else ([value for _, value in gathered], None)


def _agreed_here(session: Session, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    # Like _agreed, for a value only this rank needs (e.g. a function).
    ok, value = _attempt(fn)
    problem = _failure(session.gather((ok, None if ok else value)))
    return (None, problem) if problem else (value, None)


def _agree_on_loads(session: Session, candidates: list[Candidate]) -> None:
    for candidate in candidates:
        devices = codec_info(candidate.codec).devices if candidate.codec is not None else ()
        if candidate.codec is not None and session.device.type not in devices:
            candidate.codec = None
            candidate.error = (
                f"the codec runs on {', '.join(devices)} (CodecInfo.devices), "
                f"this run is on {session.device.type}"
            )
    # A codec that failed to build on any rank must be left out on all of them.
    gathered = session.gather([c.error for c in candidates])
    if len({len(errors) for errors in gathered}) != 1:
        raise RuntimeError(f"ranks disagree on the codecs to measure: {gathered}")
    for i, candidate in enumerate(candidates):
        errors = [(rank, errors[i]) for rank, errors in enumerate(gathered) if errors[i]]
        if errors and candidate.codec is not None:
            candidate.codec = None
            candidate.error = "; ".join(f"rank {rank}: {msg}" for rank, msg in errors)


def _codec_row(
    candidate: Candidate, outcome: _Outcome, n: int, copy_s: float | None
) -> dict[str, Any]:
    row: dict[str, Any] = {"codec": candidate.label, "source": candidate.source}
    # Whether the backend may sum its wire: the reduce-scatter's advice needs it.
    row["summable"] = codec_info(candidate.codec).summable if candidate.codec is not None else None
    figures, problem = outcome
    if figures is None:
        return {**row, "status": "failed", "error": problem}
    first = figures[0]
    encode_s = max(f["encode_s"] for f in figures)  # the slowest rank sets the pace
    decode_s = max(f["decode_s"] for f in figures)
    logical = 4 * n
    wire = first["wire_bytes"]
    return {
        **row,
        "status": "ok",
        "error": None,
        "elements": n,
        "wire_dtype": first["wire_dtype"],
        "wire_elements": first["wire_elements"],
        "calc_quantized_size": first["calc_quantized_size"],
        "wire_bytes_per_element": wire / n,
        "bits_per_element": 8 * wire / n,
        "declared_bits_per_element": first["declared_bits_per_element"],
        "compression_ratio": logical / wire,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "encode_GBps": logical / encode_s / GB,
        "decode_GBps": logical / decode_s / GB,
        # The copy moves the same float32 bytes, so the time ratio is the
        # throughput ratio.
        "encode_roofline_fraction": copy_s / encode_s if copy_s else None,
        "decode_roofline_fraction": copy_s / decode_s if copy_s else None,
        "max_rel_error": max(f["max_rel_error"] for f in figures),
        "rms_rel_error": max(f["rms_rel_error"] for f in figures),
        "sqnr_db": min(f["sqnr_db"] for f in figures),
        "encode_samples_s": [f["encode_samples_s"] for f in figures],
        "decode_samples_s": [f["decode_samples_s"] for f in figures],
        "spread": max(
            relative_spread(f[key])
            for f in figures
            for key in ("encode_samples_s", "decode_samples_s")
        ),
        "break_even_GBps": break_even_bandwidth(wire, logical, encode_s, decode_s) / GB,
    }


def _build_series(
    config: BenchConfig, session: Session, candidates: list[Candidate]
) -> tuple[dict[BenchOp, list[Series]], str | None]:
    qcomm_codecs = [c for c in candidates if c.source == "qcomm"]
    fbgemm_codecs = [c for c in candidates if c.source == "fbgemm"]
    torchrec_reason: str | None = None
    torchrec_fn: Callable[..., Any] | None = None
    if config.fbgemm and CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL in config.comm_ops():
        torchrec_fn, problem = _agreed_here(session, torchrec_all_to_all)
        torchrec_reason = f"TorchRec is not importable: {problem}" if problem else None
    series: dict[BenchOp, list[Series]] = {}
    for op in config.comm_ops():
        if op is DenseOp.ALL_REDUCE:
            series[op] = all_reduce_series(qcomm_codecs, config.chunk_bytes)
            continue
        fn, problem = _agreed_here(session, lambda op=op: qcomm_collective(op))  # type: ignore[misc]
        lines = [_series("qcomm", c, fn, problem, config.chunk_bytes) for c in qcomm_codecs]
        if op is CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL and config.fbgemm:
            if torchrec_fn is not None:
                lines.append(Series("torchrec", "none", None, torchrec_fn))
                lines += [_series("torchrec", c, torchrec_fn, None, None) for c in fbgemm_codecs]
        lines += [bare_series(op, name) for name in BARE]
        series[op] = lines
    return series, torchrec_reason


def _series(
    impl: str,
    candidate: Candidate,
    fn: Callable[..., Any] | None,
    problem: str | None,
    chunk_bytes: int | None,
) -> Series:
    if candidate.codec is None:
        return Series(impl, candidate.label, None, None, f"codec failed to load: {candidate.error}")
    pair = QuantizedCommCodecs(forward=candidate.codec, backward=candidate.codec)
    return Series(impl, candidate.label, pair, fn, problem, chunk_bytes)


def _check_shape(out: torch.Tensor, case: Case) -> torch.Tensor:
    if out.shape != case.expected.shape:
        raise RuntimeError(
            f"output has shape {tuple(out.shape)}, expected {tuple(case.expected.shape)}"
        )
    return out


@dataclasses.dataclass
class _Entry:
    # One series in one pass ("fwd" or "fwd+bwd") at one size: a row of the report.
    series: Series
    passes: str
    case: Case
    row: dict[str, Any]
    calls: int = 1
    samples: list[float] = dataclasses.field(default_factory=list)

    @property
    def backward(self) -> bool:
        return self.passes == "fwd+bwd"


def _warm_up(session: Session, entry: _Entry, budget: float, max_calls: int) -> None:
    series, case = entry.series, entry.case
    device = session.device

    def once() -> tuple[float, float | None]:
        start = time.perf_counter()
        out = run_series(series, case, session.work, entry.backward)
        synchronize(device)
        seconds = time.perf_counter() - start
        if series.impl == "bare":
            return seconds, None
        return seconds, error_stats(case.expected, _check_shape(out, case)).max_rel

    warm, problem = _agreed(session, once)
    if warm is None:
        if series.call is not None:
            session.renew_work()
        entry.row.update(status="failed", error=problem)
        return
    entry.calls = calls_for_budget(max(w[0] for w in warm), budget, 1, max_calls)
    errors = [w[1] for w in warm if w[1] is not None]
    entry.row["max_rel_error"] = max(errors) if errors else None


def _time_block(session: Session, entry: _Entry) -> None:
    # A block of back-to-back calls, as nccl-tests times them, after a
    # barrier so that every rank starts together; a call ends when its
    # slowest rank is done.
    def timed() -> float:
        torch.distributed.barrier(group=session.work)
        start = time.perf_counter()
        for _ in range(entry.calls):
            run_series(entry.series, entry.case, session.work, entry.backward)
        synchronize(session.device)
        return (time.perf_counter() - start) / entry.calls

    times, problem = _agreed(session, timed)
    if times is None:
        session.renew_work()
        entry.row.update(status="failed", error=problem)
        return
    entry.samples.append(max(times))


def _finish_row(entry: _Entry, world_size: int) -> dict[str, Any]:
    row = entry.row
    if row["status"] != "ok" or not entry.samples:
        return row
    latency = statistics.median(entry.samples)
    algbw = algorithm_bandwidth(entry.case.size_bytes, latency)
    dense = entry.case.op is DenseOp.ALL_REDUCE
    row.update(
        calls=entry.calls * len(entry.samples),
        latency_s=latency,
        latency_min_s=min(entry.samples),
        latency_max_s=max(entry.samples),
        samples_s=list(entry.samples),
        spread=relative_spread(entry.samples),
        algbw_GBps=algbw / GB,
        busbw_GBps=bus_bandwidth(algbw, world_size, all_reduce=dense) / GB,
    )
    return row


def _add_speedups(rows: list[dict[str, Any]]) -> None:
    # The baseline of each implementation and pass is its first series:
    # qcomm's no-op codec, TorchRec without codecs, the bare p2p exchange.
    baseline: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        base = baseline.setdefault((row["impl"], row["pass"]), row)
        row["baseline"] = base["label"]
        ok = row["status"] == "ok" and base["status"] == "ok"
        row["speedup"] = base["latency_s"] / row["latency_s"] if ok else None


def _measure_codecs(
    config: BenchConfig, session: Session, candidates: list[Candidate], progress: _Progress
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n = max(1, config.codec_bytes // 4)
    generator = torch.Generator().manual_seed(config.seed + 1 + session.rank)
    # The errors are relative, but a cast's depend on the magnitude (fp16's
    # range): --data-scale puts the data at the user's.
    x = (torch.randn(n, generator=generator) * config.data_scale).to(session.device)
    dst = torch.empty_like(x)
    _step(session, progress, "memory copy")
    copy, problem = _agreed(
        session,
        lambda: time_calls(
            lambda: dst.copy_(x), session.device, budget=config.budget, max_calls=config.max_calls
        ),
    )
    copy_s = max(copy) if copy else None
    roofline = {
        "bytes": 4 * n,
        "copy_s": copy_s,
        "copy_GBps": 4 * n / copy_s / GB if copy_s else None,
        "error": problem,
    }
    progress.done()
    rows = []
    for candidate in candidates:
        _step(session, progress, f"codec {candidate.label}")
        codec = candidate.codec
        if codec is None:
            outcome: _Outcome = (None, f"failed to load: {candidate.error}")
        else:
            outcome = _agreed(
                session,
                lambda codec=codec: measure_codec(  # type: ignore[misc]
                    codec, x, budget=config.budget, max_calls=config.max_calls
                ),
            )
        rows.append(_codec_row(candidate, outcome, n, copy_s))
        progress.done()
    return roofline, rows


def _measure_collectives(
    config: BenchConfig,
    session: Session,
    series: dict[BenchOp, list[Series]],
    progress: _Progress,
    note: str = "",
) -> list[dict[str, Any]]:
    passes = ["fwd", "fwd+bwd"] if config.backward else ["fwd"]
    points = []
    for size in config.sizes:
        base = base_input(size, world_size=session.world_size, dim=config.dim, seed=config.seed)
        base *= config.data_scale
        for op in config.comm_ops():
            case = make_case(
                op, base, rank=session.rank, world_size=session.world_size, device=session.device
            )
            title = f"{OP_TITLES[op.value]} {format_size(case.size_bytes)}{note}"
            entries = [
                _Entry(
                    line,
                    p,
                    # Each series gets its own copy: a codec that wrote into
                    # its input would otherwise corrupt the next one's.
                    dataclasses.replace(case, input=case.input.clone()),
                    {
                        "op": op.value,
                        "impl": line.impl,
                        "codec": line.codec,
                        "label": line.label(),
                        "pass": p,
                        "size_bytes": case.size_bytes,
                        "status": "ok",
                        "error": None,
                    },
                )
                for p in passes
                for line in series[op]
                if p == "fwd" or line.differentiable
            ]
            per_block = config.budget / config.rounds
            for entry in entries:
                _step(session, progress, f"{title} {entry.row['label']} {entry.passes} warm-up")
                _warm_up(session, entry, per_block, config.max_calls)
                progress.done()
            # Rounds: every series takes its turn in each, so that a slow
            # spell of a shared machine falls on all of them alike.
            for r in range(config.rounds):
                _step(session, progress, f"{title} round {r + 1}/{config.rounds}")
                for entry in entries:
                    if entry.row["status"] == "ok":
                        _time_block(session, entry)
                progress.done()
            rows = [_finish_row(entry, session.world_size) for entry in entries]
            _add_speedups(rows)
            points += rows
    return points


def _unlimited(
    config: BenchConfig, session: Session, series: dict[BenchOp, list[Series]], progress: _Progress
) -> dict[tuple[str, int, str, str], tuple[float, list[float]]]:
    # qcomm's series again with the emulated link's rate limit lifted: each
    # call's time when the link is not the limit, which the model of
    # predicted_time needs, measured on the same devices and network stack.
    ours = {op: [line for line in lines if line.impl == "qcomm"] for op, lines in series.items()}
    session.set_shaping(False)
    try:
        points = _measure_collectives(config, session, ours, progress, ", rate limit lifted")
    finally:
        session.set_shaping(True)
    return {
        (p["op"], p["size_bytes"], p["pass"], p["label"]): _rounds(p)
        for p in points
        if p["status"] == "ok"
    }


def _rounds(p: dict[str, Any]) -> tuple[float, list[float]]:
    # A point's median round, and every round.
    return p["latency_s"], list(p["samples_s"])


def _torchrec_label(label: str) -> str | None:
    # The TorchRec row of the same format as qcomm's codec `label`.
    if label == "noop":
        return "torchrec[none]"
    name = label.partition(":")[0]
    fmt = FBGEMM_FORMATS.get(name)
    return None if fmt is None or label != name else f"torchrec[fbgemm:{fmt.lower()}]"


def _add_comparisons(
    points: list[dict[str, Any]],
    codec_rows: list[dict[str, Any]],
    link: dict[str, Any] | None,
    world_size: int,
    unlimited: dict[tuple[str, int, str, str], tuple[float, list[float]]] | None,
) -> None:
    # What each point is worth against the link's bound (the float32 bytes
    # that cross each rank's port, shrunk by the codec's ratio), against
    # TorchRec's all-to-all with fbgemm's codec of the same format, and the
    # model's figures (predicted_time): the bytes each call puts on a port,
    # its time without a link limit, and with an emulated link the time the
    # model predicts there.
    ratios = {r["codec"]: r.get("compression_ratio") for r in codec_rows if r["status"] == "ok"}
    ratios.update({"none": 1.0, "noop": 1.0})
    rate = link["rate_bps"] if link else None
    measured = link.get("both_ways_GBps") if link else None
    efficiency = measured * 1e9 * 8 / rate if rate and measured else TCP_EFFICIENCY
    latency = {
        (p["op"], p["size_bytes"], p["pass"], p["label"]): p.get("latency_s")
        for p in points
        if p["status"] == "ok"
    }
    for p in points:
        key = (p["op"], p["size_bytes"], p["pass"], p["label"])
        ratio = 1.0 if p["impl"] == "bare" else ratios.get(p["codec"])
        p["compression_ratio"] = ratio
        p.update(link_bound_s=None, x_link_bound=None, link_bytes=None, unlimited_s=None)
        p.update(unlimited_samples_s=None)
        p.update(predicted_s=None, measured_over_predicted=None)
        if ratio and world_size > 1:
            # The backward pass sends as much again, the other way round.
            transfers = 2 if p["pass"] == "fwd+bwd" else 1
            if p["op"] == DenseOp.ALL_REDUCE.value:  # a reduce-scatter and an all-gather
                transfers *= 2
            crossing = transfers * p["size_bytes"] * (world_size - 1) / world_size
            p["link_bytes"] = crossing / ratio / efficiency
            if rate:
                p["link_bound_s"] = crossing * 8 / rate / ratio
                if p["status"] == "ok":
                    p["x_link_bound"] = p["latency_s"] / p["link_bound_s"]
        if p["impl"] == "qcomm" and p["status"] == "ok":
            spread = unlimited.get(key) if unlimited is not None else _rounds(p)
            p["unlimited_s"], p["unlimited_samples_s"] = spread or (None, None)
            if rate and p["unlimited_s"] and p["link_bytes"] is not None:
                p["predicted_s"] = predicted_time(p["link_bytes"], rate / 8, p["unlimited_s"])
                p["measured_over_predicted"] = p["latency_s"] / p["predicted_s"]
        p["vs_torchrec"] = None
        other = _torchrec_label(p["label"]) if p["impl"] == "qcomm" else None
        theirs = latency.get((p["op"], p["size_bytes"], p["pass"], other)) if other else None
        if theirs and p["status"] == "ok":
            p["vs_torchrec"] = theirs / p["latency_s"]
    _add_break_evens(points)


def _add_break_evens(points: list[dict[str, Any]]) -> None:
    # The link rate below which each qcomm codec beats qcomm's no-op codec,
    # by the model, at the same op, size and pass.
    base = {
        (p["op"], p["size_bytes"], p["pass"]): p
        for p in points
        if p["label"] == "noop" and p.get("unlimited_s") and p.get("link_bytes") is not None
    }
    for p in points:
        p["break_even_gbit_per_s"] = None
        p["pays_at_every_rate"] = None
        noop = base.get((p["op"], p["size_bytes"], p["pass"]))
        if p["impl"] != "qcomm" or noop is None or p is noop or not p.get("unlimited_s"):
            continue
        if p.get("link_bytes") is None:  # the codec's own row failed: no ratio to weigh
            continue
        rate = collective_break_even(
            noop["link_bytes"], noop["unlimited_s"], p["link_bytes"], p["unlimited_s"]
        )
        # JSON has no infinity: "faster at every rate" is a flag of its own.
        p["pays_at_every_rate"] = math.isinf(rate)
        p["break_even_gbit_per_s"] = None if math.isinf(rate) else rate * 8 / 1e9


def _measure_link(config: BenchConfig, session: Session) -> dict[str, Any]:
    # What the link carries between ranks 0 and 1, one way and both ways at
    # once, with the backend's plain point-to-point calls on float32.
    rate = parse_rate(config.link) if config.link else None
    seconds = 0.25
    size = 64 << 20 if rate is None else int(min(64 << 20, max(1 << 20, rate / 8 * seconds)))
    x = torch.empty(size // 4, device=session.device).normal_()
    y = torch.empty_like(x)
    group = session.work
    rank = session.rank
    dist = torch.distributed

    def transfer(both: bool) -> None:
        works = []
        if rank in (0, 1):
            peer = 1 - rank
            if both or rank == 1:
                works.append(dist.irecv(y, group=group, group_src=peer))
            if both or rank == 0:
                works.append(dist.isend(x, group=group, group_dst=peer))
        for work in works:
            if work is not None:
                work.wait()

    def measure(both: bool) -> list[float]:
        transfer(both)
        out = []
        for _ in range(7):
            dist.barrier(group=group)
            start = time.perf_counter()
            transfer(both)
            dist.barrier(group=group)
            out.append(time.perf_counter() - start)
        return out

    one, problem = _agreed(session, lambda: measure(False))
    two, problem2 = _agreed(session, lambda: measure(True))
    result: dict[str, Any] = {
        "spec": config.link,
        "rate_bps": rate,
        "bytes": size,
        "error": problem or problem2,
    }
    for name, samples in (("one_way", one), ("both_ways", two)):
        if samples:
            worst = [max(rank_s[i] for rank_s in samples) for i in range(len(samples[0]))]
            result[f"{name}_s"] = statistics.median(worst)
            result[f"{name}_GBps"] = size / statistics.median(worst) / GB
            result[f"{name}_samples_s"] = worst
            result[f"{name}_spread"] = relative_spread(worst)
    return result


def _step(session: Session, progress: _Progress, label: str) -> None:
    session.beat(label)
    progress.step(label)


def run_rank(config: BenchConfig, session: Session) -> int:
    r"""
    run_rank(config: BenchConfig, session: Session) -> int

    Runs every step of ``qcomm bench`` on this rank; rank 0 then prints the
    table and writes the JSON and plot asked for.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm codec failed somewhere.
    """
    started = time.time()
    clock = time.perf_counter()
    candidates, fbgemm_reason = load_candidates(config.codecs, config.fbgemm)
    _agree_on_loads(session, candidates)
    series, torchrec_reason = _build_series(config, session, candidates)
    passes = 2 if config.backward else 1
    entries = sum(passes * len(s) for s in series.values())
    rounds = len(config.sizes) * len(series) * config.rounds
    total = 1 + len(candidates) + len(config.sizes) * entries + rounds
    if session.link_control:  # the link's throughput, then qcomm's series unlimited
        ours = sum(passes * sum(line.impl == "qcomm" for line in s) for s in series.values())
        total += 1 + len(config.sizes) * ours + rounds
    progress = _Progress(session.rank == 0, total)
    load_before = _load()
    try:
        link = None
        if config.link:
            _step(session, progress, "link throughput")
            link = _measure_link(config, session)
            progress.done()
        roofline, codec_rows = _measure_codecs(config, session, candidates, progress)
        points = _measure_collectives(config, session, series, progress)
        if session.link_control:
            unlimited = _unlimited(config, session, series, progress)
        elif session.local:  # loopback: the measured times have no link limit
            unlimited = None
        else:  # a launcher's ranks: their times include the real link
            unlimited = {}
        session.gather(None)  # everyone is done
    finally:
        progress.close()
    _add_comparisons(points, codec_rows, link, session.world_size, unlimited)
    add_pytorch_ratios(points)
    if session.rank != 0:
        return 0
    meta = _meta(config, session, started, time.perf_counter() - clock)
    meta.update(load_before=load_before, load_after=_load())
    results = {
        "meta": meta,
        "link": link,
        "roofline": roofline,
        "codecs": codec_rows,
        "collectives": points,
        "unavailable": {"fbgemm": fbgemm_reason, "torchrec": torchrec_reason},
    }
    results["advice"] = advice_json(
        results,
        max_error=config.max_error,
        loss_gaps=config.loss_gaps,
        training_results=config.training_results,
    )
    write_report(results, json_path=config.json_path, plot_path=config.plot_path)
    failed = any(r["status"] != "ok" and r["source"] == "qcomm" for r in codec_rows) or any(
        p["status"] != "ok" and p["impl"] == "qcomm" for p in points
    )
    return EXIT_CODEC_FAILED if failed else 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    # The 1, 5 and 15 minute load averages: how busy the machine was.
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def run_meta(session: Session, started: float, duration: float) -> dict[str, Any]:
    r"""
    run_meta(session: Session, started: float, duration: float) -> dict[str, Any]

    What every report's ``meta`` says of the run: versions, host, clock, ranks.

    Args:
        session (Session): this rank's device and process groups.
        started (float): when the run started (``time.time()``).
        duration (float): how long it took, in seconds.

    Returns:
        dict[str, Any]: the fields, JSON-ready.
    """
    return {
        "qcomm_version": qcomm.__version__,
        "torch_version": torch.__version__,
        "fbgemm_gpu_version": _version("fbgemm-gpu") or _version("fbgemm-gpu-cpu"),
        "torchrec_version": _version("torchrec"),
        "python": platform.python_version(),
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": duration,
        "backend": session.backend,
        "device": str(session.device),
        "world_size": session.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "local": session.local,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }


def _meta(config: BenchConfig, session: Session, started: float, duration: float) -> dict[str, Any]:
    return {
        **run_meta(session, started, duration),
        "quick": config.quick,
        "sizes": config.sizes,
        "ops": config.ops,
        "dim": config.dim,
        "codec_elements": max(1, config.codec_bytes // 4),
        "budget_s": config.budget,
        "rounds": config.rounds,
        "timeout_s": config.timeout,
        "link": config.link,
        "backward": config.backward,
        "chunk_bytes": config.chunk_bytes,
        "link_gbps": config.link_gbps,
        "data_scale": config.data_scale,
        "command": config.command,
    }
