"""Every built-in codec on every collective path of TorchRec, at awkward
embedding dims and batch sizes, through TorchRec's own modules on two gloo
ranks: the pooled all-to-all (``PooledEmbeddingsAllToAll``), its
variable-batch form (``VariableBatchPooledEmbeddingsAllToAll``), the sequence
all-to-all (``SequenceEmbeddingsAllToAll``) and the reduce-scatter
(``PooledEmbeddingsReduceScatter``), each forward and backward.

TorchRec encodes a whole tensor once and cuts the wire by
``calc_quantized_size`` of each destination's share. Where it hands the codec
rows (the pooled forward, after ``padded_size``; the sequence backward), a
block codec pads every row and any dim works. Where it hands a flat tensor
(the pooled backward, the variable-batch all-to-all, the sequence forward),
a share that is not whole blocks would send one block to two ranks: there
every rank must get one ``CodecError`` before anything is sent, and nothing
else may go wrong. Every case is built so that all ranks meet the same
outcome (a rank alone raising would leave the other waiting). The
reduce-scatter takes only what ``build_registry`` accepts for it where
TorchRec's transport is chosen.

Each case's outcome is predicted from the codecs' blocks and the shares, and
every result that comes back is held to the codecs' declared error bound.

Every case runs on both doors: qcomm's exchange, which TorchRec's modules
take for a qcomm registry by default (each call counted there), where every
case works, since qcomm cuts its messages between rows; and TorchRec's own
transport (``QCOMM_TORCHREC_COLLECTIVES=torchrec``), where the refusals above
hold.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from codec_names import BUILTIN
from counting import counted
from dist_utils import run_ranks

import qcomm
from qcomm import CodecInfo, CommOp, config, torchrec_exchange

pytest.importorskip("torchrec")

WORLD = 2
# qcomm's exchange (the default) and TorchRec's own transport.
DOORS = ("qcomm", "torchrec")
DIMS = [16, 48, 3, 129, 64]
# A value range every built-in codec takes without saturating (the unscaled
# FP8 cast stops at 0.9375).
MAGNITUDE = 0.9
SLACK = 4 * torch.finfo(torch.float32).eps

PATHS = {
    "pooled": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "var_batch": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "sequence": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "reduce_scatter": CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
}
# Batch sizes per rank (pooled, reduce-scatter: one for all; variable batch:
# each rank its own) and ids per (sample rank, table rank) pair (sequence):
# "whole" ones make every share whole blocks of 32 at any dim, "odd" ones
# make every share at a dim that 32 does not divide cut a block.
SHAPES: dict[str, dict[str, Any]] = {
    "whole": {"batch": [32, 32], "var_batch": [32, 64], "rows": [[32, 64], [96, 32]]},
    "odd": {"batch": [5, 5], "var_batch": [5, 3], "rows": [[5, 7], [9, 3]]},
}


def _info(spec: str) -> CodecInfo:
    return qcomm.codec_info(qcomm.load_codec(spec))


CODECS = [*BUILTIN, "int8:row_dim=16"]
BLOCK = {c: max(_info(c).error_block, 1) for c in CODECS}
PAIRS = [(c, c) for c in CODECS] + [("fp16", c) for c in CODECS if BLOCK[c] > 1]


def _accepted(op: CommOp, fwd: str, bwd: str) -> bool:
    # Where TorchRec's own transport is chosen: there the registry keeps its rules.
    with config.configured(torchrec_collectives="torchrec"):
        try:
            qcomm.build_registry({op.value: (fwd, bwd)})
        except qcomm.CodecError:
            return False
    return True


RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
RS_PAIRS = [p for p in itertools.product(CODECS, CODECS) if _accepted(RS, *p)]


@dataclasses.dataclass(frozen=True)
class Case:
    path: str
    fwd: str
    bwd: str
    dim: int
    shape: str

    def __str__(self) -> str:
        return f"{self.path}-{self.fwd}/{self.bwd}-d{self.dim}-{self.shape}"


def _cuts(case: Case, rank: int) -> tuple[list[int], list[int], int, int]:
    """The forward and backward shares of ``rank`` (what it sends and
    receives), and the length of what it encodes each way."""
    d, shape = case.dim, SHAPES[case.shape]
    if case.path == "pooled":
        b = shape["batch"][0]
        # The forward pads every rank's columns to whole blocks first.
        return [], [b * d] * (2 * WORLD), 0, WORLD * b * d
    if case.path == "var_batch":
        bs = shape["var_batch"]
        cuts = [b * d for b in bs] + [bs[rank] * d] * WORLD
        return cuts, cuts, sum(bs) * d, WORLD * bs[rank] * d
    if case.path == "sequence":
        rows = shape["rows"]
        sent = [rows[j][rank] * d for j in range(WORLD)]
        got = [rows[rank][k] * d for k in range(WORLD)]
        return sent + got, [], sum(sent), 0  # the backward hands rows of d
    return [], [], 0, 0  # reduce-scatter: element-wise codecs only


def _fails(codec: str, cuts: list[int], whole: int) -> bool:
    # A flat tensor's wire divides between blocks, and at its end.
    b = BLOCK[codec]
    return any(n % b and n != whole for n in cuts)


def expected(case: Case, rank: int, door: str = "torchrec") -> str:
    """``"ok"``, or the direction where the rank gets a ``CodecError``."""
    if door == "qcomm":
        return "ok"
    fwd_cuts, bwd_cuts, fwd_whole, bwd_whole = _cuts(case, rank)
    if _fails(case.fwd, fwd_cuts, fwd_whole):
        return "fwd"
    if _fails(case.bwd, bwd_cuts, bwd_whole):
        return "bwd"
    return "ok"


def _cases() -> list[Case]:
    cases = []
    for path, dim, shape in itertools.product(PATHS, DIMS, SHAPES):
        pairs = RS_PAIRS if path == "reduce_scatter" else PAIRS
        cases += [Case(path, fwd, bwd, dim, shape) for fwd, bwd in pairs]
    for case in cases:  # one rank raising alone would leave the other waiting
        assert len({expected(case, r) for r in range(WORLD)}) == 1, case
    return cases


CASES = _cases()


# -- the ranks ------------------------------------------------------------------


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen) * 2 - 1) * MAGNITUDE


def _bound(info: CodecInfo, x: torch.Tensor) -> torch.Tensor:
    # The declared bound, with a block's largest magnitude bounded by the
    # tensor's (blocks may follow rows here, not the flat order).
    mag = x.abs().double()
    s = mag if info.error_block == 1 else mag.max().expand_as(mag)
    return info.rel_error_bound * s + info.abs_error_bound + SLACK * mag


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    if err.numel() == 0:
        return 0.0
    return float((err.double() / bound).nan_to_num(nan=0.0).max())


def _summed_bound(info: CodecInfo, parts: list[torch.Tensor]) -> torch.Tensor:
    # Each rank's part crosses the codec, then the wires are summed in the
    # wire format (summable: one more rounding per addition).
    enc = torch.stack([_bound(info, p) for p in parts]).sum(dim=0)
    total = torch.stack([p.abs().double() for p in parts]).sum(dim=0)
    return enc + (WORLD - 1) * info.rel_error_bound * (total + enc)


@dataclasses.dataclass
class Run:
    """What one path needs: the module call, this rank's input, and the
    exact output and input gradient computed from every rank's data."""

    call: Any
    x: torch.Tensor
    y_ref: torch.Tensor
    y_bound: torch.Tensor
    grad: torch.Tensor
    g_ref: torch.Tensor
    g_bound: torch.Tensor


def _pooled(
    case: Case, rank: int, codecs: Any, gen: torch.Generator, fwd: CodecInfo, bwd: CodecInfo
) -> Run:
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    d, b = case.dim, SHAPES[case.shape]["batch"][0]
    xs = [_rand(gen, WORLD * b, d) for _ in range(WORLD)]
    gs = [_rand(gen, b, WORLD * d) for _ in range(WORLD)]
    mine = slice(rank * b, (rank + 1) * b)
    a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, [d] * WORLD, codecs=codecs)
    y_ref = torch.cat([x[mine] for x in xs], dim=1)
    g = torch.cat([gs[r][:, rank * d : (rank + 1) * d] for r in range(WORLD)])
    return Run(
        lambda x: a2a(x).wait(), xs[rank], y_ref, _bound(fwd, y_ref), gs[rank], g, _bound(bwd, g)
    )


def _var_batch(
    case: Case, rank: int, codecs: Any, gen: torch.Generator, fwd: CodecInfo, bwd: CodecInfo
) -> Run:
    from torchrec.distributed.dist_data import VariableBatchPooledEmbeddingsAllToAll

    d, bs = case.dim, SHAPES[case.shape]["var_batch"]
    # xs[j][i]: what rank j holds for rank i's samples; gs[i]: rank i's
    # gradient of its output, one piece per source rank.
    xs = [[_rand(gen, bs[i] * d) for i in range(WORLD)] for _ in range(WORLD)]
    gs = [_rand(gen, WORLD * bs[i] * d) for i in range(WORLD)]
    a2a = VariableBatchPooledEmbeddingsAllToAll(dist.group.WORLD, [[d]] * WORLD, codecs=codecs)
    per_rank = [[bs[i]] for i in range(WORLD)]
    pre = [bs[rank]] * WORLD
    y_ref = torch.cat([xs[j][rank] for j in range(WORLD)])
    g = torch.cat([gs[i].view(WORLD, -1)[rank] for i in range(WORLD)])
    return Run(
        lambda x: a2a(x, per_rank, pre).wait(),
        torch.cat(xs[rank]),
        y_ref,
        _bound(fwd, y_ref),
        gs[rank],
        g,
        _bound(bwd, g),
    )


def _sequence(
    case: Case, rank: int, codecs: Any, gen: torch.Generator, fwd: CodecInfo, bwd: CodecInfo
) -> Run:
    from torchrec.distributed.dist_data import SequenceEmbeddingsAllToAll

    d, rows = case.dim, SHAPES[case.shape]["rows"]
    # One table per rank; rows[j][r] ids of rank j's samples look up rank r's
    # table. xs[r][j]: rank r's embeddings for rank j's ids.
    xs = [[_rand(gen, rows[j][r], d) for j in range(WORLD)] for r in range(WORLD)]
    gs = [_rand(gen, sum(rows[j]), d) for j in range(WORLD)]
    a2a = SequenceEmbeddingsAllToAll(dist.group.WORLD, [1] * WORLD, codecs=codecs)
    lengths = torch.tensor([[rows[j][rank] for j in range(WORLD)]])
    sent = [rows[rank][k] for k in range(WORLD)]
    got = [rows[k][rank] for k in range(WORLD)]
    y_ref = torch.cat([xs[k][rank] for k in range(WORLD)])
    g = torch.cat([gs[j].split(rows[j])[rank] for j in range(WORLD)])
    return Run(
        lambda x: a2a(x, lengths, sent, got).wait(),
        torch.cat(xs[rank]),
        y_ref,
        _bound(fwd, y_ref),
        gs[rank],
        g,
        _bound(bwd, g),
    )


def _reduce_scatter(
    case: Case, rank: int, codecs: Any, gen: torch.Generator, fwd: CodecInfo, bwd: CodecInfo
) -> Run:
    from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter

    d, b = case.dim, SHAPES[case.shape]["batch"][0]
    xs = [_rand(gen, WORLD * b, d) for _ in range(WORLD)]
    gs = [_rand(gen, b, d) for _ in range(WORLD)]
    parts = [x[rank * b : (rank + 1) * b] for x in xs]
    rs = PooledEmbeddingsReduceScatter(dist.group.WORLD, codecs=codecs)
    g = torch.cat(gs)
    y_ref = torch.stack(parts).sum(dim=0)
    return Run(
        lambda x: rs(x).wait(),
        xs[rank],
        y_ref,
        _summed_bound(fwd, parts),
        gs[rank],
        g,
        _bound(bwd, g),
    )


RUNNERS = {
    "pooled": _pooled,
    "var_batch": _var_batch,
    "sequence": _sequence,
    "reduce_scatter": _reduce_scatter,
}


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def _case(case: Case, rank: int) -> dict[str, Any]:
    from torchrec.distributed.comm_ops import get_gradient_division

    op = PATHS[case.path]
    codecs = qcomm.build_registry({op.value: (case.fwd, case.bwd)})[op.name]
    fwd, bwd = _info(case.fwd), _info(case.bwd)
    gen = torch.Generator().manual_seed(sum(map(ord, str(case))))
    run = RUNNERS[case.path](case, rank, codecs, gen, fwd, bwd)
    x = run.x.clone().requires_grad_(True)
    out: dict[str, Any] = {"fwd_error": None, "bwd_error": None}
    before = sum(counted("torchrec_call").values())
    try:
        y = run.call(x)
    except Exception as err:
        out["fwd_error"] = _error(err)
        return out
    out["exchange_calls"] = sum(counted("torchrec_call").values()) - before
    out["fwd_ratio"] = _ratio((y.detach() - run.y_ref).abs(), run.y_bound)
    try:
        (y * run.grad).sum().backward()
    except Exception as err:
        out["bwd_error"] = _error(err)
        return out
    # TorchRec divides gradients by the world size (exactly: a power of two).
    div = WORLD if get_gradient_division() else 1
    assert x.grad is not None
    out["bwd_ratio"] = _ratio((x.grad * div - run.g_ref).abs(), run.g_bound)
    return out


def _worker(rank: int, world_size: int, cases: list[Case]) -> dict[str, dict[str, Any]]:
    return {str(case): _case(case, rank) for case in cases}


Results = Callable[[str], dict[str, list[dict[str, Any]]]]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> Results:
    # One spawn per door runs the cases of every selected test (all, or those
    # -k picks), on first use.
    params = [
        getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items
    ]
    selected = {
        door: [p["case"] for p in params if isinstance(p.get("case"), Case) and p["door"] == door]
        for door in DOORS
    }
    done: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def on(door: str) -> dict[str, list[dict[str, Any]]]:
        if door not in done:
            env = {torchrec_exchange.ENV: door}
            per_rank = run_ranks(_worker, WORLD, selected[door], timeout=900.0, env=env)
            done[door] = {key: [r[key] for r in per_rank] for key in per_rank[0]}
        return done[door]

    return on


# -- the checks -----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("door", DOORS)
def test_torchrec_path(results: Results, door: str, case: Case) -> None:
    for rank, r in enumerate(results(door)[str(case)]):
        want = expected(case, rank, door)
        if r["fwd_error"] is None:
            # The forward call went through the door it names.
            want_calls = 1 if door == "qcomm" else 0
            assert r["exchange_calls"] == want_calls, f"rank {rank}, door {door}: {r}"
        if want == "ok":
            assert r["fwd_error"] is None and r["bwd_error"] is None, f"rank {rank}: {r}"
            assert r["fwd_ratio"] <= 1.0, f"rank {rank}, forward beyond the bound: {r}"
            assert r["bwd_ratio"] <= 1.0, f"rank {rank}, gradient beyond the bound: {r}"
            # The codecs really sat on the wire: their rounding shows.
            assert r["fwd_ratio"] > 0 and r["bwd_ratio"] > 0, f"rank {rank}: {r}"
            continue
        other = "bwd" if want == "fwd" else "fwd"
        assert r[f"{other}_error"] is None, f"rank {rank}: {r}"
        error = r[f"{want}_error"]
        codec = case.fwd if want == "fwd" else case.bwd
        name = _info(codec).name
        assert error is not None and error.startswith("CodecError"), f"rank {rank}: {r}"
        assert f"{name!r}" in error and "inside a block" in error, f"rank {rank}: {r}"


def test_the_cases_cover_what_they_claim() -> None:
    # Every codec runs every path at every dim where TorchRec lets it, and
    # the refusals are the flat-tensor cuts of block codecs alone.
    ok = {(c.path, c.fwd, c.bwd, c.dim) for c in CASES if expected(c, 0) == "ok"}
    for fwd, bwd in PAIRS:
        for path in ("pooled", "var_batch", "sequence"):
            for dim in DIMS:
                assert (path, fwd, bwd, dim) in ok, (path, fwd, bwd, dim)
    refused = {(c.path, c.dim) for c in CASES if expected(c, 0) != "ok"}
    assert refused == {
        (p, d) for p in ("pooled", "var_batch", "sequence") for d in (16, 48, 3, 129)
    }
    for codec in CODECS:  # at dims the block divides, any batch works
        for path in ("pooled", "var_batch", "sequence"):
            assert expected(Case(path, codec, codec, 64, "odd"), 0) == "ok"
    assert expected(Case("sequence", "int8:row_dim=16", "int8:row_dim=16", 48, "odd"), 0) == "ok"


@pytest.mark.parametrize(("fwd", "bwd"), list(itertools.product(CODECS, CODECS)))
def test_reduce_scatter_takes_only_what_torchrec_can_carry(
    fwd: str, bwd: str, torchrecs_transport: None
) -> None:
    # TorchRec sums the forward wires and all-gathers the backward wire into a
    # buffer of the gradient's size: where its transport is chosen, the
    # registry refuses anything else up front, on every rank alike.
    summable = _info(fwd).summable
    same_size = all(qcomm.load_codec(bwd).calc_quantized_size(n) == n for n in (1, 7, 4096))
    assert ((fwd, bwd) in RS_PAIRS) == (summable and same_size)
    if (fwd, bwd) not in RS_PAIRS:
        with pytest.raises(qcomm.CodecError, match="POOLED_EMBEDDINGS_REDUCE_SCATTER"):
            qcomm.build_registry({RS.value: (fwd, bwd)})
