r"""
``qcomm bench --profile``: where the time of one collective call goes, by
phase, beside TorchRec's call and the backend's bare exchange timed in the
same run. On a fast link the wire takes microseconds and what a call costs
the CPU is the step's cost; this is how a change to the exchange is checked
against the floor it set (docs/bench.rst, "Where a call's time goes").

Each phase is a set of qcomm's own functions (:data:`PHASES`), wrapped while
the profile runs: a phase's time is the time spent inside its functions,
less the time in other phases' functions they call, on every thread. A call
handed to the background thread (a large one, waited for later) is received
and decoded there while its caller waits in ``waiting for background``: the
two overlap, and the shares then add up to more than the call. What no phase
claims (the collective's own body, the caller's loop) is ``other``. The wrappers
cost about a microsecond per function call: the profiled call is slower than
the unprofiled one, whose time is given too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qcomm import config as qcomm_config
from qcomm.benchmark.measure import build_series
from qcomm.benchmark.options import BenchConfig
from qcomm.benchmark.series import Case, Series, base_input, make_case, run_series
from qcomm.benchmark.session import Session
from qcomm.benchmark.timing import synchronize

__all__ = [
    "PHASES",
    "PhaseClock",
    "PhaseProfile",
    "format_profiles",
    "phases_timed",
    "profile_rank",
    "run_profile",
]

#: the phases of a call, each the functions it is made of (``module:name``,
#: or ``module:Class.method``), in the order a call meets them
PHASES: dict[str, tuple[str, ...]] = {
    "arguments": (
        "qcomm.collectives._args:check_input",
        "qcomm.collectives._args:check_splits",
        "qcomm.collectives._args:check_flag",
        "qcomm.collectives._args:check_chunk_bytes",
        "qcomm.collectives._args:resolve_codecs",
    ),
    "call and agreement": (
        "qcomm.collectives._call:begin",
        "qcomm.collectives._call:Call.by_peer",
        "qcomm.collectives._agreement:Agreement.__exit__",
    ),
    "layout": (
        "qcomm.collectives._layouts:pooled_forward",
        "qcomm.collectives._layouts:pooled_backward",
        "qcomm.collectives._layouts:sequence_exchange",
        "qcomm.collectives._coding:PeerCodings.__init__",
        "qcomm.collectives._coding:PeerCodings.padded",
    ),
    "chunking": ("qcomm.collectives._exchange:plan",),
    "status": (
        "qcomm.collectives._protocol:Protocol.__init__",
        "qcomm.collectives._protocol:Protocol.announce",
        "qcomm.collectives._protocol:Protocol.agree",
        "qcomm.collectives._protocol:Protocol.release",
        "qcomm.collectives._protocol:Protocol.last_received",
        "qcomm.collectives._protocol:Protocol.verdict",
    ),
    "exchange": (
        "qcomm.collectives._exchange:start_exchange",
        "qcomm.collectives._exchange:_send",
        "qcomm.collectives._exchange:_Receiver.__call__",
    ),
    "encode": (
        "qcomm.collectives._wire:encodable",
        "qcomm.collectives._wire:checked_encode",
    ),
    "transport": (
        "qcomm.collectives._transport:PointToPoint.start",
        "qcomm.collectives._transport:PointToPoint.send",
        "qcomm.collectives._transport:PointToPoint.close",
        "qcomm.collectives._transport:OneAllToAll.send",
        "qcomm.collectives._transport:OneAllToAll.flush",
        "qcomm.collectives._transport:OneAllToAll.close",
        "qcomm.collectives._transport:Transport.received",
    ),
    "waiting for peers": (
        "qcomm.collectives._transport:PointToPoint._wait_for",
        "qcomm.collectives._transport:OneAllToAll._wait_for",
    ),
    "copies": (
        "qcomm.collectives._exchange:_Lender.lend",
        "qcomm.collectives._exchange:copy_block",
    ),
    "background hand-off": ("qcomm.collectives._background:later",),
    "waiting for background": ("qcomm.collectives._background:_Job.join",),
    "decode and store": ("qcomm.collectives._exchange:_decode",),
    "error measurement": (
        "qcomm.collectives._measure:Meter.__init__",
        "qcomm.collectives._measure:Meter.take",
        "qcomm.collectives._measure:Meter.errors",
        "qcomm.collectives._measure:Meter.learn",
    ),
    "autograd": (
        "qcomm.collectives._pending:Pending.__init__",
        "qcomm.collectives._pending:Pending._wait_impl",
    ),
}
OTHER = "other"


class PhaseClock:
    r"""
    Time by phase while :func:`phases_timed` runs: each function's own (less
    what it spends in functions of any phase it calls), with a stack per
    thread; ``seconds`` and ``calls`` by phase.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)
        self._lock = threading.Lock()
        self._local = threading.local()

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        r"""
        wrap(fn: Callable[..., Any], phase: str) -> Callable[..., Any]

        ``fn``, its time added to ``phase``.

        Args:
            fn (Callable[..., Any]): the function.
            phase (str): a phase of :data:`PHASES`.
        """

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack: list[float] = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # time spent in nested phases
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                nested = stack.pop()
                if stack:
                    stack[-1] += spent
                with self._lock:
                    self.seconds[phase] += spent - nested
                    self.calls[phase] += 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


def _target(spec: str) -> tuple[Any, str, Any]:
    """The owner (module or class), attribute name and function of ``module:name``."""
    module_name, _, path = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *classes, name = path.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    if name not in vars(owner):
        raise AttributeError(f"qcomm bench --profile: {spec} is gone; update PHASES")
    return owner, name, vars(owner)[name]


def _collective_modules() -> list[Any]:
    return [m for n, m in list(sys.modules.items()) if n.startswith("qcomm.") and m is not None]


@contextlib.contextmanager
def phases_timed() -> Iterator[PhaseClock]:
    r"""
    phases_timed() -> Iterator[PhaseClock]

    Wraps every function of :data:`PHASES` while the block runs (wherever
    qcomm's modules hold it); yields the clock whose ``seconds`` and
    ``calls`` add up each phase.

    Raises:
        AttributeError: if a function of :data:`PHASES` is gone (renamed or
            moved): the profile would silently miss its phase.
    """
    clock = PhaseClock()
    undo: list[Callable[[], None]] = []
    try:
        for phase, specs in PHASES.items():
            for spec in specs:
                owner, name, fn = _target(spec)
                raw = fn.__func__ if isinstance(fn, staticmethod) else fn
                timed = clock.wrap(raw, phase)
                if isinstance(owner, type):
                    setattr(owner, name, timed)
                    undo.append(functools.partial(setattr, owner, name, fn))
                    continue
                # A function imported by name elsewhere is called through
                # every module that holds it.
                for module in _collective_modules():
                    for attr, value in list(vars(module).items()):
                        if value is fn:
                            setattr(module, attr, timed)
                            undo.append(functools.partial(setattr, module, attr, fn))
        yield clock
    finally:
        for restore in reversed(undo):
            restore()


@dataclasses.dataclass
class PhaseProfile:
    r"""
    One collective with one codec at one size, on one rank.

    Args:
        op (str): the collective.
        codec (str): the codec's label.
        size_bytes (int): float32 bytes per rank.
        call_s (float): seconds per call, unprofiled (median of rounds).
        profiled_s (float): seconds per call while profiled.
        phases_s (dict[str, float]): seconds per call by phase, ``other`` last.
        calls (dict[str, float]): function calls per call, by phase.
        torchrec_s (float | None): TorchRec's ``alltoall_pooled`` without codecs (pooled only).
        bare_s (float | None): the bare point-to-point exchange of the same bytes.
        unmeasured_s (float | None): seconds per call with the setting
            ``measure_errors`` off (a codec that encodes), timed in rounds
            alternating with ``call_s``'s.
        measuring (tuple[float, ...]): per round, the measured call's time over
            the unmeasured one's, less 1: what measuring the errors costs.
    """

    op: str
    codec: str
    size_bytes: int
    call_s: float
    profiled_s: float
    phases_s: dict[str, float]
    calls: dict[str, float]
    torchrec_s: float | None = None
    bare_s: float | None = None
    unmeasured_s: float | None = None
    measuring: tuple[float, ...] = ()


def _per_call(session: Session, series: Series, case: Case, calls: int, rounds: int) -> float:
    """The median over ``rounds`` of a block of ``calls`` calls, each after a barrier."""
    return statistics.median(_block(session, series, case, calls) for _ in range(rounds))


def _block(session: Session, series: Series, case: Case, calls: int) -> float:
    """Seconds per call of a block of ``calls`` calls, after a barrier."""
    torch.distributed.barrier(group=session.work)
    start = time.perf_counter()
    for _ in range(calls):
        run_series(series, case, session.work)
    synchronize(session.device)
    return (time.perf_counter() - start) / calls


def _with_and_without_measuring(
    session: Session, series: Series, case: Case, calls: int, rounds: int
) -> tuple[float, float, tuple[float, ...]]:
    """
    The call timed with its errors measured (``measure_errors`` on) and
    without, in alternating rounds (both ranks switch together between
    blocks): both medians, and each round's cost of measuring.
    """
    measured, unmeasured = [], []
    for _ in range(rounds):
        with qcomm_config.configured(measure_errors=True):
            measured.append(_block(session, series, case, calls))
        with qcomm_config.configured(measure_errors=False):
            unmeasured.append(_block(session, series, case, calls))
    cost = tuple(m / u - 1 for m, u in zip(measured, unmeasured, strict=True))
    return statistics.median(measured), statistics.median(unmeasured), cost


def _calls_for(session: Session, series: Series, case: Case, budget: float) -> int:
    """Calls per block so that a block takes about ``budget`` seconds (alike on every rank)."""
    for _ in range(3):  # the first pays what only a first call does
        start = time.perf_counter()
        run_series(series, case, session.work)
    once = time.perf_counter() - start
    slowest = max(session.gather(once))
    return max(3, min(2000, int(budget / max(slowest, 1e-6))))


def profile_rank(config: BenchConfig, session: Session) -> list[PhaseProfile]:
    r"""
    profile_rank(config: BenchConfig, session: Session) -> list[PhaseProfile]

    Profiles every qcomm series of the run (its ops, codecs and sizes) on
    this rank, with TorchRec's call and the bare exchange timed beside it.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.
    """
    from qcomm.benchmark.candidates import load_candidates

    candidates, _ = load_candidates(config.codecs, False)
    lines, _ = build_series(config, session, candidates)
    out = []
    for op, series in lines.items():
        ours = [s for s in series if s.impl == "qcomm" and s.call is not None]
        torchrec = next((s for s in series if s.impl == "torchrec" and s.codec == "none"), None)
        bare = next((s for s in series if s.impl == "bare" and s.codec == "p2p"), None)
        for size in config.sizes:
            base = base_input(size, world_size=session.world_size, dim=config.dim, seed=config.seed)
            case = make_case(
                op, base, rank=session.rank, world_size=session.world_size, device=session.device
            )
            budget = max(0.05, config.budget / 4)
            refs = {}
            for name, line in (("torchrec", torchrec), ("bare", bare)):
                if line is not None and line.call is not None:
                    n = _calls_for(session, line, case, budget)
                    refs[name] = _per_call(session, line, case, n, config.rounds)
            for line in ours:
                n = _calls_for(session, line, case, budget)
                unmeasured: float | None = None
                cost: tuple[float, ...] = ()
                if line.codec == "noop":
                    call_s = _per_call(session, line, case, n, config.rounds)
                else:
                    call_s, unmeasured, cost = _with_and_without_measuring(
                        session, line, case, n, config.rounds
                    )
                torch.distributed.barrier(group=session.work)
                with phases_timed() as clock:
                    start = time.perf_counter()
                    for _ in range(n):
                        run_series(line, case, session.work)
                    synchronize(session.device)
                    profiled = (time.perf_counter() - start) / n
                phases = {p: s / n for p, s in clock.seconds.items()}
                phases[OTHER] = max(0.0, profiled - sum(phases.values()))
                out.append(
                    PhaseProfile(
                        op=op.value,
                        codec=line.codec,
                        size_bytes=size,
                        call_s=call_s,
                        profiled_s=profiled,
                        phases_s=phases,
                        calls={p: c / n for p, c in clock.calls.items()},
                        torchrec_s=refs.get("torchrec"),
                        bare_s=refs.get("bare"),
                        unmeasured_s=unmeasured,
                        measuring=cost,
                    )
                )
    return out


def _size(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def format_profiles(ranks: list[list[PhaseProfile]], transport: str) -> str:
    r"""
    format_profiles(ranks: list[list[PhaseProfile]], transport: str) -> str

    The report: per collective, codec and size, the call beside TorchRec's
    and the bare exchange (slowest rank), then each phase's microseconds per
    call (mean over ranks) and its share of the profiled call.

    Args:
        ranks (list[list[PhaseProfile]]): every rank's profiles, in the same order.
        transport (str): the transport the calls took.
    """
    lines = []
    world = len(ranks)
    for i, first in enumerate(ranks[0]):
        mine = [r[i] for r in ranks]
        call = max(p.call_s for p in mine)
        profiled = statistics.fmean(p.profiled_s for p in mine)
        head = (
            f"{first.op}, {first.codec}, {_size(first.size_bytes)} per rank, {world} ranks, "
            f"{transport}: {call * 1e3:.3f} ms per call"
        )
        refs = []
        for name, key in (("TorchRec, no codec", "torchrec_s"), ("bare point-to-point", "bare_s")):
            values = [getattr(p, key) for p in mine]
            if all(v is not None for v in values):
                ref = max(values)
                refs.append(f"{name} {ref * 1e3:.3f} ms (qcomm x{call / ref:.2f})")
        lines.append(head + ("; " + ", ".join(refs) if refs else ""))
        lines.append(f"  {'phase':22} {'us/call':>8} {'share':>6} {'fn calls':>8}")
        for phase in (*PHASES, OTHER):
            seconds = statistics.fmean(p.phases_s[phase] for p in mine)
            calls = statistics.fmean(p.calls.get(phase, 0.0) for p in mine)
            share = seconds / profiled if profiled else 0.0
            fn_calls = f"{calls:8.1f}" if phase != OTHER else ""
            lines.append(f"  {phase:22} {seconds * 1e6:8.1f} {share:6.0%} {fn_calls}")
        lines.append(
            f"  {'profiled call':22} {profiled * 1e6:8.1f}   (unprofiled "
            f"{statistics.fmean(p.call_s for p in mine) * 1e6:.1f}: the rest is the wrappers' cost)"
        )
        if first.measuring:
            # Every rank's rounds: the ranks wait for each other, so each
            # round's cost is the slowest rank's.
            costs = [max(r) for r in zip(*(p.measuring for p in mine), strict=True)]
            lines.append(
                f"  {'measuring the errors':22} costs {statistics.median(costs):+.1%} of the call "
                f"unmeasured (rounds {min(costs):+.1%} to {max(costs):+.1%}; "
                "QCOMM_MEASURE_ERRORS=1, a budget or an adaptive codec)"
            )
        lines.append("")
    return "\n".join(lines)


def run_profile(config: BenchConfig, session: Session) -> int:
    r"""
    run_profile(config: BenchConfig, session: Session) -> int

    ``qcomm bench --profile`` on this rank: rank 0 prints the report and
    writes the JSON asked for.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``.
    """
    import json

    from qcomm.collectives import _transport

    mine = profile_rank(config, session)
    ranks = session.gather(mine)
    if session.rank != 0:
        return 0
    transport = _transport.kind(session.work, _backend_of(session))
    print(format_profiles(ranks, transport))
    if config.json_path:
        with open(config.json_path, "w") as f:
            json.dump(
                {
                    "transport": transport,
                    "world_size": session.world_size,
                    "ranks": [[dataclasses.asdict(p) for p in r] for r in ranks],
                },
                f,
                indent=1,
            )
    return 0


def _backend_of(session: Session) -> Any:
    from qcomm.collectives._backends import backend_of

    return backend_of(session.work, session.device)
