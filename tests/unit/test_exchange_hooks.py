"""
The exchange's hooks, on one process: the all-reduce's error-feedback record
(told of each chunk encoded, with the piece it was read from) and the
rank-checking protocol's statuses (one rank's status read by its peer).
The multi-rank suites (test_failures.py, test_agreement.py, test_ddp.py)
run both through real exchanges.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qcomm
from qcomm.collectives._coding import Coding
from qcomm.collectives._exchange import Flat, Piece
from qcomm.collectives._feedback import Record, Sink
from qcomm.collectives._header import Flow
from qcomm.collectives._protocol import Flows, Protocol


def _chunks(codec: Any, region: Flat, cuts: list[tuple[int, int]]) -> list[tuple[Any, ...]]:
    """What the exchange tells its ``encoded`` hook of each chunk of ``region``."""
    out = []
    for start, stop in cuts:
        x = region.read(start, stop)
        ctx = codec.create_context()
        out.append((Piece(region, start, stop, stop - start), x, codec.encode(x, ctx), ctx))
    return out


def test_the_feedback_record_matches_chunks_to_their_tensor_in_any_order() -> None:
    codec = qcomm.load_codec("bf16")
    a, b = torch.randn(10), torch.randn(7)
    lost_a, lost_b = torch.full((10,), 9.0), torch.full((7,), 9.0)
    chunks = _chunks(codec, Flat(a, 10), [(0, 4), (4, 8), (8, 10)])
    chunks += _chunks(codec, Flat(b, 7), [(0, 7)])
    record = Record(codec, [(a, Sink(10, None, lost_a)), (b, Sink(7, None, lost_b))])
    # Told in another order than the sending one: each chunk still finds its
    # tensor's residual, at its own offsets.
    for chunk in reversed(chunks):
        record.keep(*chunk)
    record.drain()
    ctx = codec.create_context()
    assert torch.equal(lost_a, a - codec.decode(codec.encode(a, ctx), ctx))
    assert torch.equal(lost_b, b - codec.decode(codec.encode(b, ctx), ctx))
    assert lost_a.abs().max() > 0  # the codec did lose something

    # A chunk of a tensor the record was not given, or a tensor not wholly
    # encoded, is the exchange breaking its contract: said, not ignored.
    stray = Record(codec, [(a, Sink(10, None, lost_a))])
    stray.keep(*_chunks(codec, Flat(b, 7), [(0, 7)])[0])
    with pytest.raises(RuntimeError, match="not given"):
        stray.drain()
    short = Record(codec, [(a, Sink(10, None, lost_a))])
    short.keep(*chunks[0])
    with pytest.raises(RuntimeError, match="less than it was given"):
        short.drain()


class _Transport:
    """A transport of one pair of ranks that keeps what is sent, for the peer to read."""

    number = 5
    chunked = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sent: dict[int, tuple[torch.Tensor, bytes | None]] = {}

    def send(self, peer: int, wire: torch.Tensor, trailer: bytes | None = None) -> None:
        self.sent[peer] = (wire, trailer)

    def trailer_of(self, handle: Any, size: int) -> bytes:
        return handle


class _Call:
    name = "all_reduce reduce-scatter"
    checked = False
    announced = False

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport


def _protocol(rank: int, codec: Any, sends: Flow, expects: Flow) -> Protocol:
    codings = {1 - rank: Coding(codec, torch.float32)}
    call = _Call(_Transport(rank))
    return Protocol(call, codings, torch.float32, {1 - rank: Flows(sends, expects)})


def test_a_held_status_is_read_by_the_peer_whose_call_mirrors_it() -> None:
    codec = qcomm.NoOpQuantizedCommCodec(torch.float16)
    four, seven = Flow(4, (4,)), Flow(7, (7,))
    sent = _Transport(0)
    mine = Protocol(
        _Call(sent), {1: Coding(codec, torch.float32)}, torch.float32, {1: Flows(four, seven)}
    )
    mine.hold(1, torch.zeros(4))
    assert not sent.sent  # held until the whole call is known
    mine.release(ok=True)
    wire, status = sent.sent[1]
    assert status is not None and wire.numel() == 4

    def read(peer: Protocol) -> str | None:
        peer.last_posted(0, status, 4)
        assert peer.last_received(0, torch.zeros(4 + 2)).numel() == 4
        return peer.verdict()

    assert read(_protocol(1, codec, seven, four)) is None
    # A peer that expects other sizes, or decodes with another codec, hears
    # that this rank made another call; a failed status says so.
    assert "made another call" in (read(_protocol(1, codec, seven, seven)) or "")
    other = qcomm.NoOpQuantizedCommCodec(torch.bfloat16)
    assert "made another call" in (read(_protocol(1, other, seven, four)) or "")
    mine.hold(1, torch.zeros(4))
    mine.release(ok=False)
    status = sent.sent[1][1]
    assert "failed during the call" in (read(_protocol(1, codec, seven, four)) or "")
