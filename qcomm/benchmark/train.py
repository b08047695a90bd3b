r"""
The training-step benchmark of ``qcomm bench --train`` (see :doc:`/bench`,
"Training steps"): TorchRec's DLRM sharded by ``DistributedModelParallel``
over the bench's ranks, trained with each configuration of codecs (a
:class:`~qcomm.benchmark.harness.TrainSeries`) in turn, every one from the same weights on the same
batches, and timed step by step in interleaved rounds; by default in
TorchRec's ``TrainPipelineSparseDist`` (``--train-loop``), with
``--train-compile`` compiled twins of three series whose dense part runs
under ``torch.compile``.

By default half the tables are sharded table-wise (TorchRec's pooled
all-to-all) and half row-wise (its pooled reduce-scatter), so both embedding
collectives carry each series' codecs, forward and backward
(``--train-sharding`` shards them all one way); the dense part's gradients
go through the ``DistributedDataParallel`` that TorchRec wraps it in. A
reference series trains the same model on each rank alone, unsharded and
with no collective, which gives the step's communication share
(:func:`~qcomm.benchmark.harness.comm_share`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

import qcomm
from qcomm import torchrec_exchange
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
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.options import TRAIN_ROWS as ROWS
from qcomm.benchmark.options import TRAIN_WARM_UP_STEPS, BenchConfig
from qcomm.benchmark.results import DlrmModel, DlrmTrain, TrainPick
from qcomm.benchmark.rows import DlrmRow
from qcomm.benchmark.session import Session
from qcomm.benchmark.train_adaptive import ADAPTIVE, settled
from qcomm.benchmark.train_plan import table_generators
from qcomm.specs import parse_pair_spec, parse_registry_string
from qcomm.types import CommOp

__all__ = [
    "Dlrm",
    "advice_pick",
    "link_gbps",
    "run_train",
    "train_series",
]

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

_PIPELINE = "pipeline"

_A2A = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value
_RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value
_SEQ = CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value
# TorchRec's reduce-scatter cannot take its INT8 codec (fbgemm's INT8 encode
# needs a context that the reduce-scatter does not pass): there it takes
# what TorchRec itself falls back to for formats it cannot reduce-scatter.
_TORCHREC_RS_FALLBACK = ("fp16", "bf16")
# Links up to this rate get the advice rule's codecs (see advice_pick).
_ADVICE_MAX_GBPS = 10.0


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
    registries (one of them :data:`~qcomm.benchmark.train_adaptive.ADAPTIVE`), qcomm's DDP hook on top of one, the advice's pick
    (:func:`advice_pick`), with ``--train-compile`` the compiled twins of
    float32 and of both int8/bf16 series, and the reference
    :data:`~qcomm.benchmark.harness.LOCAL`.

    Args:
        config (BenchConfig): the run's settings.

    Examples::

        >>> [s.label for s in train_series(BenchConfig(train=True, fbgemm=False))]
        ['fp32', 'qcomm fp16/fp16', 'qcomm int8/bf16', 'qcomm adaptive:mx4|int8|bf16', 'qcomm int8/bf16, TorchRec transport', 'qcomm fp16/fp16 + DDP int8', 'advice: no codec', 'one rank, no collective']
    """
    series = [TrainSeries("fp32", "fp32")]
    if config.fbgemm:
        series += [TrainSeries(f"torchrec {p}", "torchrec", p) for p in ("fp16/fp16", "int8/bf16")]
    # qcomm's own reduce-scatter carries int8, so it keeps the pair there too.
    series += [
        TrainSeries(f"qcomm {p}", "qcomm", p, _qcomm_registry(p, p))
        for p in ("fp16/fp16", "int8/bf16")
    ]
    # Each call's codec chosen by the errors the calls measure, on qcomm's
    # exchange only (TorchRec's transport carries no status).
    series.append(
        TrainSeries(f"qcomm {ADAPTIVE}", "qcomm", ADAPTIVE, _qcomm_registry(ADAPTIVE, ADAPTIVE))
    )
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
        pair = parse_registry_string(pick)[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL]
        series.append(TrainSeries(f"advice: {pair}", "qcomm", pair, pick))
    if config.train_compile:
        # Compiled twins of no codec and of both int8/bf16 series: against
        # their eager selves, what compiling buys; against each other, qcomm
        # over TorchRec with the same compiled dense part.
        twins = {"fp32", "torchrec int8/bf16", "qcomm int8/bf16"}
        series += [
            dataclasses.replace(s, label=f"{s.label}, compiled", compile=config.train_compile)
            for s in series
            if s.label in twins
        ]
    return [*series, TrainSeries(LOCAL, "local")]


def _features(tables: int) -> list[str]:
    return [f"f{t}" for t in range(tables)]


def _batches(config: BenchConfig, rank: int, device: torch.device) -> list[Any]:
    # This rank's batch of every step (TorchRec's Batch, which its pipeline
    # can move and prefetch), the same for every series. Labels come from a
    # hidden teacher (a score per row of every table, and a linear function
    # of the dense features) so that the loss can fall.
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

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
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
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
    # DLRMTrain: a batch in, the BCE loss out, as TorchRec's pipeline calls it.
    from torchrec.models.dlrm import DLRM, DLRMTrain

    dim = config.train_dim
    torch.manual_seed(config.seed)  # the dense layers' initial weights
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[2 * dim, dim],
            over_arch_layer_sizes=[256, 64, 1],
            dense_device=device,
        )
    )


def _compile_dense(model: torch.nn.Module, backend: str) -> None:
    # The parts of the DLRM that are not sharded, compiled in place (their
    # parameters keep their names); the sharded embeddings stay eager.
    from torchrec.models.dlrm import DLRM

    dlrm = next(m for m in model.modules() if isinstance(m, DLRM))
    for part in (dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch):
        part.compile(backend=backend)


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

    forward, backward = parse_pair_spec(pair, "TorchRec's codecs")
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
    ones); the rest are sharded row-wise. With ``--train-plan``, how many
    the plan shards table-wise.

    Args:
        config (BenchConfig): the run's settings.

    Examples::

        >>> table_wise_count(BenchConfig(train_tables=5)), table_wise_count(BenchConfig(train_tables=5, train_sharding="row_wise"))
        (3, 0)
    """
    tables = config.train_tables
    if config.train_plan:
        return sum(spec.startswith("table_wise") for spec in config.train_plan.values())
    return {"table_wise": tables, "row_wise": 0}.get(config.train_sharding, (tables + 1) // 2)


def sharding_counts(config: BenchConfig) -> dict[str, int]:
    r"""
    sharding_counts(config: BenchConfig) -> dict[str, int]

    How many tables the run shards each way: table-wise, row-wise and
    column-wise, as ``--train-plan`` gives them, else as
    :func:`table_wise_count` splits them.

    Args:
        config (BenchConfig): the run's settings.

    Returns:
        dict[str, int]: the tables by sharding type (``"table_wise"``,
        ``"row_wise"``, ``"column_wise"``).

    Examples::

        >>> sharding_counts(BenchConfig(train_tables=3, train_plan={"t0": "table_wise:0", "t1": "column_wise:0,1", "t2": "row_wise"}))
        {'table_wise': 1, 'row_wise': 1, 'column_wise': 1}
    """
    counts = dict.fromkeys(("table_wise", "row_wise", "column_wise"), 0)
    if config.train_plan:
        for spec in config.train_plan.values():
            counts[spec.partition(":")[0]] += 1
        return counts
    counts["table_wise"] = table_wise_count(config)
    counts["row_wise"] = config.train_tables - counts["table_wise"]
    return counts


def _series_registry(series: TrainSeries) -> Any:
    # The series' codecs: TorchRec's registry, qcomm's, or None.
    if series.kind == "torchrec":
        return _torchrec_registry(str(series.pair))
    if series.registry is not None:
        return qcomm.build_registry(series.registry, allow_unsummable_reduce_scatter=True)
    return None


def _sharded_model(
    series: TrainSeries, registry: Any, config: BenchConfig, group: Any, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The series' DLRM with `registry` under DistributedModelParallel on
    # `group`, and the optimizer of its dense part (the tables' is fused into them).
    from torch.nn.parallel import DistributedDataParallel
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    world = group.size()
    tables = config.train_tables
    ebc = EmbeddingBagCollection(tables=_table_configs(config), device=torch.device("meta"))
    model = _dlrm(config, ebc, device)
    sharder = _sharder(registry)
    # The first ones table-wise, round-robin over the ranks; the rest row-wise.
    per_table = (
        table_generators(config.train_plan)
        if config.train_plan
        else {
            f"t{t}": table_wise(rank=t % world, compute_kernel="fused")
            if t < table_wise_count(config)
            else row_wise(compute_kernel="fused")
            for t in range(tables)
        }
    )
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world,
        device_type=device.type,
    )  # fmt: skip
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(group),
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        device=device,
    )
    if series.dense is not None:
        ddp = next(m for m in dmp.modules() if isinstance(m, DistributedDataParallel))
        state, hook = qcomm.ddp_comm_hook(series.dense, error_feedback=True)
        ddp.register_comm_hook(state, hook)
    _load_tables(dmp, config)
    if series.compile is not None:
        _compile_dense(dmp, series.compile)
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


def _build(
    session: Session,
    config: BenchConfig,
    run: Run,
    refused: str | None,
    registries: dict[str, Any],
) -> None:
    # Builds the series into `run`, keeping its registry in `registries`.
    if run.series.unsummable_reduce_scatter and refused is not None:
        run.status = "skipped"
        run.error = (
            f"{run.series.pair} on the reduce-scatter needs qcomm's exchange under TorchRec's "
            "collectives; "
            f"TorchRec's own transport, which sums the wire, ran it here ({refused})"
        )
        return
    if run.series.kind == "local":
        built, problem = agreed_here(session, lambda: _local_model(config, session.device))
    else:
        group = series_group(session, config)

        def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            registry = registries[run.series.label] = _series_registry(run.series)
            return _sharded_model(run.series, registry, config, group, session.device)

        built, problem = agreed_here(session, sharded)
    if built is None:
        run.status, run.error = "failed", problem
    else:
        run.model, run.optimizer = built


def _plain_step(run: Run, batch: Any) -> torch.Tensor:
    loss: torch.Tensor = run.model(batch)[0]
    run.optimizer.zero_grad()
    torch.autograd.backward(loss)  # the tables' fused optimizer steps in here
    run.optimizer.step()
    return loss


def _pipeline(run: Run, device: torch.device) -> Any:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    return TrainPipelineSparseDist(run.model, run.optimizer, device)


def _pipeline_counts(pipeline: Any) -> tuple[int | None, int | None]:
    # What the pipeline itself says it did: batches loaded, and sharded
    # modules whose input distribution it took over (TorchRec's own fields).
    batches = getattr(pipeline, "_batch_count", None)
    modules = getattr(pipeline, "_pipelined_modules", None)
    return batches, None if modules is None else len(modules)


def _refused() -> str | None:
    # Why TorchRec's reduce-scatter with a qcomm codec would not run on
    # qcomm's exchange (None: it would), as qcomm routes it; the exchange is
    # installed first, as building the series' registries does.
    torchrec_exchange.install()
    route = torchrec_exchange.route(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
    return None if route.transport == "qcomm" else route.reason


def _torchrec_counterpart(row: DlrmRow, ok: dict[str, DlrmRow]) -> DlrmRow | None:
    # A qcomm series' TorchRec series with the same pooled all-to-all pair,
    # compiled alike.
    if row.kind != "qcomm":
        return None
    return next(
        (
            r
            for r in ok.values()
            if r.kind == "torchrec" and r.pair == row.pair and r.compile == row.compile
        ),
        None,
    )


def _eager_twin(row: DlrmRow, ok: dict[str, DlrmRow]) -> DlrmRow | None:
    # A compiled series' eager self.
    if row.compile is None:
        return None
    return ok.get(row.label.removesuffix(", compiled"))


# Models a rank of --train holds: a shard of each sharded series' model (9),
# and the whole model of the reference series; the batches' activations and
# gradients take a few dozen floats per sample and embedding column.
_TRAIN_MODELS = 9
_COMPILED_TWINS = 3
_TRAIN_FLOATS_PER_ACTIVATION = 32


class Dlrm:
    r"""
    TorchRec's DLRM as a model of the ``--train`` harness
    (:class:`~qcomm.benchmark.harness.TrainModel`): sharded by
    ``DistributedModelParallel``, one series per configuration of codecs
    (:func:`train_series`). One per run: it keeps whether TorchRec's
    reduce-scatter runs on qcomm's exchange, and with ``--train-loop
    pipeline`` each series' ``TrainPipelineSparseDist``.
    """

    def __init__(self) -> None:
        # Why qcomm's exchange does not carry TorchRec's reduce-scatter (None: it does).
        self.refused: str | None = None
        # Each series' pipeline and the one iterator over the batches it
        # draws from: the pipeline holds the next batch between blocks, as
        # between any two steps.
        self.pipelines: dict[str, tuple[Any, Iterator[Any]]] = {}
        self.batches: list[Any] = []
        # Each series' registry: an adaptive one's calls say where it settled.
        self.registries: dict[str, Any] = {}

    def series(self, config: BenchConfig) -> list[TrainSeries]:
        r"""
        series(config: BenchConfig) -> list[TrainSeries]

        The run's series (:func:`train_series`).

        Args:
            config (BenchConfig): the run's settings.
        """
        return train_series(config)

    def memory(self, config: BenchConfig) -> MemoryEstimate:
        r"""
        memory(config: BenchConfig) -> MemoryEstimate

        The tables of the sharded and the reference models, and the activations.

        Args:
            config (BenchConfig): the run's settings.
        """
        columns = config.train_tables * config.train_dim
        models = _TRAIN_MODELS + (_COMPILED_TWINS if config.train_compile else 0)
        tables = 4 * ROWS * columns * (models / config.world_size + 1)
        activations = (
            4 * _TRAIN_FLOATS_PER_ACTIVATION * config.world_size * config.train_batch * columns
        )
        return MemoryEstimate(
            tables + activations,
            "--train-tables, --train-dim, --train-batch",
            f"{config.train_tables} tables of dimension {config.train_dim} and a batch of "
            f"{config.train_batch}",
        )

    def prepare(self, session: Session, config: BenchConfig, runs: list[Run]) -> list[Any]:
        r"""
        prepare(session: Session, config: BenchConfig, runs: list[Run]) -> list[Any]

        This rank's batches; where a series needs it, how TorchRec's reduce-scatter runs.

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
        """
        self.batches = _batches(config, session.rank, session.device)
        if any(run.series.unsummable_reduce_scatter for run in runs):
            self.refused = _refused()
        return self.batches

    def build(self, session: Session, config: BenchConfig, run: Run) -> None:
        r"""
        build(session: Session, config: BenchConfig, run: Run) -> None

        Builds a series' sharded model (or the reference's) and, with
        ``--train-loop pipeline``, its pipeline; or skips it.

        Args:
            session (Session): this rank's device and process groups.
            config (BenchConfig): the run's settings.
            run (Run): the series.
        """
        _build(session, config, run, self.refused, self.registries)
        # The reference has no sharded module for the pipeline to take over
        # (TorchRec's pipeline cannot trace it): it keeps the plain loop.
        if run.status == "ok" and config.train_loop == _PIPELINE and run.series.kind != "local":
            self.pipelines[run.series.label] = (
                _pipeline(run, session.device),
                iter(self.batches),
            )

    def step(self, run: Run, batch: Any) -> torch.Tensor:
        r"""
        step(run: Run, batch: Any) -> Tensor

        A step: forward, BCE loss, backward (the tables' optimizer steps in
        it), SGD; in TorchRec's pipeline, which also starts the next batch's
        input distribution and draws ``batch`` itself from the series'
        iterator over the same batches.

        Args:
            run (Run): the series.
            batch (Any): this step's batch, one of those ``prepare`` made.
        """
        piped = self.pipelines.get(run.series.label)
        if piped is None:
            return _plain_step(run, batch)
        pipeline, batches = piped
        loss: torch.Tensor = pipeline.progress(batches)[0]
        return loss

    def results(
        self, config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]
    ) -> DlrmTrain:
        r"""
        results(config: BenchConfig, runs: list[Run], losses: dict[str, list[float]]) -> DlrmTrain

        The model, the advice's pick, the reduce-scatter's route and the
        rows; the adaptive series' with where its codecs settled.

        Args:
            config (BenchConfig): the run's settings.
            runs (list[Run]): every series of the run.
            losses (dict[str, list[float]]): every step's loss of each series that ran, mean over ranks.
        """
        rows = [
            timed_row(
                run,
                DlrmRow(
                    label=run.series.label,
                    kind=run.series.kind,
                    pair=run.series.pair,
                    registry=run.series.registry,
                    ddp_hook=f"{run.series.dense}+ef" if run.series.dense else None,
                    torchrec_transport=run.series.torchrec_transport,
                    compile=run.series.compile,
                    status=run.status,
                    error=run.error,
                ),
            )
            for run in runs
        ]
        for row in rows:
            if row.label in self.pipelines:
                counts = _pipeline_counts(self.pipelines[row.label][0])
                row.pipelined_batches, row.pipelined_modules = counts
        for row in rows:
            if row.status == "ok" and row.pair == ADAPTIVE:
                # Every rank chose alike from the same statuses: rank 0's calls say it.
                history = qcomm.error_history(self.registries[row.label])
                row.settled, row.codec_shares, row.switches = settled(history)
        for row, ratio in zip(rows, add_figures(rows, losses, "fp32", _torchrec_counterpart)):
            row.vs_torchrec = ratio
        ok = {r.label: r for r in rows if r.status == "ok"}
        for row in rows:
            twin = _eager_twin(row, ok) if row.status == "ok" else None
            if twin is not None and twin.step_s and row.step_s:
                row.vs_eager = twin.step_s / row.step_s
        gbps = link_gbps(config)
        shardings = sharding_counts(config)
        model = DlrmModel(
            tables=config.train_tables,
            table_wise=shardings["table_wise"],
            row_wise=shardings["row_wise"],
            column_wise=shardings["column_wise"] or None,
            plan=config.train_plan,
            rows=ROWS,
            dim=config.train_dim,
            batch_per_rank=config.train_batch,
            dense_features=DENSE_FEATURES,
            ids_per_bag=[1, MAX_IDS],
            learning_rate=LEARNING_RATE,
            steps=config.train_steps,
            warm_up_steps=TRAIN_WARM_UP_STEPS,
            steps_per_round=round_steps(config),
            loop=config.train_loop,
        )
        return DlrmTrain(
            model=model,
            advice=TrainPick(gbit_per_s=gbps, registry=advice_pick(gbps)),
            reduce_scatter_on_qcomm=self.refused is None,
            reduce_scatter_refused=self.refused,
            series=rows,
        )


def run_train(config: BenchConfig, session: Session) -> int:
    r"""
    run_train(config: BenchConfig, session: Session) -> int

    Runs ``qcomm bench --train`` of the DLRM on this rank
    (:func:`~qcomm.benchmark.harness.run_model` of a :class:`Dlrm`).

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.

    Returns:
        int: ``0``, or on rank 0 :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED`
        when a qcomm series failed.
    """
    return run_model(Dlrm(), config, session)
