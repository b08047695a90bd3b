"""TorchRec's DLRM under ``DistributedModelParallel`` with a qcomm registry
and its dense part compiled (the dense arch, the interaction and the over
arch, each with ``fullgraph=True``; the sharded embeddings stay eager, as
TorchRec's own ``DLRM.enable_cuda_graph`` leaves them), on 2 gloo ranks.

Trained from the same weights on the same batches once eager and once
compiled: every step's pooled all-to-all and reduce-scatter ran on qcomm's
exchange (counted), the compiled part traced without a graph break, and the
losses are the eager run's. Both runs use the same codecs on the same
exchange, so the codecs' error is the same in both and the losses may differ
only by the compiler's float rounding (none with ``aot_eager``, which runs
the same kernels). ``aot_eager``: with inductor this test took 64 s with its
caches cold (30 s warm) on 2 loaded cores, against 18 s."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import run_ranks
from torchrec_utils import cpu_sharders

import qcomm

pytest.importorskip("torchrec")

WORLD = 2
STEPS = 4
BATCH, DIM, ROWS, DENSE = 32, 8, 50, 4
TABLES = ("t0", "t1", "t2")  # table-wise on rank 0, on rank 1, row-wise
REGISTRY = "pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=fp16/fp16"


def _model(rank: int) -> tuple[Any, torch.optim.Optimizer]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    registry = qcomm.build_registry(REGISTRY)
    torch.manual_seed(0)  # the dense layers
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"])
        for t in TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE,
            dense_arch_layer_sizes=[8, DIM],
            over_arch_layer_sizes=[8, 1],
            dense_device=torch.device("cpu"),
        )
    )
    sharder, _ = cpu_sharders(registry, 0.1)
    per_table = {
        "t0": table_wise(rank=0, compute_kernel="fused"),
        "t1": table_wise(rank=1, compute_kernel="fused"),
        "t2": row_wise(compute_kernel="fused"),
    }
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=WORLD, world_size=WORLD, device_type="cpu"
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
            full = torch.rand(ROWS, DIM, generator=gen) - 0.5
            for shard in value.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    dense = [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
    return dmp, torch.optim.SGD(dense, lr=0.1)


def _batches(rank: int) -> list[Any]:
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        lengths = torch.randint(1, 3, (len(TABLES) * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in TABLES], values=values, lengths=lengths
        )
        dense = torch.randn(BATCH, DENSE, generator=gen)
        labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _train(model: Any, opt: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    before = counted("torchrec_call").copy()
    losses = []
    for batch in _batches(rank):
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "calls": dict(counted("torchrec_call") - before)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    eager = _train(*_model(rank), rank)
    model, opt = _model(rank)
    dlrm = model.module.model
    for arch in (dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch):
        arch.compile(fullgraph=True, backend="aot_eager")
    counters.clear()
    compiled = _train(model, opt, rank)
    return {
        "eager": eager,
        "compiled": compiled,
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["stats"]["unique_graphs"],
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_worker, WORLD, timeout=600.0)


def test_the_compiled_dlrm_runs_on_qcomms_exchange(results: list[dict[str, Any]]) -> None:
    want = {"alltoall_pooled": STEPS, "reduce_scatter_base_pooled": STEPS}
    for rank, r in enumerate(results):
        assert r["eager"]["calls"] == want, f"rank {rank}: {r['eager']['calls']}"
        assert r["compiled"]["calls"] == want, f"rank {rank}: {r['compiled']['calls']}"


def test_the_compiled_part_has_no_graph_break(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["frames"] >= 3, f"rank {rank}: {r['frames']} graphs, expected one per arch"
        assert r["graph_breaks"] == 0, f"rank {rank}: {r['graph_breaks']} graph breaks"


def test_the_compiled_dlrm_trains_as_the_eager_one(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        eager, compiled = r["eager"]["losses"], r["compiled"]["losses"]
        assert len(compiled) == STEPS, f"rank {rank}: {r}"
        assert compiled == eager, f"rank {rank}: compiled {compiled}, eager {eager}"
