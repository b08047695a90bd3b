"""TorchRec's synchronous and compiled modes on qcomm's exchange.

TorchRec calls its collectives synchronously when told to
(``comm_ops.set_use_sync_collectives(True)``) and whenever ``torch.compile``
traces them. With a qcomm registry's pair, both still run on qcomm's
exchange: a synchronous call returns TorchRec's ``NoWait`` with the result
already there, and its backward runs on qcomm's exchange too; a function
calling TorchRec's ``comm_ops`` compiled with ``fullgraph=True`` traces
without a graph break and, run, calls qcomm's collectives. Both give the bits
of the asynchronous eager call, forward and backward, for the pooled
all-to-all (of fixed and variable batch), the reduce-scatters (base, v and
v per feature) and the sequence all-to-all.

Calls are counted at run time: eager calls by the ``torchrec_call`` event,
compiled ones by qcomm's operators they run (``compiled_call``), and every
call (eager or compiled, forward or backward) by the transport it opens
(``transport_opened``), which a compiled graph opens only when it runs.
One spawn of 2 gloo ranks per transport checks every case.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import TRANSPORTS, run_ranks, transport_env, wrong_transport

import qcomm

pytest.importorskip("torchrec")

WORLD = 2
REGISTRY = (
    "pooled_embeddings_all_to_all=int8/bf16,"
    "pooled_embeddings_reduce_scatter=fp16/fp16,"
    "sequence_embeddings_all_to_all=fp16/bf16"
)
# TorchRec's functions, and the qcomm collective each runs on.
NAMES = {
    "alltoall_pooled": "all_to_all_pooled",
    "variable_batch_alltoall_pooled": "all_to_all_sequence",
    "reduce_scatter_base_pooled": "reduce_scatter_pooled",
    "reduce_scatter_v_pooled": "reduce_scatter_pooled",
    "reduce_scatter_v_per_feature_pooled": "reduce_scatter_pooled",
    "alltoall_sequence": "all_to_all_sequence",
}
Start = Callable[[torch.Tensor], Any]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _calls(rank: int) -> dict[str, tuple[Start, torch.Tensor]]:
    """Each TorchRec function, called with the registry's pair: the call (its
    awaitable from an input) and this rank's input."""
    from torchrec.distributed import comm_ops
    from torchrec.distributed.dist_data import SequenceEmbeddingsAllToAll

    registry = qcomm.build_registry(REGISTRY)
    a2a = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    rs = registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    seq = registry["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"]
    dims, batches, splits = [4, 8], [3, 2], [3, 1]
    # batch[i][f]: rank i's batch size for feature f, feature f on rank f.
    batch = [[2, 3], [1, 2]]
    per_rank = [[batch[i][rank]] for i in range(WORLD)]
    per_feature = sum(batch[i][f] * dims[f] for i in range(WORLD) for f in range(WORLD))
    # One table per rank; lengths[t][j]: ids of rank j's 2 samples in table t.
    lengths = torch.tensor([[1, 2, 0, 1], [2, 0, 1, 1]], dtype=torch.int)
    sent = [int(lengths[rank, 2 * j : 2 * j + 2].sum()) for j in range(WORLD)]
    got = [int(lengths[k, 2 * rank : 2 * rank + 2].sum()) for k in range(WORLD)]
    order = SequenceEmbeddingsAllToAll(dist.group.WORLD, [1, 1])
    forward, backward = order._forward_recat_tensor, order._backward_recat_tensor
    mine = lengths[rank : rank + 1].long()
    return {
        "alltoall_pooled": (
            lambda x: comm_ops.alltoall_pooled(x, batches, dims, codecs=a2a),
            torch.randn(sum(batches), dims[rank], generator=_gen(rank)),
        ),
        "variable_batch_alltoall_pooled": (
            lambda x: comm_ops.variable_batch_alltoall_pooled(
                x, per_rank, batch[rank], [[d] for d in dims], codecs=a2a
            ),
            torch.randn(sum(b[0] for b in per_rank) * dims[rank], generator=_gen(40 + rank)),
        ),
        "reduce_scatter_base_pooled": (
            lambda x: comm_ops.reduce_scatter_base_pooled(x, codecs=rs),
            torch.randn(4, 8, generator=_gen(10 + rank)),
        ),
        "reduce_scatter_v_pooled": (
            lambda x: comm_ops.reduce_scatter_v_pooled(x, splits, codecs=rs),
            torch.randn(sum(splits), 8, generator=_gen(20 + rank)),
        ),
        "reduce_scatter_v_per_feature_pooled": (
            lambda x: comm_ops.reduce_scatter_v_per_feature_pooled(x, batch, dims, codecs=rs),
            torch.randn(per_feature, generator=_gen(50 + rank)),
        ),
        # TorchRec names the splits after the ids' all-to-all: its input
        # splits are what comes back.
        "alltoall_sequence": (
            lambda x: comm_ops.alltoall_sequence(x, forward, backward, mine, got, sent, codecs=seq),
            torch.randn(sum(sent), 4, generator=_gen(30 + rank)),
        ),
    }


def _run(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> dict[str, Any]:
    """Forward, then backward with a fixed gradient: the output, the input's
    gradient, and what ran on qcomm's exchange meanwhile."""
    calls, opened = counted("torchrec_call").copy(), counted("transport_opened").copy()
    ops = counted("compiled_call").copy()
    x = x.clone().requires_grad_(True)
    y = call(x)
    y.backward(torch.randn(y.shape, generator=_gen(99)))
    assert x.grad is not None
    return {
        "y": y.detach(),
        "grad": x.grad,
        "calls": dict(counted("torchrec_call") - calls),
        "opened": dict(counted("transport_opened") - opened),
        "ops": dict(counted("compiled_call") - ops),
    }


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    # A case that fails on every rank alike (a trace refused before anything
    # is sent) is reported; the ranks stay in step for the next case.
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported, checked by the test
        return {"error": f"{type(err).__name__}: {err}"[:2000]}


def _waited(start: Start, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = start(x).wait()
    return out


def _synchronous(start: Start, x: torch.Tensor) -> dict[str, Any]:
    from torchrec.distributed import comm_ops
    from torchrec.distributed.types import NoWait

    done: list[bool] = []

    def call(t: torch.Tensor) -> torch.Tensor:
        awaitable = start(t)
        done.append(isinstance(awaitable, NoWait))
        out: torch.Tensor = awaitable.wait()
        return out

    comm_ops.set_use_sync_collectives(True)
    try:
        out = _run(call, x)
    finally:
        comm_ops.set_use_sync_collectives(False)
    return {**out, "done": done}


def _compiled(start: Start, x: torch.Tensor) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(functools.partial(_waited, start), fullgraph=True, backend="aot_eager")
    first = _run(compiled, x)  # traces, then runs
    out = _run(compiled, x)  # runs the graph only
    return {**out, "first": first, "graph_breaks": sum(counters["graph_break"].values())}


def _own_comm(rank: int) -> dict[str, Any]:
    # TorchRec's way to swap its transport: the call keeps it, and says so once.
    from torchrec.distributed import comm_ops

    pair = qcomm.build_registry(REGISTRY)["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    dims = [4, 8]

    def call(t: torch.Tensor) -> torch.Tensor:
        comm = comm_ops.DefaultAll2AllSingle()
        out: torch.Tensor = comm_ops.alltoall_pooled(
            t, [3, 2], dims, codecs=pair, all_to_all_single_comm=comm
        ).wait()
        return out

    x = torch.randn(5, dims[rank], generator=_gen(60 + rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [_run(call, x) for _ in range(2)]
    ours = [w for w in caught if str(w.message).startswith("comm_ops.")]
    told = [str(w.message) for w in ours]
    return {"runs": runs, "told": told, "where": [w.filename for w in ours]}


def _output_dists(rank: int) -> dict[str, Any]:
    # What a sharded module calls: TorchRec's output-dist modules, compiled
    # together, equal to eager.
    from torchrec.distributed.dist_data import (
        PooledEmbeddingsAllToAll,
        PooledEmbeddingsReduceScatter,
    )

    registry = qcomm.build_registry(REGISTRY)
    a2a = PooledEmbeddingsAllToAll(
        dist.group.WORLD, [4, 8], codecs=registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    )
    rs = PooledEmbeddingsReduceScatter(
        dist.group.WORLD, codecs=registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    )

    def both(x: torch.Tensor) -> torch.Tensor:
        pooled = a2a(x, [3, 2]).wait()
        reduced = rs(x[:4, :4]).wait()
        return torch.cat([pooled.flatten(), reduced.flatten()])

    x = torch.randn(5, [4, 8][rank], generator=_gen(70 + rank))
    return {"eager": _run(both, x), **_compiled(lambda t: _Done(both(t)), x)}


class _Done:
    """A result there already, awaited as TorchRec's calls are."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"own comm": _own_comm(rank)}
    out["output dists"] = _guarded(functools.partial(_output_dists, rank))
    for name, (start, x) in _calls(rank).items():
        out[f"async {name}"] = _run(functools.partial(_waited, start), x)
        out[f"sync {name}"] = _guarded(functools.partial(_synchronous, start, x))
        out[f"compiled {name}"] = _guarded(functools.partial(_compiled, start, x))
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=TRANSPORTS)
def results(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    env = transport_env(request.param)
    return request.param, run_ranks(_worker, WORLD, timeout=600.0, env=env)


def _opened_twice(opened: dict[str, int], transport: str) -> None:
    # Forward and backward, each a call of qcomm's on the forced transport.
    assert wrong_transport([opened], transport) is None, wrong_transport([opened], transport)
    assert sum(opened.values()) == 2, opened


def _same_bits(got: dict[str, Any], want: dict[str, Any], case: str) -> None:
    assert "error" not in got, (case, got.get("error"))
    assert torch.equal(got["y"], want["y"]), f"{case}: the output differs from async eager"
    assert torch.equal(got["grad"], want["grad"]), f"{case}: the gradient differs"


@pytest.mark.parametrize("name", NAMES)
def test_a_synchronous_call_runs_on_qcomms_exchange(
    results: tuple[str, list[dict[str, dict[str, Any]]]], name: str
) -> None:
    transport, ranks = results
    for r in ranks:
        got = r[f"sync {name}"]
        _same_bits(got, r[f"async {name}"], f"sync {name}")
        assert got["done"] == [True], got["done"]  # TorchRec's NoWait, done on return
        assert got["calls"] == {name: 1}, got["calls"]
        assert not got["ops"], got["ops"]
        _opened_twice(got["opened"], transport)


@pytest.mark.parametrize("name", NAMES)
def test_a_compiled_call_runs_on_qcomms_exchange(
    results: tuple[str, list[dict[str, dict[str, Any]]]], name: str
) -> None:
    transport, ranks = results
    for r in ranks:
        got = r[f"compiled {name}"]
        _same_bits(got, r[f"async {name}"], f"compiled {name}")
        _same_bits(got["first"], r[f"async {name}"], f"compiled {name}, first call")
        assert got["graph_breaks"] == 0, got["graph_breaks"]
        # Counted when the graph runs, every run: qcomm's operators.
        ops = {f"{NAMES[name]}_{step}": 1 for step in ("start", "wait", "backward")}
        for run in (got["first"], got):
            _opened_twice(run["opened"], transport)
            assert run["ops"] == ops, run["ops"]
            assert not run["calls"], run["calls"]  # not counted as an eager call


def test_a_call_with_its_own_all_to_all_is_warned_of_once(
    results: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    _, ranks = results
    for r in ranks:
        got = r["own comm"]
        assert got["told"] == [
            "comm_ops.alltoall_pooled: a call with a qcomm pair runs on TorchRec's own "
            "transport, not on qcomm's exchange: the call passes its own all_to_all_single_comm"
        ], got["told"]
        assert got["where"] == [__file__], got["where"]  # where the call is made
        for run in got["runs"]:  # on TorchRec's transport: nothing of qcomm's opened
            assert not run["calls"] and not run["opened"], run


def test_compiled_output_dists_run_on_qcomms_exchange(
    results: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    transport, ranks = results
    for r in ranks:
        got = r["output dists"]
        _same_bits(got, got["eager"], "compiled output dists")
        assert got["graph_breaks"] == 0, got["graph_breaks"]
        steps = ("start", "wait", "backward")
        ops = {
            f"{c}_{step}": 1
            for c in ("all_to_all_pooled", "reduce_scatter_pooled")
            for step in steps
        }
        assert got["ops"] == ops, got["ops"]
        assert wrong_transport([got["opened"]], transport) is None, got["opened"]
