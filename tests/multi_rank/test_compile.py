"""qcomm's collectives under ``torch.compile(fullgraph=True)``: a module that
calls every collective with codecs, compiled with aot_eager and inductor on 2
and 3 gloo ranks and both transports, gives outputs and gradients equal to
eager bit for bit, breaks no graph, runs on qcomm's operators (counted), and
keeps a call whose result is unused (every rank makes it: counted)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import ForeignIdentityCodec
from counting import counted
from dist_utils import TRANSPORTS, run_ranks, transport_env

import qcomm
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives import (
    all_gather_pooled,
    all_to_all_pooled,
    all_to_all_sequence,
    reduce_scatter_pooled,
)
from qcomm.collectives.all_reduce import Residuals, all_reduce

BACKENDS = ("aot_eager", "inductor")
WORLDS = (2, 3)
DIM = 4
OUTPUTS = ("pooled", "sequence", "scattered", "gathered", "between", "reduced")
INPUTS = ("pooled", "rows", "blocks", "shard")


class _Model(torch.nn.Module):
    """Every collective, started before the compute between and waited after."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.batches = [2 + r for r in range(world)]
        self.dims = [3 + r for r in range(world)]
        self.splits = [rank + r + 1 for r in range(world)]  # the same both ways
        self.pair = qcomm.load_pair("int8/bf16")
        self.reduce_codec = qcomm.load_codec("int8")
        self.gather_codec = qcomm.load_codec("bf16")
        self.residuals = Residuals()

    def forward(self, pooled: Any, rows: Any, blocks: Any, shard: Any, bucket: Any) -> Any:
        pair = self.pair
        a2a = all_to_all_pooled(pooled, self.batches, self.dims, codecs=pair)
        seq = all_to_all_sequence(
            rows, input_splits=self.splits, output_splits=self.splits, codecs=pair
        )
        scattered = reduce_scatter_pooled(blocks, codecs=pair)
        gathered = all_gather_pooled(shard, codecs=pair)
        # Started and dropped, and waited with the result unused: both still
        # run on every rank (the peers' exchanges need them).
        all_gather_pooled(shard, codecs=pair)
        reduce_scatter_pooled(blocks, codecs=pair).wait()
        between = rows * 2  # compute while the calls are in flight
        reduced = all_reduce(
            bucket,
            reduce_codec=self.reduce_codec,
            gather_codec=self.gather_codec,
            residuals=self.residuals,
        )
        return a2a.wait(), seq.wait(), scattered.wait(), gathered.wait(), between, reduced


def _inputs(rank: int, world: int, model: _Model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    shapes = {
        "pooled": (sum(model.batches), model.dims[rank]),
        "rows": (sum(model.splits), DIM),
        "blocks": (2 * world, DIM),
        "shard": (3, DIM),
        "bucket": (64,),
    }
    return {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}


def _step(model: Any, rank: int, world: int, base: _Model) -> dict[str, torch.Tensor]:
    """One forward and backward pass; the outputs and the inputs' gradients."""
    base.residuals.scatter = base.residuals.gather = None
    given = _inputs(rank, world, base)
    leaves = {name: given[name].requires_grad_() for name in INPUTS}
    outputs = dict(zip(OUTPUTS, model(*leaves.values(), given["bucket"])))
    gen = torch.Generator().manual_seed(100 + rank)
    # Weights of the loss: the outputs' gradients are these, exactly.
    loss = sum(
        (outputs[name] * torch.randn(outputs[name].shape, generator=gen)).sum()
        for name in OUTPUTS[:4]
    )
    loss.backward()
    found = {f"output {name}": value.detach() for name, value in outputs.items()}
    found.update({f"gradient of {name}": leaf.grad for name, leaf in leaves.items()})
    return found


def _compiled_against_eager(rank: int, world: int) -> dict[str, Any]:
    model = _Model(rank, world)
    eager = _step(model, rank, world, model)
    found: dict[str, Any] = {}
    for backend in BACKENDS:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        before = Counter(counted("compiled_call"))
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        got = _step(compiled, rank, world, model)
        found[backend] = {
            "differ": sorted(name for name in eager if not torch.equal(eager[name], got[name])),
            "graph breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "operators": dict(Counter(counted("compiled_call")) - before),
        }
    return found


@functools.cache
def _outcome(world: int, transport: str) -> list[dict[str, Any]]:
    return run_ranks(_compiled_against_eager, world, env=transport_env(transport), timeout=600.0)


CASES = [(w, t, b) for w in WORLDS for t in TRANSPORTS for b in BACKENDS]


@pytest.mark.parametrize("world,transport,backend", CASES)
def test_compiled_outputs_and_gradients_equal_eager_bit_for_bit(
    world: int, transport: str, backend: str
) -> None:
    for rank, found in enumerate(_outcome(world, transport)):
        assert found[backend]["differ"] == [], f"rank {rank}"


@pytest.mark.parametrize("world,transport,backend", CASES)
def test_compiled_graph_breaks_nothing_and_runs_qcommss_operators(
    world: int, transport: str, backend: str
) -> None:
    expected = {
        "all_to_all_pooled_start": 1,
        "all_to_all_pooled_wait": 1,
        "all_to_all_pooled_backward": 1,
        "all_to_all_sequence_start": 1,
        "all_to_all_sequence_wait": 1,
        "all_to_all_sequence_backward": 1,
        "reduce_scatter_pooled_start": 2,
        "reduce_scatter_pooled_wait": 2,
        "reduce_scatter_pooled_backward": 1,  # the unused result has no gradient
        "all_gather_pooled_start": 2,  # one dropped unwaited: it still runs
        "all_gather_pooled_wait": 1,
        "all_gather_pooled_backward": 1,
        "all_reduce": 1,
    }
    for rank, found in enumerate(_outcome(world, transport)):
        assert found[backend]["graph breaks"] == 0, f"rank {rank}"
        assert found[backend]["operators"] == expected, f"rank {rank}"


class EncodeFailsOnLastRank(ForeignIdentityCodec):
    """Described alike on every rank; its encode raises on the last rank only."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="encode_fails", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("cannot encode here")
        return input_tensor.reshape(-1)


def _error(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except CodecError as err:
        return f"{err} (caused by: {err.__cause__!r})"
    return "returned"


def _compiled_failures(rank: int, world: int) -> dict[str, str]:
    """What each rank raises when a compiled call disagrees or a codec fails on one rank."""
    batches, dims = [2] * world, [3] * world
    x = torch.ones(2 * world, 3)

    def pooled(x: torch.Tensor, codecs: Any) -> torch.Tensor:
        return all_to_all_pooled(x, batches, dims, codecs=codecs).wait()

    compiled = torch.compile(pooled, backend="aot_eager", fullgraph=True)
    # The first call of the group: rank 0's codecs differ from the others'.
    differ = qcomm.load_pair("int8/bf16" if rank == 0 else "fp16/bf16")
    found = {"disagreement": _error(compiled, x, differ)}
    # A later call: the codec fails on the last rank only.
    compiled(x, qcomm.load_pair("int8/bf16"))
    failing = QuantizedCommCodecs(EncodeFailsOnLastRank(), EncodeFailsOnLastRank())
    found["codec failure"] = _error(compiled, x, failing)
    return found


@functools.cache
def _failures(transport: str) -> list[dict[str, str]]:
    return run_ranks(_compiled_failures, 2, env=transport_env(transport), timeout=300.0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_compiled_call_whose_ranks_disagree_raises_on_every_rank(transport: str) -> None:
    for rank, found in enumerate(_failures(transport)):
        assert "codecs.forward" in found["disagreement"], f"rank {rank}: {found}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_codec_failing_on_one_rank_in_a_compiled_call_raises_on_every_rank(
    transport: str,
) -> None:
    rank_0, rank_1 = (found["codec failure"] for found in _failures(transport))
    assert "rank 1 failed during the call" in rank_0, rank_0
    assert "encode_fails" in rank_1 and "cannot encode here" in rank_1, rank_1
