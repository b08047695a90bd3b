r"""
The FSDP2 mode of ``qcomm bench --train`` (``--train-model fsdp``, see
:doc:`/bench`, "Training steps"): the MLP of ``--train-model mlp`` with
every Linear under ``fully_shard``, with FSDP's own collectives in float32,
FSDP's bf16 mixed precision, and qcomm's (:func:`~qcomm.fsdp_quantize`:
int8 gradients with fp8 or int8 weights, with and without error feedback,
and with fp8 weights computing in bf16 under the same policy);
the rounds, timing and figures are those of :mod:`~qcomm.benchmark.train`.
"""

from __future__ import annotations

from typing import Any

import torch

import qcomm
from qcomm.benchmark.agreement import agreed_here
from qcomm.benchmark.harness import (
    LOCAL,
    Run,
    TrainSeries,
    run_model,
    series_group,
)
from qcomm.benchmark.options import BenchConfig
from qcomm.benchmark.rows import MlpRow
from qcomm.benchmark.session import Session
from qcomm.benchmark.train_mlp import LEARNING_RATE, Mlp

__all__ = ["BF16", "DEFAULT", "QCOMM_BF16", "Fsdp", "fsdp_series", "run_train_fsdp"]

#: the label of the series with FSDP's own collectives, in float32
DEFAULT = "FSDP float32"
#: the label of the series with FSDP's ``MixedPrecisionPolicy(bf16, bf16)``
BF16 = "FSDP bf16 mixed precision"

#: the label of the qcomm series that computes in bf16, as FSDP's bf16 mixed precision does
QCOMM_BF16 = "qcomm int8 grads + fp8 weights, bf16 compute"

# Each qcomm series' label: its gradients' codec, its weights' codec, error
# feedback, and whether it computes in bf16.
_QCOMM = {
    "qcomm int8 grads + fp8 weights": ("int8", "fp8_e4m3", False, False),
    "qcomm int8 grads + fp8 weights + error feedback": ("int8", "fp8_e4m3", True, False),
    "qcomm int8 grads + int8 weights": ("int8", "int8", False, False),
    "qcomm int8 grads + int8 weights + error feedback": ("int8", "int8", True, False),
    QCOMM_BF16: ("int8", "fp8_e4m3", False, True),
}


def fsdp_series() -> list[TrainSeries]:
    r"""
    fsdp_series() -> list[TrainSeries]

    The series of ``--train-model fsdp``, in the report's order.

    Examples::

        >>> [s.label for s in fsdp_series()][:3]
        ['one rank, no collective', 'FSDP float32', 'FSDP bf16 mixed precision']
        >>> fsdp_series()[3].dense
        'int8'
    """
    series = [
        TrainSeries(LOCAL, "local"),
        TrainSeries(DEFAULT, "fp32"),
        TrainSeries(BF16, "pytorch"),
    ]
    series += [TrainSeries(label, "qcomm", dense=g) for label, (g, *_) in _QCOMM.items()]
    return series


def _model(
    series: TrainSeries, config: BenchConfig, group: Any, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The MLP, every Linear and the whole under fully_shard on `group` with
    # the series' collectives (no group: alone).
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from qcomm.benchmark.train_mlp import _mlp

    model = _mlp(config, device)
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type)
        policy = MixedPrecisionPolicy()
        if series.kind == "pytorch" or _QCOMM.get(series.label, (None,) * 4)[3]:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # Each layer's all-gather starts before the previous layer computes
        # (FSDP2's explicit forward prefetch; the backward pass prefetches
        # by itself): on CPU only an all-gather that returns at once, as
        # qcomm's does, overlaps.
        linears: list[Any] = [m for m in model if isinstance(m, torch.nn.Linear)]
        for layer, after in zip(linears, linears[1:]):
            layer.set_modules_to_forward_prefetch([after])
        if series.kind == "qcomm":
            gradients, weights, feedback, _ = _QCOMM[series.label]
            qcomm.fsdp_quantize(
                model, gradients=gradients, weights=weights, error_feedback=feedback
            )
    return model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def _build(session: Session, config: BenchConfig, run: Run) -> None:
    group = None if run.series.kind == "local" else series_group(session, config)
    built, problem = agreed_here(session, lambda: _model(run.series, config, group, session.device))
    if built is None:
        run.status, run.error = "failed", problem
    else:
        run.model, run.optimizer = built


def _collectives(series: TrainSeries) -> str | None:
    if series.kind == "pytorch":
        return "FSDP bf16/bf16"
    if series.kind == "qcomm":
        gradients, weights, feedback, bf16 = _QCOMM[series.label]
        return (
            f"qcomm {gradients}/{weights}"
            + ("+ef" if feedback else "")
            + (", bf16" if bf16 else "")
        )
    return None


def _bf16(row: MlpRow, ok: dict[str, MlpRow]) -> MlpRow | None:
    return ok.get(BF16)


# Copies of the MLP's parameters a rank holds, sharded or whole: every series'
# shards, gradients and residuals, the layer being computed whole, and the
# reference's weights and gradients (whole).
_FSDP_COPIES = 16


class Fsdp(Mlp):
    r"""
    The MLP under ``fully_shard`` as a model of the ``--train`` harness
    (:class:`~qcomm.benchmark.harness.TrainModel`): one series per way of
    moving weights and gradients (:func:`fsdp_series`); its batches, steps
    and results are the MLP's (:class:`~qcomm.benchmark.train_mlp.Mlp`), the
    model named ``fsdp``, its memory that of fewer parameter copies, a row's ``ddp_hook`` holding its series'
    collectives and ``vs_fp16_hook`` its speed-up over FSDP's bf16 mixed
    precision.
    """

    _name = "fsdp"
    _collectives = staticmethod(_collectives)
    _baseline = DEFAULT
    _reference = staticmethod(_bf16)
    _copies = _FSDP_COPIES

    def series(self, config: BenchConfig) -> list[TrainSeries]:
        r"""
        series(config: BenchConfig) -> list[TrainSeries]

        The run's series (:func:`fsdp_series`).

        Args:
            config (BenchConfig): the run's settings.
        """
        return fsdp_series()

    def build(self, session: Session, config: BenchConfig, run: Run) -> None:
        r"""
        build(session: Session, config: BenchConfig, run: Run) -> None

        Builds a series' MLP under ``fully_shard`` with its collectives (the reference's alone).

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            run (Run): the series.
        """
        _build(session, config, run)


def run_train_fsdp(config: BenchConfig, session: Session) -> int:
    r"""
    run_train_fsdp(config: BenchConfig, session: Session) -> int

    Runs ``qcomm bench --train --train-model fsdp`` on this rank
    (:func:`~qcomm.benchmark.harness.run_model` of an :class:`Fsdp`).

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm series failed.
    """
    return run_model(Fsdp(), config, session)
