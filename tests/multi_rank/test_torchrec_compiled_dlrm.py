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

from typing import Any

import pytest
import torch
from counting import counted
from dist_utils import run_ranks
from torchrec_utils import dlrm_batches, small_dlrm

pytest.importorskip("torchrec")

WORLD = 2
STEPS = 4
BATCH, DIM, ROWS, DENSE = 32, 8, 50, 4
REGISTRY = "pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=fp16/fp16"


def _model(rank: int) -> tuple[Any, torch.optim.Optimizer]:
    return small_dlrm(rank, WORLD, REGISTRY, dim=DIM, rows=ROWS, dense=DENSE)


def _batches(rank: int) -> list[Any]:
    return dlrm_batches(rank, STEPS, batch=BATCH, rows=ROWS, dense=DENSE)


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
