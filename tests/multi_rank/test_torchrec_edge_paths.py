"""TorchRec's output-dist modules on qcomm's exchange at the shapes a real
sharding plan makes and the other suites do not: a rank whose batch is zero,
a rank without tables or features, features of different dims on one rank,
uneven reduce-scatter splits, two tables per rank in the sequence
all-to-all, variable batch sizes; and the door (qcomm's exchange or
TorchRec's own transport) kept from the first call on, whatever
``QCOMM_TORCHREC_COLLECTIVES`` says later.

Every case goes through the module TorchRec's sharded modules use
(``torchrec.distributed.dist_data``) with a qcomm registry of no-op codecs,
forward and backward, on qcomm's exchange (each call counted, by the
``torchrec_call`` event, under the name of the function it replaced) and
on TorchRec's own functions (put back with ``uninstall``), and compares the
bits. TorchRec's reduce-scatter-v paths fail on gloo (an all-gather of
uneven sizes), and gloo's own reduce-scatter sums in ring order, so for the
reduce-scatters the reference is the sum of every rank's data in rank order,
which qcomm's reduce-scatter computes bit for bit on every rank (from 3
ranks on, an order that starts with the rank's own block differs from it in
the last bits, on some ranks only).

One spawn per world size (2 and 3 ranks) and transport runs every case; a
case does all its communication before its checks, so that a failed check
leaves the ranks in step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env

import qcomm
from qcomm import config, torchrec_exchange

pytest.importorskip("torchrec")

WORLD_SIZES = (2, 3)
A2A = "POOLED_EMBEDDINGS_ALL_TO_ALL"
RS = "POOLED_EMBEDDINGS_REDUCE_SCATTER"
SEQ = "SEQUENCE_EMBEDDINGS_ALL_TO_ALL"


def _codecs(op: str) -> Any:
    return qcomm.build_registry("noop")[op]


def _gen(rank: int, case: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, case)) * 10 + rank)


@contextlib.contextmanager
def _torchrec_door() -> Iterator[None]:
    """TorchRec's own functions in place, and qcomm's back after."""
    torchrec_exchange.uninstall()
    try:
        yield
    finally:
        torchrec_exchange.install()


def _run(
    call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad_seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Forward, then backward with a random gradient; the output, the input's
    gradient and the calls counted on qcomm's exchange meanwhile."""
    before = counted("torchrec_call").copy()
    x = x.clone().requires_grad_(True)
    y = call(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed))
    y.backward(g)
    assert x.grad is not None
    return y.detach(), x.grad, dict(counted("torchrec_call") - before)


def _both_doors(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, name: str) -> None:
    """The module call on qcomm's exchange (counted once under ``name``) gives
    TorchRec's own bits, forward and backward."""
    y, gx, counted = _run(call, x, 7)
    with _torchrec_door():
        y_ref, g_ref, not_counted = _run(call, x, 7)
    assert counted == {name: 1}, f"qcomm's exchange counted {counted}, expected {{{name!r}: 1}}"
    assert not not_counted, f"TorchRec's own door ran on qcomm's exchange: {not_counted}"
    assert y.shape == y_ref.shape, (tuple(y.shape), tuple(y_ref.shape))
    assert torch.equal(y, y_ref), "forward differs from TorchRec's own"
    assert torch.equal(gx, g_ref), "gradient differs from TorchRec's own"


# -- the pooled all-to-all ------------------------------------------------------


def _pooled(rank: int, world: int, batches: list[int], dims: list[int], case: str) -> None:
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, dims, codecs=_codecs(A2A))
    x = torch.randn(sum(batches), dims[rank], generator=_gen(rank, case))
    _both_doors(lambda t: a2a(t, batches).wait(), x, "alltoall_pooled")


def pooled_zero_batch(rank: int, world: int) -> None:
    # Rank 1 has no samples: it receives nothing, and still sends.
    batches = [3 if r != 1 else 0 for r in range(world)]
    _pooled(rank, world, batches, [4 + 2 * r for r in range(world)], "pooled_zero_batch")


def pooled_rank_without_tables(rank: int, world: int) -> None:
    # More ranks than tables: the last has none (width 0) and only receives.
    _pooled(rank, world, [2] * world, [4] * (world - 1) + [0], "pooled_rank_without_tables")


# -- the variable-batch pooled all-to-all ---------------------------------------


def _variable_batch(
    rank: int, world: int, dims: list[list[int]], batch: list[list[int]], case: str
) -> None:
    # dims[r]: the dims of rank r's features; batch[i][f]: rank i's batch
    # size for feature f (features in rank order).
    from torchrec.distributed.dist_data import VariableBatchPooledEmbeddingsAllToAll

    owned, at = [], 0
    for d in dims:
        owned.append(list(range(at, at + len(d))))
        at += len(d)
    per_rank = [[batch[i][f] for f in owned[rank]] for i in range(world)]
    n = sum(b * d for i in range(world) for b, d in zip(per_rank[i], dims[rank]))
    a2a = VariableBatchPooledEmbeddingsAllToAll(dist.group.WORLD, dims, codecs=_codecs(A2A))
    x = torch.randn(n, generator=_gen(rank, case))
    _both_doors(lambda t: a2a(t, per_rank, batch[rank]).wait(), x, "variable_batch_alltoall_pooled")


def variable_batch_zero_rank(rank: int, world: int) -> None:
    # Two features of different dims on rank 0; the last rank's batch is
    # zero for every feature.
    dims = [[4, 8]] + [[6]] * (world - 1)
    features = world + 1
    batch = [[2 + (i + f) % 3 for f in range(features)] for i in range(world - 1)]
    batch.append([0] * features)
    _variable_batch(rank, world, dims, batch, "variable_batch_zero_rank")


def variable_batch_rank_without_features(rank: int, world: int) -> None:
    # The last rank owns no feature; rank 0, with two, has no samples.
    dims = [[4, 8]] + [[6]] * (world - 2) + [[]]
    features = world
    batch = [[0] * features] + [[1 + (i + f) % 3 for f in range(features)] for i in range(1, world)]
    _variable_batch(rank, world, dims, batch, "variable_batch_rank_without_features")


# -- the reduce-scatters --------------------------------------------------------


def _in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _reduce_scatter(
    rank: int, world: int, splits: list[int], case: str, name: str, given: bool
) -> None:
    from torchrec.distributed.comm_ops import get_gradient_division
    from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter

    dim, lo = 32, sum(splits[:rank])
    xs = [torch.randn(sum(splits), dim, generator=_gen(r, case)) for r in range(world)]
    gs = [torch.randn(splits[r], dim, generator=_gen(r + 100, case)) for r in range(world)]
    rs = PooledEmbeddingsReduceScatter(dist.group.WORLD, codecs=_codecs(RS))
    before = counted("torchrec_call").copy()
    x = xs[rank].clone().requires_grad_(True)
    y = rs(x, splits if given else None).wait()
    y.backward(gs[rank])
    ran = dict(counted("torchrec_call") - before)
    divide = world if get_gradient_division() else 1
    assert ran == {name: 1}, ran
    want = _in_rank_order([t[lo : lo + splits[rank]] for t in xs])
    assert torch.equal(y, want), f"not the sum in rank order: off by {(y - want).abs().max()}"
    assert x.grad is not None and torch.equal(x.grad, torch.cat(gs) / divide)


def reduce_scatter_even(rank: int, world: int) -> None:
    splits = [3] * world
    _reduce_scatter(rank, world, splits, "rs_even", "reduce_scatter_base_pooled", given=False)


def reduce_scatter_v_uneven(rank: int, world: int) -> None:
    splits = [2 + r for r in range(world)]
    _reduce_scatter(rank, world, splits, "rs_v_uneven", "reduce_scatter_v_pooled", given=True)


def reduce_scatter_v_zero_split(rank: int, world: int) -> None:
    splits = [0] + [2 + r for r in range(1, world)]
    _reduce_scatter(rank, world, splits, "rs_v_zero", "reduce_scatter_v_pooled", given=True)


def reduce_scatter_v_per_feature(rank: int, world: int) -> None:
    from torchrec.distributed.comm_ops import get_gradient_division
    from torchrec.distributed.dist_data import VariableBatchPooledEmbeddingsReduceScatter

    # Row-wise features of dims 4 and 8; rank r's batch per feature, one of
    # them zero somewhere.
    dims = [4, 8]
    batch = [[1 + r, (2 * r) % 3] for r in range(world)]
    sizes = [sum(b * d for b, d in zip(batch[r], dims)) for r in range(world)]
    lo = sum(sizes[:rank])
    case = "reduce_scatter_v_per_feature"
    xs = [torch.randn(sum(sizes), generator=_gen(r, case)) for r in range(world)]
    gs = [torch.randn(sizes[r], generator=_gen(r + 100, case)) for r in range(world)]
    rs = VariableBatchPooledEmbeddingsReduceScatter(dist.group.WORLD, codecs=_codecs(RS))
    before = counted("torchrec_call").copy()
    x = xs[rank].clone().requires_grad_(True)
    y = rs(x, batch, dims).wait()
    y.backward(gs[rank])
    ran = dict(counted("torchrec_call") - before)
    divide = world if get_gradient_division() else 1
    assert ran == {"reduce_scatter_v_per_feature_pooled": 1}, ran
    want = _in_rank_order([t[lo : lo + sizes[rank]] for t in xs])
    assert torch.equal(y, want), f"not the sum in rank order: off by {(y - want).abs().max()}"
    assert x.grad is not None and torch.equal(x.grad, torch.cat(gs) / divide)


# -- the sequence all-to-all ----------------------------------------------------


def _sequence(
    rank: int, world: int, tables: list[int], batch: list[int], case: str, variable: bool
) -> None:
    # lengths[r][t][j]: ids of rank j's samples (batch[j] of them) that look
    # up rank r's table t; the same on every rank.
    from torchrec.distributed.dist_data import SequenceEmbeddingsAllToAll, _get_recat

    dim = 4
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    lengths = [
        [[torch.randint(0, 3, (batch[j],), generator=gen) for j in range(world)] for _ in range(t)]
        for t in tables
    ]
    mine = lengths[rank]
    # Rows received back from rank k (this rank's ids in its tables), and
    # rows sent to rank j (j's ids in this rank's tables).
    got = [int(sum(int(ls[rank].sum()) for ls in lengths[k])) for k in range(world)]
    sent = [int(sum(int(ls[j].sum()) for ls in mine)) for j in range(world)]
    a2a = SequenceEmbeddingsAllToAll(dist.group.WORLD, tables, codecs=_codecs(SEQ))
    x = torch.randn(sum(sent), dim, generator=_gen(rank, case))
    if not variable:
        # [tables, world * batch]: each table's lengths, source rank by rank.
        local = torch.stack([torch.cat(ls) for ls in mine]) if mine else torch.zeros(0, 1)
        local = local.long()
        _both_doors(lambda t: a2a(t, local, got, sent).wait(), x, "alltoall_sequence")
        return
    # Features after the ids' all-to-all, table by table, then by source rank.
    local = torch.cat([ls[j] for ls in mine for j in range(world)])
    recat = _get_recat(tables[rank], world, 1, batch_size_per_rank=batch)
    _both_doors(
        lambda t: a2a(
            t, local, got, sent, batch_size_per_rank=batch, sparse_features_recat=recat
        ).wait(),
        x,
        "alltoall_sequence",
    )


def sequence_two_tables(rank: int, world: int) -> None:
    _sequence(rank, world, [2] * world, [3] * world, "sequence_two_tables", variable=False)


def sequence_rank_without_tables(rank: int, world: int) -> None:
    tables = [2] * (world - 1) + [0]
    _sequence(rank, world, tables, [2] * world, "sequence_rank_without_tables", variable=False)


def sequence_variable_batch(rank: int, world: int) -> None:
    batch = [1 + 2 * (r % 2) for r in range(world)]
    _sequence(rank, world, [2] * world, batch, "sequence_variable_batch", variable=True)


def sequence_variable_batch_zero(rank: int, world: int) -> None:
    batch = [0] + [1 + r for r in range(1, world)]
    _sequence(rank, world, [2] * world, batch, "sequence_variable_batch_zero", variable=True)


# -- the door -------------------------------------------------------------------


@contextlib.contextmanager
def _env(value: str) -> Iterator[None]:
    # The setting only: the door reads it at the first call after an install.
    with config.configured(torchrec_collectives=value):
        yield


def door_read_once(rank: int, world: int) -> None:
    # QCOMM_TORCHREC_COLLECTIVES is read at the first call after install;
    # changed later (between calls, between a call and its wait, between a
    # forward and its backward) it changes nothing until the next install.
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    dims = [4 + r for r in range(world)]
    a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, dims, codecs=_codecs(A2A))
    x = torch.randn(2 * world, dims[rank], generator=_gen(rank, "door_read_once"))
    xs = [x.clone().requires_grad_(True) for _ in range(5)]
    outs: list[torch.Tensor] = []
    counts: list[int] = []

    def count() -> None:
        counts.append(counted("torchrec_call")["alltoall_pooled"])

    torchrec_exchange.uninstall()
    torchrec_exchange.install()
    count()
    with _env("qcomm"):
        first = a2a(xs[0])
    with _env("torchrec"):
        outs.append(first.wait())
        outs.append(a2a(xs[1]).wait())
        count()
    with _env("qcomm"):
        (outs[0].sum() + outs[1].sum()).backward()
    with _env("torchrec"):
        # A new install reads the variable again, at its first call.
        torchrec_exchange.uninstall()
        torchrec_exchange.install()
        outs.append(a2a(xs[2]).wait())
        count()
    with _env("qcomm"):
        outs.append(a2a(xs[3]).wait())
        count()
    with _env("torchrec"):
        (outs[2].sum() + outs[3].sum()).backward()
    with _env("qcomm"):
        # Back to qcomm's exchange for the cases that follow.
        torchrec_exchange.uninstall()
        torchrec_exchange.install()
        outs.append(a2a(xs[4]).wait())
        count()
    outs[4].sum().backward()
    assert counts[1] - counts[0] == 2, f"qcomm's door was left: {counts}"
    assert counts[3] == counts[2] == counts[1], f"TorchRec's door was left: {counts}"
    assert counts[4] == counts[3] + 1, counts
    # One input, so one output and one gradient, whichever door.
    assert all(torch.equal(y, outs[0]) for y in outs), "the doors' outputs differ"
    grads = [t.grad for t in xs if t.grad is not None]
    assert len(grads) == len(xs) and all(torch.equal(g, grads[0]) for g in grads), "gradients"


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (
        pooled_zero_batch,
        pooled_rank_without_tables,
        variable_batch_zero_rank,
        variable_batch_rank_without_features,
        reduce_scatter_even,
        reduce_scatter_v_uneven,
        reduce_scatter_v_zero_split,
        reduce_scatter_v_per_feature,
        sequence_two_tables,
        sequence_rank_without_tables,
        sequence_variable_batch,
        sequence_variable_batch_zero,
        door_read_once,
    )
}


def run_case(name: str, rank: int, world: int) -> None:
    CASES[name](rank, world)


@pytest.fixture(scope="module")
def spawned() -> Callable[[str, int], dict[str, Outcome]]:
    """One spawn per transport and world size, on first use, its outcome remembered."""
    runs = {
        transport: outcomes_per_world_size(
            run_case, list(CASES), env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport in TRANSPORTS
    }
    return lambda transport, world: runs[transport](world)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_edge_path(
    transport: str, world: int, case: str, spawned: Callable[[str, int], dict[str, Outcome]]
) -> None:
    check_case(spawned(transport, world)[case], f"{case} on {world} ranks, {transport}", transport)
