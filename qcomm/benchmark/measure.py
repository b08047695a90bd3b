r"""
The measurements of ``qcomm bench``, step by step on every rank
(:func:`run_rank`): the rows of :mod:`~qcomm.benchmark.rows`, then the
figures :mod:`~qcomm.benchmark.figures` derives from them.

After each step the ranks agree over the control group on whether it failed
(:mod:`~qcomm.benchmark.agreement`): a codec that raises is a failed row,
and the run goes on. Order: the memory-copy roofline, each codec on its
own, then for each size and collective each implementation and codec,
``noop`` first as the baseline.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from qcomm.benchmark.advice import run_advice
from qcomm.benchmark.agreement import Outcome, agree_on_loads, agreed, agreed_here
from qcomm.benchmark.candidates import (
    Candidate,
    crossing_elements,
    load_candidates,
    measure_codec,
    measure_host_codecs,
)
from qcomm.benchmark.figures import Unlimited, add_comparisons, add_pytorch_ratios, add_speedups
from qcomm.benchmark.figures import rounds as point_rounds
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.meta import bench_meta, load
from qcomm.benchmark.metrics import (
    GB,
    ErrorStats,
    algorithm_bandwidth,
    break_even_bandwidth,
    bus_bandwidth,
    error_stats,
    relative_spread,
)
from qcomm.benchmark.options import OP_TITLES, BenchConfig, BenchOp, DenseOp, format_size
from qcomm.benchmark.progress import Progress, begin
from qcomm.benchmark.report import write_report
from qcomm.benchmark.results import LinkFigures, Results, Roofline, Unavailable
from qcomm.benchmark.rows import CodecRow, Point
from qcomm.benchmark.series import (
    BARE,
    Case,
    Series,
    all_reduce_series,
    bare_series,
    base_input,
    make_case,
    pair_of,
    qcomm_collective,
    run_series,
    torchrec_all_to_all,
)
from qcomm.benchmark.session import EXIT_CODEC_FAILED, Session
from qcomm.benchmark.timing import calls_for_budget, synchronize, time_calls
from qcomm.ops import CommOp
from qcomm.types import HostCodecs, codec_info

__all__ = ["build_series", "run_rank"]


def _summable(codec: Any) -> bool | None:
    # Whether the backend may sum its wire: the reduce-scatter's advice needs
    # it. Of codecs by host, what build_registry checks: the forward codec
    # TorchRec's own reduce-scatter would apply, the other hosts'.
    if codec is None:
        return None
    return codec_info(codec.forward if isinstance(codec, HostCodecs) else codec).summable


def _codec_row(candidate: Candidate, outcome: Outcome, n: int, copy_s: float | None) -> CodecRow:
    summable = _summable(candidate.codec)
    row = CodecRow(codec=candidate.label, source=candidate.source, summable=summable, status="ok")
    figures, problem = outcome
    if figures is None:
        row.status, row.error = "failed", problem
        return row
    first = figures[0]
    encode_s = max(f["encode_s"] for f in figures)  # the slowest rank sets the pace
    decode_s = max(f["decode_s"] for f in figures)
    # The wire's figures are of what crosses hosts: all of it for one codec.
    crossing = first.get("crossing_elements", n)
    logical = 4 * crossing
    wire = first["wire_bytes"]
    backward = first.get("backward_wire_bytes")
    return dataclasses.replace(
        row,
        elements=n,
        wire_dtype=first["wire_dtype"],
        wire_elements=first["wire_elements"],
        calc_quantized_size=first["calc_quantized_size"],
        wire_bytes_per_element=wire / crossing,
        bits_per_element=8 * wire / crossing,
        declared_bits_per_element=first["declared_bits_per_element"],
        compression_ratio=logical / wire,
        encode_s=encode_s,
        decode_s=decode_s,
        encode_GBps=4 * n / encode_s / GB,
        decode_GBps=4 * n / decode_s / GB,
        # The copy moves the same float32 bytes, so the time ratio is the
        # throughput ratio.
        encode_roofline_fraction=copy_s / encode_s if copy_s else None,
        decode_roofline_fraction=copy_s / decode_s if copy_s else None,
        max_rel_error=max(f["max_rel_error"] for f in figures),
        rms_rel_error=max(f["rms_rel_error"] for f in figures),
        sqnr_db=min(f["sqnr_db"] for f in figures),
        encode_samples_s=[f["encode_samples_s"] for f in figures],
        decode_samples_s=[f["decode_samples_s"] for f in figures],
        spread=max(
            relative_spread(f[key])
            for f in figures
            for key in ("encode_samples_s", "decode_samples_s")
        ),
        break_even_GBps=break_even_bandwidth(wire, logical, encode_s, decode_s) / GB,
        crossing_share=crossing / n if candidate.by_host else None,
        backward_compression_ratio=logical / backward if backward else None,
    )


def build_series(
    config: BenchConfig, session: Session, candidates: list[Candidate]
) -> tuple[dict[BenchOp, list[Series]], str | None]:
    r"""
    build_series(config: BenchConfig, session: Session, candidates: list[Candidate]) -> tuple[dict[BenchOp, list[Series]], str | None]

    What runs for each collective of the run: qcomm with each codec,
    TorchRec without and with fbgemm's codecs (pooled all-to-all), the
    backend's bare calls; and why TorchRec cannot run, if it cannot.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.
        candidates (list[Candidate]): the run's codecs.
    """
    qcomm_codecs = [c for c in candidates if c.source == "qcomm"]
    fbgemm_codecs = [c for c in candidates if c.source == "fbgemm"]
    torchrec_reason: str | None = None
    torchrec_fn: Callable[..., Any] | None = None
    if config.fbgemm and CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL in config.comm_ops():
        torchrec_fn, problem = agreed_here(session, torchrec_all_to_all)
        torchrec_reason = f"TorchRec is not importable: {problem}" if problem else None
    series: dict[BenchOp, list[Series]] = {}
    for op in config.comm_ops():
        if op is DenseOp.ALL_REDUCE:
            series[op] = all_reduce_series(qcomm_codecs, config.chunk_bytes)
            continue
        fn, problem = agreed_here(session, lambda op=op: qcomm_collective(op))  # type: ignore[misc]
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
    return Series(impl, candidate.label, pair_of(candidate), fn, problem, chunk_bytes)


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
    row: Point
    calls: int = 1
    samples: list[float] = dataclasses.field(default_factory=list)

    @property
    def backward(self) -> bool:
        return self.passes == "fwd+bwd"


def _warm_up(session: Session, entry: _Entry, budget: float, max_calls: int) -> None:
    series, case = entry.series, entry.case
    device = session.device

    def once() -> tuple[float, ErrorStats | None]:
        start = time.perf_counter()
        out = run_series(series, case, session.work, entry.backward)
        synchronize(device)
        seconds = time.perf_counter() - start
        if series.impl == "bare":
            return seconds, None
        return seconds, error_stats(case.expected, _check_shape(out, case))

    # The first call pays what only a first call does (the ranks' agreement
    # check, imports): a second, steady one sizes the timed blocks, which
    # would otherwise be too short to hide a barrier's cost on small calls.
    warm, problem = agreed(session, once)
    if warm is not None:
        warm, problem = agreed(session, once)
    if warm is None:
        if series.call is not None:
            session.renew_work()
        entry.row.status, entry.row.error = "failed", problem
        return
    entry.calls = calls_for_budget(max(w[0] for w in warm), budget, 1, max_calls)
    errors = [w[1] for w in warm if w[1] is not None]
    if errors:
        entry.row.max_rel_error = max(e.max_rel for e in errors)
        entry.row.rms_rel_error = max(e.rms_rel for e in errors)


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

    times, problem = agreed(session, timed)
    if times is None:
        session.renew_work()
        entry.row.status, entry.row.error = "failed", problem
        return
    entry.samples.append(max(times))


def _finish_row(entry: _Entry, world_size: int) -> Point:
    row = entry.row
    if row.status != "ok" or not entry.samples:
        return row
    latency = statistics.median(entry.samples)
    algbw = algorithm_bandwidth(entry.case.size_bytes, latency)
    dense = entry.case.op is DenseOp.ALL_REDUCE
    return dataclasses.replace(
        row,
        calls=entry.calls * len(entry.samples),
        latency_s=latency,
        latency_min_s=min(entry.samples),
        latency_max_s=max(entry.samples),
        samples_s=list(entry.samples),
        spread=relative_spread(entry.samples),
        algbw_GBps=algbw / GB,
        busbw_GBps=bus_bandwidth(algbw, world_size, all_reduce=dense) / GB,
    )


def _measure_codecs(
    config: BenchConfig, session: Session, candidates: list[Candidate], progress: Progress
) -> tuple[Roofline, list[CodecRow]]:
    n = max(1, config.codec_bytes // 4)
    generator = torch.Generator().manual_seed(config.seed + 1 + session.rank)
    # The errors are relative, but a cast's depend on the magnitude (fp16's
    # range): --data-scale puts the data at the user's.
    x = (torch.randn(n, generator=generator) * config.data_scale).to(session.device)
    dst = torch.empty_like(x)
    begin(session, progress, "memory copy")
    copy, problem = agreed(
        session,
        lambda: time_calls(
            lambda: dst.copy_(x), session.device, budget=config.budget, max_calls=config.max_calls
        ),
    )
    copy_s = max(copy) if copy else None
    roofline = Roofline(
        bytes=4 * n,
        copy_s=copy_s,
        copy_GBps=4 * n / copy_s / GB if copy_s else None,
        error=problem,
    )
    progress.done()
    rows = []
    for candidate in candidates:
        begin(session, progress, f"codec {candidate.label}")
        codec = candidate.codec
        if codec is None:
            outcome: Outcome = (None, f"failed to load: {candidate.error}")
        elif isinstance(codec, HostCodecs):
            # A spec's own ranks_per_host decides its hosts, as in the collectives.
            per_host = codec.ranks_per_host or config.ranks_per_host or 1
            crossing = crossing_elements(n, session.world_size, per_host)
            outcome = agreed(
                session,
                lambda codec=codec, crossing=crossing: measure_host_codecs(  # type: ignore[misc]
                    codec, x, crossing=crossing, budget=config.budget, max_calls=config.max_calls
                ),
            )
        else:
            outcome = agreed(
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
    progress: Progress,
    note: str = "",
) -> list[Point]:
    passes = ["fwd", "fwd+bwd"] if config.backward else ["fwd"]
    points: list[Point] = []
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
                    Point(
                        op=op.value,
                        impl=line.impl,
                        codec=line.codec,
                        label=line.label(),
                        passes=p,
                        size_bytes=case.size_bytes,
                        status="ok",
                    ),
                )
                for p in passes
                for line in series[op]
                if p == "fwd" or line.differentiable
            ]
            per_block = config.budget / config.rounds
            for entry in entries:
                begin(session, progress, f"{title} {entry.row.label} {entry.passes} warm-up")
                _warm_up(session, entry, per_block, config.max_calls)
                progress.done()
            # Rounds: every series takes its turn in each, so that a slow
            # spell of a shared machine falls on all of them alike.
            for r in range(config.rounds):
                begin(session, progress, f"{title} round {r + 1}/{config.rounds}")
                for entry in entries:
                    if entry.row.status == "ok":
                        _time_block(session, entry)
                progress.done()
            rows = [_finish_row(entry, session.world_size) for entry in entries]
            add_speedups(rows)
            points += rows
    return points


def _unlimited(
    config: BenchConfig, session: Session, series: dict[BenchOp, list[Series]], progress: Progress
) -> Unlimited:
    # qcomm's series again with the emulated link's rate limit lifted: each
    # call's time when the link is not the limit, which the model of
    # predicted_time needs, measured on the same devices and network stack.
    ours = {op: [line for line in lines if line.impl == "qcomm"] for op, lines in series.items()}
    session.set_shaping(False)
    try:
        points = _measure_collectives(config, session, ours, progress, ", rate limit lifted")
    finally:
        session.set_shaping(True)
    out: Unlimited = {}
    for p in points:
        timed = point_rounds(p)
        if p.status == "ok" and timed is not None:
            out[p.key] = timed
    return out


def _measure_link(config: BenchConfig, session: Session) -> LinkFigures:
    # What the link carries between rank 0 and the first rank of the next
    # host, one way and both ways at once, with the backend's plain
    # point-to-point calls on float32.
    rate = parse_rate(config.link) if config.link else None
    seconds = 0.25
    size = 64 << 20 if rate is None else int(min(64 << 20, max(1 << 20, rate / 8 * seconds)))
    x = torch.empty(size // 4, device=session.device).normal_()
    y = torch.empty_like(x)
    group = session.work
    rank = session.rank
    dist = torch.distributed

    other = config.ranks_per_host or 1

    def transfer(both: bool, peer_of_0: int = other) -> None:
        works = []
        if rank in (0, peer_of_0):
            peer = peer_of_0 - rank
            if both or rank == peer_of_0:
                works.append(dist.irecv(y, group=group, group_src=peer))
            if both or rank == 0:
                works.append(dist.isend(x, group=group, group_dst=peer))
        for work in works:
            if work is not None:
                work.wait()

    def measure(both: bool, peer_of_0: int = other) -> list[float]:
        transfer(both, peer_of_0)
        out = []
        for _ in range(7):
            dist.barrier(group=group)
            start = time.perf_counter()
            transfer(both, peer_of_0)
            dist.barrier(group=group)
            out.append(time.perf_counter() - start)
        return out

    one, problem = agreed(session, lambda: measure(False))
    two, problem2 = agreed(session, lambda: measure(True))
    result = LinkFigures(spec=config.link, rate_bps=rate, bytes=size, error=problem or problem2)
    measured = [("one_way", one), ("both_ways", two)]
    if other > 1:
        # Ranks 0 and 1 share a host: what a planner costs inside one.
        same, problem3 = agreed(session, lambda: measure(True, 1))
        result.error = result.error or problem3
        measured.append(("same_host_both_ways", same))
    for name, samples in measured:
        if samples:
            worst = [max(rank_s[i] for rank_s in samples) for i in range(len(samples[0]))]
            median = statistics.median(worst)
            spread = relative_spread(worst)
            figures = {
                "s": median,
                "GBps": size / median / GB,
                "samples_s": worst,
                "spread": spread,
            }
            for key, value in figures.items():
                setattr(result, f"{name}_{key}", value)
    return result


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
    agree_on_loads(session, candidates)
    series, torchrec_reason = build_series(config, session, candidates)
    passes = 2 if config.backward else 1
    entries = sum(passes * len(s) for s in series.values())
    rounds = len(config.sizes) * len(series) * config.rounds
    total = 1 + len(candidates) + len(config.sizes) * entries + rounds
    if session.link_control:  # the link's throughput, then qcomm's series unlimited
        ours = sum(passes * sum(line.impl == "qcomm" for line in s) for s in series.values())
        total += 1 + len(config.sizes) * ours + rounds
    progress = Progress(session.rank == 0, total)
    load_before = load()
    try:
        link = None
        if config.link:
            begin(session, progress, "link throughput")
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
    add_comparisons(
        points, codec_rows, link, session.world_size, unlimited, config.ranks_per_host or 1
    )
    add_pytorch_ratios(points)
    if session.rank != 0:
        return 0
    meta = bench_meta(config, session, started, time.perf_counter() - clock)
    meta.load_before, meta.load_after = load_before, load()
    results = Results(
        meta=meta,
        link=link,
        roofline=roofline,
        codecs=codec_rows,
        collectives=points,
        unavailable=Unavailable(fbgemm=fbgemm_reason, torchrec=torchrec_reason),
    )
    results.advice = run_advice(
        results,
        max_error=config.max_error,
        loss_gaps=config.loss_gaps,
        training_results=config.training_results,
    )
    write_report(results, json_path=config.json_path, plot_path=config.plot_path)
    failed = any(r.status != "ok" and r.source == "qcomm" for r in codec_rows) or any(
        p.status != "ok" and p.impl == "qcomm" for p in points
    )
    return EXIT_CODEC_FAILED if failed else 0
