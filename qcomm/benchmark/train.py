r"""
The training-step benchmark of ``qcomm bench --train`` (see :doc:`/bench`,
"Training steps"): TorchRec's DLRM sharded by ``DistributedModelParallel``
over the bench's ranks, trained with each configuration of codecs (a
:class:`TrainSeries`) in turn, every one from the same weights on the same
batches, and timed step by step in interleaved rounds.

By default half the tables are sharded table-wise (TorchRec's pooled
all-to-all) and half row-wise (its pooled reduce-scatter), so both embedding
collectives carry each series' codecs, forward and backward
(``--train-sharding`` shards them all one way); the dense part's gradients
go through the ``DistributedDataParallel`` that TorchRec wraps it in. A
reference series trains the same model on each rank alone, unsharded and
with no collective, which gives the step's communication share
(:func:`comm_share`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import qcomm
from qcomm import torchrec_exchange
from qcomm.benchmark.agreement import agreed, agreed_here
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.meta import load, run_meta
from qcomm.benchmark.metrics import relative_spread
from qcomm.benchmark.options import TRAIN_ROWS as ROWS
from qcomm.benchmark.options import TRAIN_WARM_UP_STEPS, BenchConfig
from qcomm.benchmark.progress import Progress, begin
from qcomm.benchmark.report import write_report
from qcomm.benchmark.rows import DlrmRow, TrainRow
from qcomm.benchmark.session import EXIT_CODEC_FAILED, Session
from qcomm.benchmark.timing import synchronize
from qcomm.types import CommOp

__all__ = [
    "LOCAL",
    "TrainSeries",
    "advice_pick",
    "comm_share",
    "link_gbps",
    "run_train",
    "train_series",
]

#: the label of the reference series, each rank alone with no collective
LOCAL = "one rank, no collective"

DENSE_FEATURES = 13  # as in the Criteo data DLRM was made for
MAX_IDS = 7  # ids per bag: 1 to 7, uniformly
# The tables' fused SGD and the dense part's SGD. At TorchRec's default of
# 0.01 the loss hardly moves in a run's few dozen steps, and every gap to
# fp32 would be float32 rounding.
LEARNING_RATE = 1.0
# The teacher's logit: the dense features' part and each table's part, so
# that most of what there is to learn goes through the embeddings.
DENSE_SIGNAL = 0.5
TABLE_SIGNAL = 2.0

_A2A = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value
_RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value
_SEQ = CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value
# TorchRec's reduce-scatter cannot take its INT8 codec (fbgemm's INT8 encode
# needs a context that the reduce-scatter does not pass): there it takes
# what TorchRec itself falls back to for formats it cannot reduce-scatter.
_TORCHREC_RS_FALLBACK = ("fp16", "bf16")
# What keeps qcomm's codecs on TorchRec's own transport in TorchRec.
_TRANSPORT_ENV = torchrec_exchange.ENV
# Links up to this rate get the advice rule's codecs (see advice_pick).
_ADVICE_MAX_GBPS = 10.0


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
    """

    label: str
    kind: str
    pair: str | None = None
    registry: str | None = None
    dense: str | None = None
    torchrec_transport: bool = False
    overlap: bool = True

    @property
    def unsummable_reduce_scatter(self) -> bool:
        r"""
        unsummable_reduce_scatter() -> bool

        Whether the registry gives the reduce-scatter a forward codec whose
        wire cannot be summed, which only qcomm's exchange can carry.
        """
        if self.registry is None:
            return False
        pairs = dict(item.split("=", 1) for item in self.registry.split(","))
        forward = pairs.get(_RS, "noop").split("/")[0]
        return forward not in ("noop", "fp16", "bf16")


def _qcomm_registry(a2a: str, rs: str) -> str:
    return f"{_A2A}={a2a},{_RS}={rs},{_SEQ}={a2a}"


def link_gbps(config: BenchConfig) -> float | None:
    r"""
    link_gbps(config: BenchConfig) -> float | None

    The link the advice is for, in Gbit/s: ``--link-gbps``, else the
    ``--link`` rate, else ``None`` (loopback, or a launcher's network of
    unknown rate).

    Args:
        config (BenchConfig): the run's settings.
    """
    if config.link_gbps:
        return config.link_gbps
    return parse_rate(config.link) / 1e9 if config.link else None


def advice_pick(gbit_per_s: float | None) -> str | None:
    r"""
    advice_pick(gbit_per_s: float | None) -> str | None

    The codecs the advice of ``qcomm bench`` picks for a link, by a rule:
    the advice itself needs every codec's collectives measured on their
    own, which a training run does not do. On links up to 10 Gbit/s, where
    the bench's runs on 2-core machines found the wire to be the limit and
    int8 to pay (x2.8 at 1 Gbit/s, x1.2-1.4 at 10), the all-to-all takes
    int8 forward; the backward and the reduce-scatter take a 16-bit cast,
    as the advice's own rules say (gradients' errors add up; TorchRec sums
    the reduce-scatter's wire). On faster links, and on loopback, where the
    link is memory, no codec.

    Args:
        gbit_per_s (float | None): the link's rate, ``None`` for loopback.

    Returns:
        str | None: a registry string for :func:`~qcomm.build_registry`, or
        ``None`` for no codec.

    Examples::

        >>> advice_pick(1.0)
        'pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=bf16/bf16,sequence_embeddings_all_to_all=int8/bf16'
        >>> advice_pick(None), advice_pick(100.0)
        (None, None)
    """
    if gbit_per_s is None or gbit_per_s > _ADVICE_MAX_GBPS:
        return None
    return _qcomm_registry("int8/bf16", "bf16/bf16")


def train_series(config: BenchConfig) -> list[TrainSeries]:
    r"""
    train_series(config: BenchConfig) -> list[TrainSeries]

    The series of a ``--train`` run, in the report's order (each round
    runs them in an order of its own, drawn from the seed): float32, TorchRec's codecs (left out with ``--no-fbgemm``), qcomm's
    registries, qcomm's DDP hook on top of one, the advice's pick
    (:func:`advice_pick`), and the reference :data:`LOCAL`.

    Args:
        config (BenchConfig): the run's settings.

    Examples::

        >>> [s.label for s in train_series(BenchConfig(train=True, fbgemm=False))]
        ['fp32', 'qcomm fp16/fp16', 'qcomm int8/bf16', 'qcomm int8/bf16, TorchRec transport', 'qcomm fp16/fp16 + DDP int8', 'advice: no codec', 'one rank, no collective']
    """
    series = [TrainSeries("fp32", "fp32")]
    if config.fbgemm:
        series += [TrainSeries(f"torchrec {p}", "torchrec", p) for p in ("fp16/fp16", "int8/bf16")]
    # qcomm's own reduce-scatter carries int8, so it keeps the pair there too.
    series += [
        TrainSeries(f"qcomm {p}", "qcomm", p, _qcomm_registry(p, p))
        for p in ("fp16/fp16", "int8/bf16")
    ]
    # qcomm's codecs on TorchRec's transport, in TorchRec's formats (its
    # reduce-scatter cannot carry int8): against "torchrec int8/bf16", only
    # the codecs' code differs; against "qcomm int8/bf16", the transport.
    series.append(
        TrainSeries(
            "qcomm int8/bf16, TorchRec transport",
            "qcomm",
            "int8/bf16",
            _qcomm_registry("int8/bf16", "/".join(_TORCHREC_RS_FALLBACK)),
            torchrec_transport=True,
        )
    )
    # The hook on a registry that TorchRec's own transport can carry too, so
    # that it runs wherever the others do.
    series.append(
        TrainSeries(
            "qcomm fp16/fp16 + DDP int8",
            "qcomm",
            "fp16/fp16",
            _qcomm_registry("fp16/fp16", "fp16/fp16"),
            dense="int8",
        )
    )
    pick = advice_pick(link_gbps(config))
    if pick is None:
        series.append(TrainSeries("advice: no codec", "fp32"))
    else:
        pair = pick.split(",")[0].split("=")[1]
        series.append(TrainSeries(f"advice: {pair}", "qcomm", pair, pick))
    return [*series, TrainSeries(LOCAL, "local")]


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


def _round_steps(config: BenchConfig) -> list[int]:
    # The timed steps (those after the warm-up) split over the rounds.
    timed, rounds = config.train_steps - TRAIN_WARM_UP_STEPS, config.rounds
    return [timed // rounds + (1 if r < timed % rounds else 0) for r in range(rounds)]


@dataclasses.dataclass
class _Batch:
    dense: torch.Tensor
    sparse: Any  # KeyedJaggedTensor
    labels: torch.Tensor


def _features(tables: int) -> list[str]:
    return [f"f{t}" for t in range(tables)]


def _batches(config: BenchConfig, rank: int, device: torch.device) -> list[_Batch]:
    # This rank's batch of every step, the same for every series. Labels
    # come from a hidden teacher (a score per row of every table, and a
    # linear function of the dense features) so that the loss can fall.
    from torchrec import KeyedJaggedTensor

    tables, n = config.train_tables, config.train_batch
    teacher = torch.Generator().manual_seed(config.seed)
    scores = TABLE_SIGNAL * torch.randn(tables, ROWS, generator=teacher)
    weights = DENSE_SIGNAL * torch.randn(DENSE_FEATURES, generator=teacher)
    out = []
    for step in range(config.train_steps):
        gen = torch.Generator().manual_seed(config.seed + 1_000_003 * (1 + step) + rank)
        lengths = torch.randint(1, MAX_IDS + 1, (tables, n), generator=gen)
        # Skewed ids (small ids are frequent), as in real traffic.
        ids = (ROWS * torch.rand(int(lengths.sum()), generator=gen) ** 3).long()
        dense = torch.randn(n, DENSE_FEATURES, generator=gen)
        bags = torch.repeat_interleave(torch.arange(tables * n), lengths.reshape(-1))
        table_of = torch.arange(tables).repeat_interleave(n)[bags]
        sums = torch.zeros(tables * n).index_add_(0, bags, scores[table_of, ids])
        per_table = (sums / lengths.reshape(-1)).reshape(tables, n).sum(0)
        logit = dense @ weights + per_table / math.sqrt(tables)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=_features(tables), values=ids, lengths=lengths.reshape(-1)
        )
        out.append(_Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


def _table_weights(config: BenchConfig, table: int) -> torch.Tensor:
    # A table's initial weights, drawn like TorchRec's default init but from
    # the seed, so that every series starts from the same point.
    gen = torch.Generator().manual_seed(config.seed + 7919 * (1 + table))
    bound = math.sqrt(1.0 / ROWS)
    return (torch.rand(ROWS, config.train_dim, generator=gen) * 2 - 1) * bound


def _load_tables(model: torch.nn.Module, config: BenchConfig) -> None:
    # A sharded table is a ShardedTensor in the state dict, whose local
    # shards are views of the fused kernel's storage: each gets its slice.
    with torch.no_grad():
        for key, value in model.state_dict().items():
            name = key.split(".")[-2]
            if not (name.startswith("t") and name[1:].isdigit()):
                continue
            full = _table_weights(config, int(name[1:]))
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
            else:
                value.copy_(full)


def _dlrm(config: BenchConfig, ebc: Any, device: torch.device) -> Any:
    from torchrec.models.dlrm import DLRM

    dim = config.train_dim
    torch.manual_seed(config.seed)  # the dense layers' initial weights
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_FEATURES,
        dense_arch_layer_sizes=[2 * dim, dim],
        over_arch_layer_sizes=[256, 64, 1],
        dense_device=device,
    )


def _table_configs(config: BenchConfig) -> list[Any]:
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=config.train_dim, num_embeddings=ROWS, feature_names=[f]
        )
        for t, f in enumerate(_features(config.train_tables))
    ]


def _torchrec_registry(pair: str) -> Any:
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs,
        get_qcomm_codecs_registry,
    )

    def config(forward: str, backward: str) -> Any:
        return QCommsConfig(
            forward_precision=CommType(forward), backward_precision=CommType(backward)
        )

    forward, backward = pair.split("/")
    # No device: given "cpu", TorchRec would turn BF16 into FP16, which gloo
    # (torch 2.13) carries as well.
    registry = get_qcomm_codecs_registry(config(forward, backward))
    if forward == "int8":
        rs = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name
        registry[rs] = get_qcomm_codecs(config(*_TORCHREC_RS_FALLBACK))
    return registry


def _sharder(registry: Any) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    # TorchRec's sharder leaves row-wise out on CPU; it runs there all the same.
    class Sharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types: list[str] = super().sharding_types(compute_device_type)
            row_wise = ShardingType.ROW_WISE.value
            return types if row_wise in types else [*types, row_wise]

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
    return Sharder(fused_params=fused, qcomm_codecs_registry=registry)


def table_wise_count(config: BenchConfig) -> int:
    r"""
    table_wise_count(config: BenchConfig) -> int

    How many of the tables ``--train-sharding`` shards table-wise (the first
    ones); the rest are sharded row-wise.

    Args:
        config (BenchConfig): the run's settings.

    Examples::

        >>> table_wise_count(BenchConfig(train_tables=5)), table_wise_count(BenchConfig(train_tables=5, train_sharding="row_wise"))
        (3, 0)
    """
    tables = config.train_tables
    return {"table_wise": tables, "row_wise": 0}.get(config.train_sharding, (tables + 1) // 2)


def _sharded_model(
    series: TrainSeries, config: BenchConfig, group: Any, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The series' DLRM under DistributedModelParallel on `group`, and the
    # optimizer of its dense part (the tables' is fused into them).
    from torch.nn.parallel import DistributedDataParallel
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    if series.kind == "torchrec":
        registry = _torchrec_registry(str(series.pair))
    elif series.registry is not None:
        registry = qcomm.build_registry(series.registry, allow_unsummable_reduce_scatter=True)
    else:
        registry = None
    world = group.size()
    tables = config.train_tables
    ebc = EmbeddingBagCollection(tables=_table_configs(config), device=torch.device("meta"))
    model = _dlrm(config, ebc, device)
    sharder = _sharder(registry)
    # The first ones table-wise, round-robin over the ranks; the rest row-wise.
    per_table = {
        f"t{t}": table_wise(rank=t % world, compute_kernel="fused")
        if t < table_wise_count(config)
        else row_wise(compute_kernel="fused")
        for t in range(tables)
    }
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world,
        device_type=device.type,
    )  # fmt: skip
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(group),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        device=device,
    )
    if series.dense is not None:
        ddp = next(m for m in dmp.modules() if isinstance(m, DistributedDataParallel))
        state, hook = qcomm.ddp_comm_hook(series.dense, error_feedback=True)
        ddp.register_comm_hook(state, hook)
    _load_tables(dmp, config)
    dense = [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
    return dmp, torch.optim.SGD(dense, lr=LEARNING_RATE)


def _local_model(
    config: BenchConfig, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The same DLRM on this rank alone: every table whole, in the same
    # fbgemm kernel with the same fused SGD, and no collective at all.
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    ebc = FusedEmbeddingBagCollection(
        tables=_table_configs(config),
        optimizer_type=torch.optim.SGD,
        optimizer_kwargs={"lr": LEARNING_RATE},
        device=device,
    )
    model = _dlrm(config, ebc, device)
    _load_tables(model, config)
    dense = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
    return model, torch.optim.SGD(dense, lr=LEARNING_RATE)


@dataclasses.dataclass
class _Run:
    # One series on this rank: its model, where it is, what it measured.
    series: TrainSeries
    model: Any = None
    optimizer: Any = None
    step: int = 0
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    samples: list[float] = dataclasses.field(default_factory=list)
    status: str = "ok"
    error: str | None = None


def _group(session: Session, config: BenchConfig) -> Any:
    # Every series on a group of its own: one that fails or times out
    # leaves the others' groups as they were.
    timeout = datetime.timedelta(seconds=config.timeout)
    return dist.new_group(backend=session.backend, timeout=timeout)


def _build(session: Session, config: BenchConfig, run: _Run, refused: str | None) -> None:
    if run.series.unsummable_reduce_scatter and refused is not None:
        run.status = "skipped"
        run.error = (
            "int8 on the reduce-scatter needs qcomm's exchange under TorchRec's collectives; "
            f"TorchRec's own transport, which sums the wire, ran it here ({refused})"
        )
        return
    if run.series.kind == "local":
        built, problem = agreed_here(session, lambda: _local_model(config, session.device))
    else:
        group = _group(session, config)
        built, problem = agreed_here(
            session, lambda: _sharded_model(run.series, config, group, session.device)
        )
    if built is None:
        run.status, run.error = "failed", problem
    else:
        run.model, run.optimizer = built


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


#: one training step of a run on a batch: forward, backward, optimizer; the loss
_StepFn = Callable[[_Run, Any], torch.Tensor]


def _dlrm_step(run: _Run, batch: _Batch) -> torch.Tensor:
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        run.model(batch.dense, batch.sparse).squeeze(-1), batch.labels
    )
    run.optimizer.zero_grad()
    torch.autograd.backward(loss)  # the tables' fused optimizer steps in here
    run.optimizer.step()
    return loss


def _train(run: _Run, batches: list[Any], steps: int, device: torch.device, step: _StepFn) -> float:
    # `steps` training steps; seconds per step on this rank.
    start = time.perf_counter()
    with _transport(run.series):
        for _ in range(steps):
            run.losses.append(step(run, batches[run.step]).detach())
            run.step += 1
        synchronize(device)
    return (time.perf_counter() - start) / steps


def _block(
    session: Session, run: _Run, batches: list[Any], steps: int, step: _StepFn
) -> float | None:
    # Steps after a barrier, so that every rank starts together; a step
    # ends when its slowest rank is done.
    def timed() -> float:
        dist.barrier(group=session.work)
        return _train(run, batches, steps, session.device, step)

    times, problem = agreed(session, timed)
    if times is None:
        run.status, run.error = "failed", problem
        return None
    return float(max(times))


def _reduce_scatter_check(session: Session, group: Any) -> str | None:
    # Whether TorchRec's reduce-scatter, given an int8 qcomm codec, sums
    # right (None) or not (why): only qcomm's exchange can carry a wire that
    # cannot be summed. Checked on a one-table row-wise model.
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    world, device = group.size(), session.device
    rows, dim, bags = 8 * world, 8, 4
    registry = qcomm.build_registry(f"{_RS}=int8/bf16", allow_unsummable_reduce_scatter=True)
    sharder = _sharder(registry)
    table = EmbeddingBagConfig(
        name="t0", embedding_dim=dim, num_embeddings=rows, feature_names=["f0"]
    )
    ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc, {"t0": row_wise(compute_kernel="fused")}, sharder=sharder, local_size=world,
        world_size=world, device_type=device.type,
    )  # fmt: skip
    model = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(group), plan=ShardingPlan({"": plan}),
        sharders=[sharder], device=device,
    )  # fmt: skip
    full = 1.0 + torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim) / (rows * dim)
    with torch.no_grad():
        for value in model.state_dict().values():
            for shard in value.local_shards():
                first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                shard.tensor.copy_(full[first : first + count])
    # Two ids per bag, far apart: every bag sums rows of more than one rank.
    ids = (torch.arange(2 * bags) * (rows // 2) // bags + session.rank) % rows
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0"], values=ids, lengths=torch.full((bags,), 2)
    )
    try:
        with torch.no_grad():
            out = model(sparse.to(device)).values().cpu()
    except Exception as err:
        return f"{type(err).__name__}: {_first_line(str(err))}"
    exact = full[ids].reshape(bags, 2, dim).sum(1)
    error = float((out - exact).abs().max() / exact.abs().max())
    # int8 with row-wise scales is off by well under 1%; a summed wire, by far more.
    return None if error < 0.05 else f"its sums are off by {error:.2g} of their scale"


def _refused(session: Session, config: BenchConfig) -> str | None:
    # Why qcomm's exchange does not carry TorchRec's reduce-scatter (None: it does).
    group = _group(session, config)
    outcome, problem = agreed(session, lambda: _reduce_scatter_check(session, group))
    if outcome is None:
        return _first_line(problem)
    reasons = [f"rank {rank}: {why}" for rank, why in enumerate(outcome) if why]
    return reasons[0] if reasons else None


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else "unknown error"


_Row = TypeVar("_Row", bound=TrainRow)


def _row(run: _Run, row: _Row) -> _Row:
    # `row` with its series' timings.
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


def _add_figures(
    rows: list[_Row],
    losses: dict[str, list[float]],
    baseline: str,
    versus: Callable[[_Row, dict[str, _Row]], _Row | None],
) -> list[float | None]:
    # Speed-ups over the baseline series (`speedup`), communication shares,
    # and losses with their gap to the baseline's, all in the same run.
    # Returns each row's speed-up over its counterpart of `versus`, which the
    # caller sets under its model's name.
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


def _torchrec_counterpart(row: DlrmRow, ok: dict[str, DlrmRow]) -> DlrmRow | None:
    # A qcomm series' TorchRec series with the same pooled all-to-all pair.
    if row.kind != "qcomm":
        return None
    return next((r for r in ok.values() if r.kind == "torchrec" and r.pair == row.pair), None)


def _meta(config: BenchConfig, session: Session, started: float, duration: float) -> dict[str, Any]:
    return {
        **run_meta(session, started, duration),
        "rounds": config.rounds,
        "timeout_s": config.timeout,
        "seed": config.seed,
        "link": config.link,
        "link_gbps": config.link_gbps,
        _TRANSPORT_ENV: os.environ.get(_TRANSPORT_ENV),
        "command": config.command,
    }


def _run_rounds(
    session: Session,
    config: BenchConfig,
    runs: list[_Run],
    prepare: Callable[[], list[Any]],
    build: Callable[[_Run], None],
    step: _StepFn,
) -> dict[str, list[float]] | None:
    # Every series of `runs` built (`build`), warmed up and timed in
    # interleaved rounds on this rank's batches (`prepare`); on rank 0 the
    # loss of every step of every series that ran, else None.
    blocks = _round_steps(config)
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
    finally:
        progress.close()
    if session.rank != 0:
        return None
    # The loss of a step: the mean of every rank's, each on its own batch.
    return {
        label: [
            sum(rank[label][i] for rank in gathered) / len(gathered) for i in range(len(values))
        ]
        for label, values in gathered[0].items()
    }


def run_train(config: BenchConfig, session: Session) -> int:
    r"""
    run_train(config: BenchConfig, session: Session) -> int

    Runs ``qcomm bench --train`` on this rank: builds every series' model,
    trains each for :data:`~qcomm.benchmark.options.TRAIN_WARM_UP_STEPS`
    untimed steps, then for the rest of ``config.train_steps`` in
    ``config.rounds`` rounds in which the series take turns; rank 0 then
    prints the table and writes the JSON.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm series failed.
    """
    started, clock = time.time(), time.perf_counter()
    runs = [_Run(s) for s in train_series(config)]
    load_before = load()
    refused: str | None = None

    def prepare() -> list[_Batch]:
        nonlocal refused
        batches = _batches(config, session.rank, session.device)
        if any(run.series.unsummable_reduce_scatter for run in runs):
            refused = _refused(session, config)
        return batches

    losses = _run_rounds(
        session,
        config,
        runs,
        prepare,
        lambda run: _build(session, config, run, refused),
        _dlrm_step,
    )
    if losses is None:
        return 0
    rows = [
        _row(
            run,
            DlrmRow(
                label=run.series.label,
                kind=run.series.kind,
                pair=run.series.pair,
                registry=run.series.registry,
                ddp_hook=f"{run.series.dense}+ef" if run.series.dense else None,
                torchrec_transport=run.series.torchrec_transport,
                status=run.status,
                error=run.error,
            ),
        )
        for run in runs
    ]
    for row, ratio in zip(rows, _add_figures(rows, losses, "fp32", _torchrec_counterpart)):
        row.vs_torchrec = ratio
    gbps = link_gbps(config)
    train = {
        "model": {
            "name": "dlrm",
            "tables": config.train_tables,
            "table_wise": table_wise_count(config),
            "row_wise": config.train_tables - table_wise_count(config),
            "rows": ROWS,
            "dim": config.train_dim,
            "batch_per_rank": config.train_batch,
            "dense_features": DENSE_FEATURES,
            "ids_per_bag": [1, MAX_IDS],
            "learning_rate": LEARNING_RATE,
            "steps": config.train_steps,
            "warm_up_steps": TRAIN_WARM_UP_STEPS,
            "steps_per_round": _round_steps(config),
        },
        "advice": {"gbit_per_s": gbps, "registry": advice_pick(gbps)},
        "reduce_scatter_on_qcomm": refused is None,
        "reduce_scatter_refused": refused,
        "series": rows,
    }
    return _report(config, session, started, clock, load_before, train)


def _report(
    config: BenchConfig,
    session: Session,
    started: float,
    clock: float,
    load_before: Any,
    train: dict[str, Any],
) -> int:
    """Writes a --train run's report (rank 0 prints it) and returns its exit
    code; ``started`` and ``clock`` are the run's ``time.time()`` and
    ``time.perf_counter()`` at its start, ``train`` the model and the rows."""
    meta = _meta(config, session, started, time.perf_counter() - clock)
    meta.update(load_before=load_before, load_after=load())
    results = {
        "meta": meta,
        "link": {"spec": config.link, "rate_bps": parse_rate(config.link)} if config.link else None,
        "train": train,
    }
    write_report(results, json_path=config.json_path)
    failed = any(r.status == "failed" and r.kind == "qcomm" for r in train["series"])
    return EXIT_CODEC_FAILED if failed else 0
