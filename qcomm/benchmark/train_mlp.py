r"""
The dense-model mode of ``qcomm bench --train`` (``--train-model mlp``, see
:doc:`/bench`, "Training steps"): a plain MLP trained by every rank under
``torch.nn.parallel.DistributedDataParallel``, with no comm hook, PyTorch's
``fp16_compress_hook`` and qcomm's int8 hook with error feedback, overlapped
and waited for; the rounds, timing and figures are those of
:mod:`~qcomm.benchmark.train`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import qcomm
from qcomm.benchmark.agreement import agreed_here
from qcomm.benchmark.harness import (
    LOCAL,
    MemoryEstimate,
    Run,
    TrainSeries,
    add_figures,
    round_steps,
    run_model,
    series_group,
    timed_row,
)
from qcomm.benchmark.options import TRAIN_WARM_UP_STEPS, BenchConfig
from qcomm.benchmark.results import MlpModel, MlpTrain
from qcomm.benchmark.rows import MlpRow
from qcomm.benchmark.session import Session

__all__ = [
    "DEFAULT_HOOK",
    "FP16_HOOK",
    "Mlp",
    "OUTPUTS",
    "QCOMM_HOOK",
    "QCOMM_BY_HOST",
    "QCOMM_SYNC",
    "mlp_parameters",
    "mlp_series",
    "run_train_mlp",
]

#: the label of the series with DDP's own all-reduce
DEFAULT_HOOK = "default hook"
#: the label of the series with PyTorch's ``fp16_compress_hook``
FP16_HOOK = "fp16_compress_hook"
#: the label of the series with qcomm's int8 hook, overlapped with the backward pass
QCOMM_HOOK = "qcomm int8 + error feedback"
#: the label of the series with qcomm's int8 hook, each bucket waited for
QCOMM_SYNC = "qcomm int8 + error feedback, synchronous"
#: the label of the series with qcomm's hook by host (``--ranks-per-host``)
QCOMM_BY_HOST = "qcomm int8 between hosts + error feedback"

#: the MLP's outputs, the regression target's width
OUTPUTS = 16
# Plain SGD on MSE. The network is He-initialised, so that its output starts
# at the target's scale; at 0.01, wide networks overshoot on the first step.
LEARNING_RATE = 0.001
_TEACHER_SEED = 7919  # added to --seed: the target's weights, apart from the model's


def mlp_series(ranks_per_host: int | None = None) -> list[TrainSeries]:
    r"""
    mlp_series(ranks_per_host: int | None = None) -> list[TrainSeries]

    The series of ``--train-model mlp``, in the report's order (each round
    runs them in an order of its own, drawn from the seed); with hosts of
    several ranks (``--ranks-per-host``), also qcomm's hook by host: no codec
    inside a host, int8 between hosts (a hierarchical all-reduce).

    Args:
        ranks_per_host (int, optional): ``--ranks-per-host``. Default: ``None``.

    Examples::

        >>> [s.label for s in mlp_series()]
        ['one rank, no collective', 'default hook', 'fp16_compress_hook', 'qcomm int8 + error feedback', 'qcomm int8 + error feedback, synchronous']
        >>> mlp_series(2)[-1].dense
        'same_host=noop+other_host=int8'
    """
    series = [
        TrainSeries(LOCAL, "local"),
        TrainSeries(DEFAULT_HOOK, "fp32"),
        TrainSeries(FP16_HOOK, "pytorch"),
        TrainSeries(QCOMM_HOOK, "qcomm", dense="int8"),
        TrainSeries(QCOMM_SYNC, "qcomm", dense="int8", overlap=False),
    ]
    if ranks_per_host is not None and ranks_per_host > 1:
        series.append(TrainSeries(QCOMM_BY_HOST, "qcomm", dense="same_host=noop+other_host=int8"))
    return series


def mlp_parameters(layers: int, width: int) -> int:
    r"""
    mlp_parameters(layers: int, width: int) -> int

    The parameters of the MLP of ``--train-model mlp``: ``layers`` hidden
    layers of ``width`` (Linear and ReLU) on ``width`` input features, and a
    linear output of :data:`OUTPUTS`; DDP all-reduces a gradient of each
    every step.

    Args:
        layers (int): ``--train-layers``.
        width (int): ``--train-width``.

    Examples::

        >>> mlp_parameters(8, 2048)
        33603600
    """
    return layers * (width * width + width) + width * OUTPUTS + OUTPUTS


def _mlp(config: BenchConfig, device: torch.device) -> torch.nn.Sequential:
    # He-initialised from the seed, the same for every series: PyTorch's
    # default init shrinks the signal of a deep ReLU stack layer by layer.
    width, hidden = config.train_width, config.train_layers
    sizes = [width] * (hidden + 1) + [OUTPUTS]
    gen = torch.Generator().manual_seed(config.seed)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        linear = torch.nn.Linear(fan_in, fan_out, device="meta").to_empty(device=device)
        gain = 2.0 if i < hidden else 1.0  # a ReLU follows, or the output
        with torch.no_grad():
            weight = torch.randn(fan_out, fan_in, generator=gen) * math.sqrt(gain / fan_in)
            linear.weight.copy_(weight)
            linear.bias.zero_()
        layers += [linear, torch.nn.ReLU()] if i < hidden else [linear]
    return torch.nn.Sequential(*layers)


def _batches(
    config: BenchConfig, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # This rank's inputs and targets of every step, the same for every
    # series; the target is a fixed random linear map of the input.
    width = config.train_width
    teacher = torch.Generator().manual_seed(config.seed + _TEACHER_SEED)
    weights = torch.randn(width, OUTPUTS, generator=teacher) / math.sqrt(width)
    out = []
    for step in range(config.train_steps):
        gen = torch.Generator().manual_seed(config.seed + 1_000_003 * (1 + step) + rank)
        inputs = torch.randn(config.train_batch, width, generator=gen)
        out.append((inputs.to(device), (inputs @ weights).to(device)))
    return out


def _waited(future: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    future.wait()
    return future


def _model(
    series: TrainSeries, config: BenchConfig, group: Any, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The MLP, under DDP on `group` with the series' hook (no group: alone).
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    model: torch.nn.Module = _mlp(config, device)
    if group is not None:
        ids = [device] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, process_group=group)
        if series.kind == "pytorch":
            ddp.register_comm_hook(group, fp16_compress_hook)
        elif series.kind == "qcomm":
            state, hook = qcomm.ddp_comm_hook(
                series.dense, error_feedback=True, process_group=group
            )
            # A lambda, as DDP refuses a hook whose annotations are not its
            # own types (strings, here); DDP reads the name "bucket".
            ddp.register_comm_hook(
                state,
                hook if series.overlap else lambda state, bucket: _waited(hook(state, bucket)),
            )
        model = ddp
    return model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def _build(session: Session, config: BenchConfig, run: Run) -> None:
    group = None if run.series.kind == "local" else series_group(session, config)
    built, problem = agreed_here(session, lambda: _model(run.series, config, group, session.device))
    if built is None:
        run.status, run.error = "failed", problem
    else:
        run.model, run.optimizer = built


def _mlp_step(run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(run.model(inputs), targets)
    run.optimizer.zero_grad()
    torch.autograd.backward(loss)
    run.optimizer.step()
    return loss


def _hook_name(series: TrainSeries) -> str | None:
    if series.kind == "pytorch":
        return FP16_HOOK
    if series.kind == "qcomm":
        return f"qcomm {series.dense}+ef" + ("" if series.overlap else ", waited")
    return None


def _fp16_hook(row: MlpRow, ok: dict[str, MlpRow]) -> MlpRow | None:
    return ok.get(FP16_HOOK)


# Copies of the MLP's parameters a rank of --train-model mlp holds: weights,
# gradients and DDP's buckets of its 4 DDP series, the qcomm series' residuals
# and codec buffers, the reference's weights and gradients, and what the
# allocator keeps (up to 3.7 GB a rank measured at 8 layers of 2048: 27 copies).
_MLP_COPIES = 28
# Floats per sample and layer width of a step: what the forward keeps for the
# backward, their gradients, and the allocator's cache (2.2 GB a rank measured
# at 8 layers of 512 and a batch of 8192).
_MLP_FLOATS_PER_ACTIVATION = 12


class Mlp:
    r"""
    The MLP under ``DistributedDataParallel`` as a model of the ``--train``
    harness (:class:`~qcomm.benchmark.harness.TrainModel`): one series per
    communication hook (:func:`mlp_series`).
    """

    # What the results name and compare, which a model on the MLP's batches
    # and steps (FSDP's) gives its own: the model's name, what a row's
    # ``ddp_hook`` says of its series, the series every speed-up is over, and
    # the one ``vs_fp16_hook`` is over; and the copies of the parameters a
    # rank holds (memory()).
    _name = "mlp"
    _collectives = staticmethod(_hook_name)
    _baseline = DEFAULT_HOOK
    _reference = staticmethod(_fp16_hook)
    _copies = _MLP_COPIES

    def series(self, config: BenchConfig) -> list[TrainSeries]:
        r"""
        series(config: BenchConfig) -> list[TrainSeries]

        The run's series (:func:`mlp_series`).

        Args:
            config (BenchConfig): the run's settings.
        """
        return mlp_series(config.ranks_per_host)

    def memory(self, config: BenchConfig) -> MemoryEstimate:
        r"""
        memory(config: BenchConfig) -> MemoryEstimate

        The parameters' copies, the batches and the activations.

        Args:
            config (BenchConfig): the run's settings.
        """
        layers, width, batch = config.train_layers, config.train_width, config.train_batch
        floats = (
            self._copies * mlp_parameters(layers, width)
            + config.train_steps * batch * (width + OUTPUTS)
            + _MLP_FLOATS_PER_ACTIVATION * batch * width * (layers + 1)
        )
        return MemoryEstimate(
            4.0 * floats,
            "--train-layers, --train-width, --train-batch, --train-steps",
            f"{layers} layers of {width} and {config.train_steps} batches of {batch}",
        )

    def prepare(
        self, session: Session, config: BenchConfig, runs: list[Run]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        r"""
        prepare(session: Session, config: BenchConfig, runs: list[Run]) -> list[Any]

        This rank's inputs and targets of every step.

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
        """
        return _batches(config, session.rank, session.device)

    def build(self, session: Session, config: BenchConfig, run: Run) -> None:
        r"""
        build(session: Session, config: BenchConfig, run: Run) -> None

        Builds a series' MLP under DDP with its hook (the reference's alone).

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            run (Run): the series.
        """
        _build(session, config, run)

    def step(self, run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r"""
        step(run: Run, batch: Any) -> Tensor

        A step: forward, MSE loss, backward (DDP's all-reduce in it), SGD.

        Args:
            run (Run): the series.
            batch (Any): this step's batch, one of those ``prepare`` made.
        """
        return _mlp_step(run, batch)

    def results(
        self, config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]
    ) -> MlpTrain:
        r"""
        results(config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]) -> MlpTrain

        The model and the rows.

        Args:
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
            losses (dict[str, list[float]]): every step's loss of each series that ran, mean over ranks.
        """
        rows = [
            timed_row(
                run,
                MlpRow(
                    label=run.series.label,
                    kind=run.series.kind,
                    ddp_hook=self._collectives(run.series),
                    status=run.status,
                    error=run.error,
                ),
            )
            for run in runs
        ]
        for row, ratio in zip(rows, add_figures(rows, losses, self._baseline, self._reference)):
            row.vs_fp16_hook = ratio
        parameters = mlp_parameters(config.train_layers, config.train_width)
        model = MlpModel(
            name=self._name,
            layers=config.train_layers,
            width=config.train_width,
            outputs=OUTPUTS,
            parameters=parameters,
            gradient_bytes=4 * parameters,
            batch_per_rank=config.train_batch,
            learning_rate=LEARNING_RATE,
            steps=config.train_steps,
            warm_up_steps=TRAIN_WARM_UP_STEPS,
            steps_per_round=round_steps(config),
        )
        return MlpTrain(model=model, series=rows)


def run_train_mlp(config: BenchConfig, session: Session) -> int:
    r"""
    run_train_mlp(config: BenchConfig, session: Session) -> int

    Runs ``qcomm bench --train --train-model mlp`` on this rank
    (:func:`~qcomm.benchmark.harness.run_model` of an :class:`Mlp`), as
    :func:`~qcomm.benchmark.train.run_train` runs the DLRM.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm series failed.
    """
    return run_model(Mlp(), config, session)
