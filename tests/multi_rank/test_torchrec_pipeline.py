"""TorchRec's ``TrainPipelineSparseDist`` on qcomm's exchange: a DLRM with
table-wise and row-wise tables and a qcomm registry, trained on two gloo ranks
once with a plain loop and once with TorchRec's pipeline (which issues the
next batch's collectives early and waits for them late), from the same
weights on the same batches. The losses agree bit for bit, and every step's
pooled all-to-all and reduce-scatter ran on qcomm's exchange (counted)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from counting import counted
from dist_utils import run_ranks
from torchrec_utils import dlrm_batches, small_dlrm

pytest.importorskip("torchrec")

WORLD = 2
STEPS = 6
BATCH, DIM, ROWS, DENSE = 64, 16, 100, 4
REGISTRY = "pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=fp16/fp16"


def _model(rank: int) -> tuple[Any, torch.optim.Optimizer]:
    return small_dlrm(rank, WORLD, REGISTRY, dim=DIM, rows=ROWS, dense=DENSE)


def _batches(rank: int) -> list[Any]:
    return dlrm_batches(rank, STEPS, batch=BATCH, rows=ROWS, dense=DENSE)


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
