"""Helpers for the TorchRec end-to-end tests: CPU sharders, sharded test models, weight loading, a call-counting codec wrapper,
and the global synthetic batch every rank rebuilds from one seed."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import qcomm


def cpu_sharders(
    registry: dict[str, qcomm.QuantizedCommCodecs] | None, lr: float
) -> tuple[Any, Any]:
    """An EBC and an EC sharder with ``registry`` and fused exact SGD at ``lr``.

    TorchRec's EBC sharder leaves row-wise out on CPU; the subclass adds it
    back so that a CPU run reaches TorchRec's pooled reduce-scatter.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class RowWiseCpuEBCSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            return [*types, ShardingType.ROW_WISE.value] if "row_wise" not in types else types

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    return (
        RowWiseCpuEBCSharder(fused_params=fused, qcomm_codecs_registry=registry),
        EmbeddingCollectionSharder(fused_params=fused, qcomm_codecs_registry=registry),
    )


class PooledModel(nn.Module):
    """An EmbeddingBagCollection whose output is the pooled ``[batch, dim_sum]`` tensor."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.emb = ebc

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.emb(kjt).values()


class SequenceModel(nn.Module):
    """An EmbeddingCollection whose output is every looked-up row, features in
    ``keys`` order, samples in batch order: ``[num_ids, dim]``."""

    def __init__(self, ec: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.emb = ec
        self.keys = keys

    def forward(self, kjt: Any) -> torch.Tensor:
        out = self.emb(kjt)
        return torch.cat([out[k].values() for k in self.keys])


def load_global_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copies full tables ``{table: [rows, dim]}`` into a model, sharded or not.

    A sharded table appears in ``state_dict`` as a ShardedTensor whose local
    shards are views of the fused kernel's storage; each gets its slice.
    """
    with torch.no_grad():
        for key, value in model.state_dict().items():
            table = key.split(".")[-2]
            if table not in weights:
                continue
            full = weights[table]
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
            else:
                value.copy_(full)


class Counts:
    """A codec's counters, out of its plain attributes: qcomm's statuses
    describe a codec by those, and counters that differ between ranks (the
    paddings do) would read as codecs that differ."""

    def __init__(self) -> None:
        self.encodes = 0
        self.max_padding = 0


class CountingCodec:
    """Wraps a codec, counts ``encode`` calls, remembers the largest column
    padding it asked for, and passes everything through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = qcomm.codec_info(inner)
        self.counts = Counts()

    @property
    def encodes(self) -> int:
        return self.counts.encodes

    @property
    def max_padding(self) -> int:
        return self.counts.max_padding

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        self.counts.encodes += 1
        return self.inner.encode(input_tensor, ctx)

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        return self.inner.decode(input_grad, ctx)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self.inner.quantized_dtype

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        return self.inner.calc_quantized_size(input_len, ctx)

    def create_context(self) -> Any | None:
        return self.inner.create_context()

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        padded, padding = self.inner.padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)
        self.counts.max_padding = max(self.counts.max_padding, padding)
        return padded, padding


class BitCastFP8Codec:
    """An FP8 (e4m3) cast sent as its raw bytes, shape kept, no scale: what
    TorchRec's own tensor-wise FP8 comm does. Its wire is not summable: adding
    the bytes of two FP8 numbers does not give the bytes of their sum."""

    def __init__(self) -> None:
        self.info = qcomm.CodecInfo(
            name="fp8_bitcast",
            bits_per_element=8.0,
            summable=False,
            rel_error_bound=2.0**-4,
            abs_error_bound=2.0**-10,  # half the smallest subnormal step, 2**-9
            max_abs_input=448.0,
        )

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        return input_tensor.to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        return input_grad.view(torch.float8_e4m3fn).to(torch.float32)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return dim_per_rank[my_rank], 0


@dataclasses.dataclass
class Batch:
    """A global batch of sparse features: ``lengths[f, b]`` ids of feature
    ``keys[f]`` for sample ``b``; ``values[f]`` all of them in sample order."""

    keys: list[str]
    lengths: torch.Tensor
    values: list[torch.Tensor]

    @staticmethod
    def random(
        keys: list[str], rows: list[int], batch: int, max_len: int, gen: torch.Generator
    ) -> Batch:
        """Random bags of 0..``max_len`` ids; feature ``f`` draws from ``rows[f]`` rows."""
        lengths = torch.randint(0, max_len + 1, (len(keys), batch), generator=gen)
        values = [
            torch.randint(0, n, (int(lengths[f].sum()),), generator=gen) for f, n in enumerate(rows)
        ]
        return Batch(keys, lengths, values)

    def kjt(self, lo: int, hi: int) -> Any:
        """The KeyedJaggedTensor of samples ``lo..hi-1``."""
        from torchrec import KeyedJaggedTensor

        starts = [int(self.lengths[f, :lo].sum()) for f in range(len(self.keys))]
        ends = [int(self.lengths[f, :hi].sum()) for f in range(len(self.keys))]
        values = torch.cat([v[s:e] for v, s, e in zip(self.values, starts, ends)])
        return KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=values, lengths=self.lengths[:, lo:hi].reshape(-1)
        )

    def sequence_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Indices, into the global ``SequenceModel`` output, of the rows of
        samples ``lo..hi-1`` in that model's local output order."""
        pieces, base = [], 0
        for f in range(len(self.keys)):
            start = base + int(self.lengths[f, :lo].sum())
            pieces.append(torch.arange(start, base + int(self.lengths[f, :hi].sum())))
            base += int(self.lengths[f].sum())
        return torch.cat(pieces)


#: the tables of small_dlrm: table-wise on rank 0, on rank 1, row-wise
DLRM_TABLES = ("t0", "t1", "t2")


def small_dlrm(
    rank: int, world: int, registry: Any, *, dim: int, rows: int, dense: int
) -> tuple[Any, torch.optim.Optimizer]:
    """
    TorchRec's ``DLRMTrain`` under ``DistributedModelParallel`` on the CPU,
    with the codecs of ``registry`` (a registry string, or a registry): the tables of
    :data:`DLRM_TABLES` (table-wise on ranks 0 and 1, row-wise), the same
    weights on every call, and SGD on the dense part.
    """
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    codecs = qcomm.build_registry(registry) if isinstance(registry, str) else registry
    torch.manual_seed(0)  # the dense layers
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"])
        for t in DLRM_TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dense,
            dense_arch_layer_sizes=[8, dim],
            over_arch_layer_sizes=[8, 1],
            dense_device=torch.device("cpu"),
        )
    )
    sharder, _ = cpu_sharders(codecs, 0.1)
    per_table = {
        "t0": table_wise(rank=0, compute_kernel="fused"),
        "t1": table_wise(rank=1, compute_kernel="fused"),
        "t2": row_wise(compute_kernel="fused"),
    }
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not hasattr(value, "local_shards"):
                continue
            table = key.split(".")[-2]
            gen = torch.Generator().manual_seed(zlib.crc32(table.encode()))
            full = torch.rand(rows, dim, generator=gen) - 0.5
            for shard in value.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    params = [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
    return dmp, torch.optim.SGD(params, lr=0.1)


def dlrm_batches(rank: int, steps: int, *, batch: int, rows: int, dense: int) -> list[Any]:
    """``steps`` TorchRec batches of :func:`small_dlrm`'s features for ``rank``, from fixed seeds."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        lengths = torch.randint(1, 3, (len(DLRM_TABLES) * batch,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in DLRM_TABLES], values=values, lengths=lengths
        )
        features = torch.randn(batch, dense, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense_features=features, sparse_features=kjt, labels=labels))
    return out
