r"""
The harness of ``qcomm bench --train``: what every model it trains shares.
A model (:class:`TrainModel`: TorchRec's DLRM in
:mod:`~qcomm.benchmark.train`, the MLP under DDP in
:mod:`~qcomm.benchmark.train_mlp`) says which series it runs, what memory a
rank needs, how it builds a series' model and takes a step, and what its
results are; the harness (:func:`run_model`) builds every series, warms each
up, times them in interleaved rounds, and reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from qcomm import config as qcomm_config
from qcomm import torchrec_exchange
from qcomm.benchmark.agreement import agreed
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.meta import load, run_meta
from qcomm.benchmark.metrics import relative_spread
from qcomm.benchmark.options import TRAIN_WARM_UP_STEPS, BenchConfig
from qcomm.benchmark.progress import Progress, begin
from qcomm.benchmark.report import write_report
from qcomm.benchmark.results import DlrmTrain, LinkRate, MlpTrain, Results, TrainMeta
from qcomm.benchmark.rows import TrainRow
from qcomm.benchmark.session import EXIT_CODEC_FAILED, Session
from qcomm.benchmark.timing import synchronize
from qcomm.ops import CommOp
from qcomm.registry import load_pair
from qcomm.specs import parse_registry_string
from qcomm.types import codec_info

__all__ = [
    "LOCAL",
    "Compiles",
    "MemoryEstimate",
    "Run",
    "TrainModel",
    "TrainSeries",
    "add_figures",
    "comm_share",
    "round_steps",
    "run_model",
    "series_group",
    "timed_row",
]

_RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value

#: the label of the reference series, each rank alone with no collective
LOCAL = "one rank, no collective"


@dataclasses.dataclass(frozen=True)
class TrainSeries:
    r"""
    One configuration of ``qcomm bench --train``.

    Args:
        label (str): its name in the report, e.g. ``"qcomm int8/bf16"``.
        kind (str): ``"fp32"``, ``"torchrec"`` (TorchRec's own codecs),
            ``"qcomm"`` (a :func:`~qcomm.build_registry` registry, or with
            ``--train-model mlp`` qcomm's DDP hook), ``"pytorch"`` (PyTorch's
            ``fp16_compress_hook``, ``--train-model mlp``) or ``"local"``.
        pair (str | None): the pooled all-to-all's ``forward/backward`` codecs,
            what series of different kinds are compared by; ``None``: no codec.
        registry (str | None): the qcomm registry string, ``None`` for none.
        dense (str | None): the codec of qcomm's DDP hook on the dense part
            (with error feedback), ``None`` for DDP's own all-reduce.
        torchrec_transport (bool): the registry's codecs travel on TorchRec's
            own transport, not on qcomm's exchange (TorchRec's own functions
            put back, :func:`~qcomm.torchrec_exchange.uninstall`, during the
            series' steps).
        overlap (bool): qcomm's DDP hook returns its future at once and the
            backward pass goes on; ``False``: the hook waits for it first.
        compile (str | None): the ``torch.compile`` backend of the model's
            dense part (``--train-compile``), ``None``: eager.
    """

    label: str
    kind: str
    pair: str | None = None
    registry: str | None = None
    dense: str | None = None
    torchrec_transport: bool = False
    overlap: bool = True
    compile: str | None = None

    @property
    def unsummable_reduce_scatter(self) -> bool:
        r"""
        unsummable_reduce_scatter() -> bool

        Whether the registry gives the reduce-scatter a forward codec whose
        wire cannot be summed, which only qcomm's exchange can carry.
        """
        if self.registry is None:
            return False
        pair = parse_registry_string(self.registry).get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        if pair is None:
            return False
        return not codec_info(load_pair(pair, _RS).forward).summable


def comm_share(local_s: float, step_s: float) -> float:
    r"""
    comm_share(local_s: float, step_s: float) -> float

    The share of a training step that is communication:
    :math:`1 - t_\text{local} / t_\text{step}`, where :math:`t_\text{local}`
    is the step on one rank alone (the same lookups, dense layers and
    optimizers, no collective). It counts all a step spends because it is
    distributed: the collectives, the codecs' work, TorchRec's input and
    output distribution, waiting for the slowest rank; noise can make it
    slightly negative.

    Args:
        local_s (float): the step's seconds on one rank alone.
        step_s (float): the distributed step's seconds.

    Examples::

        >>> comm_share(0.02, 0.08)
        0.75
    """
    return 1.0 - local_s / step_s


def round_steps(config: BenchConfig) -> list[int]:
    r"""
    round_steps(config: BenchConfig) -> list[int]

    The timed steps (those after the warm-up) of each round: ``--train-steps``
    less :data:`~qcomm.benchmark.options.TRAIN_WARM_UP_STEPS`, split over ``--rounds``.

    Args:
        config (BenchConfig): the run's settings.

    Examples::

        >>> round_steps(BenchConfig(train_steps=9, rounds=3))
        [3, 2, 2]
    """
    timed, rounds = config.train_steps - TRAIN_WARM_UP_STEPS, config.rounds
    return [timed // rounds + (1 if r < timed % rounds else 0) for r in range(rounds)]


@dataclasses.dataclass(frozen=True)
class Compiles:
    r"""
    What ``torch.compile`` did on a rank (``torch._dynamo``'s counters), or
    during a series' steps: graphs compiled and graph breaks.

    Args:
        graphs (int): graphs compiled.
        breaks (int): graph breaks.
    """

    graphs: int
    breaks: int

    @staticmethod
    def now() -> Compiles:
        r"""
        now() -> Compiles

        This process's totals so far.
        """
        if "torch._dynamo" not in sys.modules:
            return Compiles(0, 0)  # nothing compiled: not worth importing the compiler
        from torch._dynamo.utils import counters

        return Compiles(counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))

    def __add__(self, other: Compiles) -> Compiles:
        return Compiles(self.graphs + other.graphs, self.breaks + other.breaks)

    def __sub__(self, other: Compiles) -> Compiles:
        return Compiles(self.graphs - other.graphs, self.breaks - other.breaks)


@dataclasses.dataclass
class Run:
    r"""
    One series on this rank: its model and optimizer (the model's
    :meth:`TrainModel.build` sets them), the steps taken, their losses, the
    seconds per step of each round, and whether it ran.

    Args:
        series (TrainSeries): the series.
    """

    series: TrainSeries
    model: Any = None
    optimizer: Any = None
    step: int = 0
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    samples: list[float] = dataclasses.field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    compiles: Compiles = dataclasses.field(default_factory=lambda: Compiles(0, 0))


def series_group(session: Session, config: BenchConfig) -> Any:
    r"""
    series_group(session: Session, config: BenchConfig) -> ProcessGroup

    A process group of every rank for one series, with the run's timeout:
    each series on a group of its own, so that one that fails or times out
    leaves the others' groups as they were.

    Args:
        session (Session): this rank's device and process groups.
        config (BenchConfig): the run's settings.
    """
    timeout = datetime.timedelta(seconds=config.timeout)
    return dist.new_group(backend=session.backend, timeout=timeout)


@contextlib.contextmanager
def _transport(series: TrainSeries) -> Iterator[None]:
    # qcomm reads QCOMM_TORCHREC_COLLECTIVES once per install, at its first
    # call: TorchRec's own functions go back in place for the series' steps.
    if not series.torchrec_transport or not torchrec_exchange.installed():
        yield
        return
    torchrec_exchange.uninstall()
    try:
        yield
    finally:
        torchrec_exchange.install()


#: one training step of a run on a batch (forward, backward, optimizer), returning the loss
_StepFn = Callable[[Run, Any], torch.Tensor]


def _train(run: Run, batches: list[Any], steps: int, device: torch.device, step: _StepFn) -> float:
    # `steps` training steps; seconds per step on this rank.
    start = time.perf_counter()
    for _ in range(steps):
        run.losses.append(step(run, batches[run.step]).detach())
        run.step += 1
    synchronize(device)
    return (time.perf_counter() - start) / steps


def _block(
    session: Session, run: Run, batches: list[Any], steps: int, step: _StepFn
) -> float | None:
    # Steps after a barrier, so that every rank starts together; a step
    # ends when its slowest rank is done.
    def timed() -> float:
        # TorchRec's functions are swapped before the clock starts: the
        # swap (signature checks, a class built) is no part of a step.
        with _transport(run.series):
            dist.barrier(group=session.work)
            before = Compiles.now()
            seconds = _train(run, batches, steps, session.device, step)
            # Counted after the clock: what compiled during the steps.
            run.compiles += Compiles.now() - before
            return seconds

    times, problem = agreed(session, timed)
    if times is None:
        run.status, run.error = "failed", problem
        return None
    return float(max(times))


_Row = TypeVar("_Row", bound=TrainRow)


def timed_row(run: Run, row: _Row) -> _Row:
    r"""
    timed_row(run: Run, row: TrainRow) -> TrainRow

    ``row`` with its series' timings: the median round, the fastest and the
    slowest, every round and their spread; and what ``torch.compile`` did in
    its steps.

    Args:
        run (Run): the series as it ran.
        row (TrainRow): its row.
    """
    if run.status == "ok":
        row.compiled_graphs, row.graph_breaks = run.compiles.graphs, run.compiles.breaks
    if run.status == "ok" and run.samples:
        row.step_s = statistics.median(run.samples)
        row.step_min_s, row.step_max_s = min(run.samples), max(run.samples)
        row.samples_s = list(run.samples)
        row.spread = relative_spread(run.samples)
    return row


def _over(theirs: TrainRow | None, row: TrainRow) -> float | None:
    # Their step over the row's, where both ran.
    if theirs is None or theirs.step_s is None or row.step_s is None:
        return None
    return theirs.step_s / row.step_s


def add_figures(
    rows: list[_Row],
    losses: dict[str, list[float]],
    baseline: str,
    versus: Callable[[_Row, dict[str, _Row]], _Row | None],
) -> list[float | None]:
    r"""
    add_figures(rows: list[TrainRow], losses: dict[str, list[float]], baseline: str, versus: Callable) -> list[float | None]

    Sets the rows' speed-ups over the ``baseline`` series, their
    communication shares (against :data:`LOCAL`), and their losses with
    their gap to the baseline's, all of the same run.

    Args:
        rows (list[TrainRow]): the rows, with their timings.
        losses (dict[str, list[float]]): every step's loss of each series that ran.
        baseline (str): the label of the series the speed-ups are over.
        versus (Callable): a row's counterpart among the rows that ran (by label), or ``None``.

    Returns:
        list[float | None]: each row's speed-up over its counterpart, which
        the model sets under a name of its own.
    """
    ok = {r.label: r for r in rows if r.status == "ok"}
    base, local = ok.get(baseline), ok.get(LOCAL)
    out: list[float | None] = []
    for r in rows:
        out.append(_over(versus(r, ok), r) if r.status == "ok" else None)
        if r.status != "ok":
            continue
        r.speedup = _over(base, r)
        r.losses = losses[r.label]
        if r.kind == "local":
            continue  # each rank trained a model of its own: no loss to compare
        if local is not None and local.step_s is not None and r.step_s is not None:
            r.comm_share = comm_share(local.step_s, r.step_s)
        r.loss = r.losses[-1]
    for r in rows:
        if r.loss is not None and base is not None and base.loss is not None:
            r.loss_gap = r.loss - base.loss
    return out


def _route_setting() -> str | None:
    # How TorchRec's calls with qcomm codecs are routed, as the meta has said
    # it since it read the variable: null for the default, qcomm's exchange.
    value = qcomm_config.get().torchrec_collectives
    return None if value == qcomm_config.Settings().torchrec_collectives else value


def _train_meta(
    config: BenchConfig, session: Session, started: float, duration: float
) -> TrainMeta:
    return TrainMeta(
        **run_meta(session, started, duration),
        rounds=config.rounds,
        timeout_s=config.timeout,
        seed=config.seed,
        link=config.link,
        link_gbps=config.link_gbps,
        torchrec_collectives=_route_setting(),
        command=config.command,
    )


def _run_rounds(
    session: Session,
    config: BenchConfig,
    runs: list[Run],
    prepare: Callable[[], list[Any]],
    build: Callable[[Run], None],
    step: _StepFn,
) -> dict[str, list[float]] | None:
    # Every series of `runs` built (`build`), warmed up and timed in
    # interleaved rounds on this rank's batches (`prepare`); on rank 0 the
    # loss of every step of every series that ran, else None.
    blocks = round_steps(config)
    progress = Progress(session.rank == 0, 1 + 2 * len(runs) + len(blocks))
    try:
        begin(session, progress, "batches")
        batches = prepare()
        progress.done()
        for run in runs:
            begin(session, progress, f"{run.series.label}: build")
            build(run)
            progress.done()
        for run in runs:
            begin(session, progress, f"{run.series.label}: warm-up")
            if run.status == "ok":
                _block(session, run, batches, TRAIN_WARM_UP_STEPS, step)
            progress.done()
        # Rounds: every series takes its turn in each, so that a slow spell
        # of a shared machine falls on all of them alike, in an order drawn
        # from the seed (the same on every rank): a series always run after
        # the same one would pay for what that one leaves behind (caches).
        for r, steps in enumerate(blocks):
            begin(session, progress, f"round {r + 1}/{len(blocks)}")
            order = list(runs)
            random.Random(config.seed + r).shuffle(order)
            for run in order:
                seconds = _block(session, run, batches, steps, step) if run.status == "ok" else None
                if seconds is not None:
                    run.samples.append(seconds)
            progress.done()
        ok = [run for run in runs if run.status == "ok"]
        gathered = session.gather({run.series.label: [float(x) for x in run.losses] for run in ok})
        compiles = session.gather({run.series.label: run.compiles for run in ok})
    finally:
        progress.close()
    if session.rank != 0:
        return None
    # A rank that compiled more, or broke more graphs, speaks for the series.
    for run in ok:
        ranks = [rank[run.series.label] for rank in compiles]
        run.compiles = Compiles(max(c.graphs for c in ranks), max(c.breaks for c in ranks))
    # The loss of a step: the mean of every rank's, each on its own batch.
    return {
        label: [
            sum(rank[label][i] for rank in gathered) / len(gathered) for i in range(len(values))
        ]
        for label, values in gathered[0].items()
    }


def _report(
    config: BenchConfig,
    session: Session,
    started: float,
    clock: float,
    load_before: Any,
    train: DlrmTrain | MlpTrain,
) -> int:
    """Writes a --train run's report (rank 0 prints it) and returns its exit
    code; ``started`` and ``clock`` are the run's ``time.time()`` and
    ``time.perf_counter()`` at its start, ``train`` the model and the rows."""
    meta = _train_meta(config, session, started, time.perf_counter() - clock)
    meta.load_before, meta.load_after = load_before, load()
    link = LinkRate(spec=config.link, rate_bps=parse_rate(config.link)) if config.link else None
    results = Results(meta=meta, link=link, train=train)
    write_report(results, json_path=config.json_path)
    failed = any(r.status == "failed" and r.kind == "qcomm" for r in train.series)
    return EXIT_CODEC_FAILED if failed else 0


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    r"""
    What a rank of a ``--train`` model needs in memory, and what to say when
    a machine cannot hold it.

    Args:
        bytes_per_rank (float): the bytes a rank needs, about.
        options (str): the options that size it, e.g. ``"--train-tables, --train-dim"``.
        what (str): the model they make, e.g. ``"2 tables of dimension 8"``.
    """

    bytes_per_rank: float
    options: str
    what: str


class TrainModel(Protocol):
    r"""
    A model of ``qcomm bench --train``, as the harness (:func:`run_model`)
    drives it: its series, its memory estimate, its batches, how to build a
    series' model and take a step, and its results.
    """

    def series(self, config: BenchConfig) -> list[TrainSeries]:
        r"""
        series(config: BenchConfig) -> list[TrainSeries]

        The run's series, in the report's order.

        Args:
            config (BenchConfig): the run's settings.
        """
        ...

    def memory(self, config: BenchConfig) -> MemoryEstimate:
        r"""
        memory(config: BenchConfig) -> MemoryEstimate

        What a rank needs in memory (the command refuses what a machine cannot hold).

        Args:
            config (BenchConfig): the run's settings.
        """
        ...

    def prepare(self, session: Session, config: BenchConfig, runs: list[Run]) -> list[Any]:
        r"""
        prepare(session: Session, config: BenchConfig, runs: list[Run]) -> list[Any]

        This rank's batch of every step, the same for every series.

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
        """
        ...

    def build(self, session: Session, config: BenchConfig, run: Run) -> None:
        r"""
        build(session: Session, config: BenchConfig, run: Run) -> None

        Builds a series' model and optimizer into ``run``, or marks it failed or skipped.

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            run (Run): the series.
        """
        ...

    def step(self, run: Run, batch: Any) -> torch.Tensor:
        r"""
        step(run: Run, batch: Any) -> Tensor

        One training step of ``run`` on ``batch`` (forward, backward, optimizer); the loss.

        Args:
            run (Run): the series.
            batch (Any): this step's batch, one of those ``prepare`` made.
        """
        ...

    def results(
        self, config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]
    ) -> DlrmTrain | MlpTrain:
        r"""
        results(config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]) -> DlrmTrain | MlpTrain

        The ``train`` part of the results: the model, the rows with their figures.

        Args:
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
            losses (dict[str, list[float]]): every step's loss of each series that ran, mean over ranks.
        """
        ...


def run_model(model: TrainModel, config: BenchConfig, session: Session) -> int:
    r"""
    run_model(model: TrainModel, config: BenchConfig, session: Session) -> int

    Runs ``qcomm bench --train`` of ``model`` on this rank: builds every
    series' model, trains each for
    :data:`~qcomm.benchmark.options.TRAIN_WARM_UP_STEPS` untimed steps, then
    for the rest of ``config.train_steps`` in ``config.rounds`` rounds in
    which the series take turns; rank 0 then prints the table and writes the
    JSON.

    Args:
        model (TrainModel): the model.
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm series failed.
    """
    started, clock = time.time(), time.perf_counter()
    runs = [Run(s) for s in model.series(config)]
    load_before = load()
    losses = _run_rounds(
        session,
        config,
        runs,
        lambda: model.prepare(session, config, runs),
        lambda run: model.build(session, config, run),
        model.step,
    )
    if losses is None:
        return 0
    return _report(
        config, session, started, clock, load_before, model.results(config, runs, losses)
    )
