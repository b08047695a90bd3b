"""TorchRec's ``TrainPipelineSparseDist`` on qcomm's exchange: a DLRM with
table-wise and row-wise tables and a qcomm registry, trained on two gloo ranks
once with a plain loop and once with TorchRec's pipeline (which issues the
next batch's collectives early and waits for them late), from the same
weights on the same batches. The losses agree bit for bit, and every step's
pooled all-to-all and reduce-scatter ran on qcomm's exchange (counted)."""

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
STEPS = 6
BATCH, DIM, ROWS, DENSE = 64, 16, 100, 4
TABLES = ("t0", "t1", "t2")  # table-wise on rank 0, on rank 1, row-wise
REGISTRY = "pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=fp16/fp16"


def _model(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
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


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    torch.set_num_threads(1)
    model, opt = _model(rank)
    plain = []
    for batch in _batches(rank):
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        plain.append(float(loss.detach()))
    model, opt = _model(rank)
    before = dict(counted("torchrec_call"))
    pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    batches = iter(_batches(rank))
    piped = []
    while True:
        try:
            output = pipeline.progress(batches)
        except StopIteration:
            break
        piped.append(float(output[0]))
    calls = {k: v - before.get(k, 0) for k, v in counted("torchrec_call").items()}
    return {"plain": plain, "piped": piped, "calls": calls}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_worker, WORLD, timeout=300.0)


def test_the_pipeline_trains_as_the_plain_loop(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert len(r["piped"]) == STEPS, f"rank {rank}: {r}"
        assert r["piped"] == r["plain"], f"rank {rank}: {r}"
        assert r["plain"][-1] < r["plain"][0], f"rank {rank}: the loss did not fall: {r}"


def test_the_pipeline_ran_on_qcomms_exchange(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        want = {"alltoall_pooled": STEPS, "reduce_scatter_base_pooled": STEPS}
        assert r["calls"] == want, f"rank {rank}: {r['calls']}"
