"""
The exchange's plans kept by shape (``_exchange.plan``), on one process: a
call of a shape seen before binds its own regions to the kept cuts and gives
the plan a fresh cut would; a codec's wire sizes are still asked every call;
the flows of no-op codings come with the shape; the store stays bounded.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import qcomm
from qcomm.collectives import _exchange
from qcomm.collectives._coding import uniform
from qcomm.collectives._exchange import Flat, Plan, Rows


def _transport(rank: int = 0, world: int = 3) -> Any:
    # What plan() reads of a transport.
    return SimpleNamespace(chunked=True, rank=rank, world=world)


def _regions(rows: int, width: int, world: int, rank: int = 0) -> tuple[list[Any], list[Any]]:
    """A pooled all-to-all's regions on ``rank``: rows to each peer, columns from each."""
    x = torch.randn(rows * world, width)
    out = torch.empty(rows, width * world)
    peers = [p for p in range(world) if p != rank]
    sends = [([p], Rows(x[p * rows : (p + 1) * rows], width)) for p in peers]
    recvs = [(p, Rows(out[:, p * width : (p + 1) * width], width)) for p in peers]
    return sends, recvs


def _fresh(*args: Any) -> Plan:
    """The plan cut anew, as if no shape were kept."""
    kept = dict(_exchange._shapes)
    _exchange._shapes.clear()
    try:
        return _exchange.plan(*args)
    finally:
        _exchange._shapes.clear()
        _exchange._shapes.update(kept)


@pytest.fixture
def shapes_cut(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the shapes cut (misses of the kept plans), starting from none kept."""
    monkeypatch.setattr(_exchange, "_shapes", {})
    cut: list[int] = []
    real = _exchange._shape

    def counted(*args: Any) -> Any:
        cut.append(1)
        return real(*args)

    monkeypatch.setattr(_exchange, "_shape", counted)
    return cut


@pytest.mark.parametrize("chunk_bytes", [None, 64 * 4])
def test_a_call_of_a_seen_shape_binds_its_own_regions_to_the_kept_cuts(
    shapes_cut: list[int], chunk_bytes: int | None
) -> None:
    codings = uniform(qcomm.load_codec("noop"), 3, torch.float32)
    first = _exchange.plan(*_regions(8, 32, 3), codings, _transport(), chunk_bytes)
    sends, recvs = _regions(8, 32, 3)
    second = _exchange.plan(sends, recvs, codings, _transport(), chunk_bytes)
    assert len(shapes_cut) == 1
    expected = _fresh(sends, recvs, codings, _transport(), chunk_bytes)
    assert second == expected
    assert [s.piece.region for s in second.sends] != [s.piece.region for s in first.sends]
    assert {id(s.piece.region) for s in second.sends} == {id(r) for _, r in sends}
    assert {id(r.piece.region) for r in second.receives} == {id(r) for _, r in recvs}
    # 8 rows of 32 in chunks of 64 elements: 4 pieces per peer, whole rows.
    per_peer = 1 if chunk_bytes is None else 4
    assert len(second.sends) == len(second.receives) == 2 * per_peer
    assert second.flows is not None and second.flows == _exchange._flows(second)
    # Sends before a peer's last (copied where a call returns before they go).
    assert second.early == {
        i for i, s in enumerate(second.sends) if any(second.last_out[p] != i for p in s.to)
    }
    assert len(second.early) == 2 * (per_peer - 1)
    assert second.received == sum(r.piece.stop - r.piece.start for r in second.receives)
    assert second.received == 2 * 8 * 32


def test_other_sizes_transports_or_codecs_cut_another_shape(shapes_cut: list[int]) -> None:
    noop = uniform(qcomm.load_codec("noop"), 3, torch.float32)
    int8 = uniform(qcomm.load_codec("int8"), 3, torch.float32)
    _exchange.plan(*_regions(8, 32, 3), noop, _transport(), None)
    _exchange.plan(*_regions(9, 32, 3), noop, _transport(), None)
    _exchange.plan(*_regions(8, 32, 3, rank=1), noop, _transport(rank=1), None)
    _exchange.plan(*_regions(8, 32, 3), int8, _transport(), None)
    _exchange.plan(*_regions(8, 32, 3), noop, _transport(), 256)
    assert len(shapes_cut) == 5
    # Flat regions of the same length are another kind.
    x = torch.randn(2, 256)
    flat = ([([1], Flat(x[0], 256)), ([2], Flat(x[1], 256))], [(1, Flat(x[0], 256))])
    _exchange.plan(*flat, noop, _transport(), None)
    assert len(shapes_cut) == 6


def test_a_codec_is_asked_its_wire_sizes_every_call(shapes_cut: list[int]) -> None:
    codec = qcomm.load_codec("int8")
    asked: list[int] = []
    real = codec.calc_quantized_size

    def size(n: int, ctx: Any = None) -> int:
        asked.append(n)
        return int(real(n, ctx))

    codec.calc_quantized_size = size  # type: ignore[method-assign,assignment]
    codings = uniform(codec, 3, torch.float32)
    for _ in range(3):
        sends, recvs = _regions(8, 32, 3)
        asked.clear()
        steps = _exchange.plan(sends, recvs, codings, _transport(), None)
        assert asked == [8 * 32] * 4  # 2 sends and 2 receives, every call
        assert all(s.piece.size == real(s.piece.stop - s.piece.start) for s in steps.sends)
    assert len(shapes_cut) == 1
    # Encoded wires are not the data: the flows are the call's own.
    assert steps.flows is None


def test_the_kept_shapes_are_bounded(shapes_cut: list[int]) -> None:
    codings = uniform(qcomm.load_codec("noop"), 2, torch.float32)
    for rows in range(1, _exchange._KEEP_SHAPES + 10):
        _exchange.plan(*_regions(rows, 4, 2), codings, _transport(world=2), None)
    assert len(_exchange._shapes) == _exchange._KEEP_SHAPES
    assert len(shapes_cut) == _exchange._KEEP_SHAPES + 9
    # The newest are kept: the last shape is not cut again.
    _exchange.plan(*_regions(_exchange._KEEP_SHAPES + 9, 4, 2), codings, _transport(world=2), None)
    assert len(shapes_cut) == _exchange._KEEP_SHAPES + 9
