"""
The exchanges of one all-reduce on this rank (:func:`~.all_reduce.all_reduce`),
step by step: each a reduce-scatter or an all-gather of the buffer's blocks
(block ``r``: what rank ``r`` sums last) among some peers (:mod:`._topology`),
with error feedback (:mod:`._feedback`) where the step's codec loses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call
from qcomm.collectives._coding import PeerCodings, is_identity, uniform
from qcomm.collectives._exchange import Flat, recv_order, start_exchange
from qcomm.collectives._feedback import Record, Residuals, Sink, mark_infinities
from qcomm.collectives._topology import Step


def reduce_in_steps(
    buffer: torch.Tensor,
    call: Call,
    exchanges: list[Step],
    bounds: list[int],
    residuals: Residuals | None,
    chunk_bytes: int | None,
    average: bool,
) -> None:
    """
    Sums (or averages) ``buffer`` over the ranks in place, in the steps
    ``exchanges``: each planned on this rank's blocks, then exchanged, what
    the codec loses kept by a :class:`~._feedback.Record` that the exchange
    tells of every chunk it encodes.
    """
    work = buffer
    if len(exchanges) > 2 and buffer.dtype not in (torch.float32, torch.float64):
        # Sums between the steps stay in float32, as in one step.
        work = buffer.float()
    state = _Blocks(work, call.rank, call.world, bounds, residuals)
    for step in exchanges:
        divide = call.world if average and step.divides else 1
        plan = state.gather(step, divide) if step.gather else state.scatter(step)
        for x in plan.marked:
            mark_infinities(x)
        # The codec this step encodes with (an adaptive codec's choice).
        record = Record(plan.coding[call.rank].codec, plan.sinks) if plan.sinks else None
        into = plan.into
        if plan.widen:
            # The sum runs in float32, beside the blocks of a narrower dtype.
            into = {b: lease((len(t),), torch.float32, t.device) for b, t in into.items()}
        padded = plan.padded
        sends = [(to, Flat(plan.out[b], padded[b])) for to, b in plan.sends]
        recvs = [(s, Flat(into[b], padded[b])) for s, b in plan.recvs]
        call.next_exchange(step.name)
        finish = start_exchange(
            sends,
            recvs,
            plan.coding,
            call,
            work.dtype,
            chunk_bytes,
            add=not step.gather,
            encoded=record.keep if record is not None else None,
            sent=record.drain if record is not None else None,
        )
        if step.gather:
            finish()
            continue
        # A sum beside the buffer starts from this rank's own block.
        apart = {b: t for b, t in into.items() if t is not plan.blocks[b]}
        for b, total in apart.items():
            total.copy_(plan.blocks[b])
        finish()
        state.sums = apart
    if work is not buffer:
        buffer.copy_(work)


class _Plan(NamedTuple):
    """What one step of an all-reduce sends and receives, by block."""

    coding: PeerCodings
    #: each block's length on the wire
    padded: list[int]
    #: ``(peers, block)``: what goes to whom, read from ``out[block]``
    sends: list[tuple[list[int], int]]
    out: dict[int, torch.Tensor]
    #: ``(peer, block)``: what comes from whom, decoded (or added) into ``into[block]``
    recvs: list[tuple[int, int]]
    into: dict[int, torch.Tensor]
    #: a reduce-scatter's blocks of the buffer that this rank sums (``into``
    #: may be beside them)
    blocks: dict[int, torch.Tensor]
    #: whether ``into`` is to be replaced by float32 sums (a narrower dtype)
    widen: bool
    #: the tensors sent whose infinities become NaN before encoding
    marked: list[torch.Tensor]
    #: where what the codec loses of each tensor sent goes (error feedback)
    sinks: list[tuple[torch.Tensor, Sink]]


class _Blocks:
    """
    This rank's view of the buffer's blocks through the steps of one
    all-reduce (block ``r``: what rank ``r`` sums last). Each step exchanges
    with some peers only; ``blocks[p]`` are the blocks peer ``p`` sums in
    that step (default: its own).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        rank: int,
        world: int,
        bounds: list[int],
        residuals: Residuals | None,
    ) -> None:
        self.buffer = buffer
        self.rank = rank
        self.world = world
        self.bounds = bounds
        self.lengths = [bounds[r + 1] - bounds[r] for r in range(world)]
        self.residuals = residuals
        #: the blocks this rank has summed (where a sum is not in place)
        self.sums: dict[int, torch.Tensor] = {}

    def block(self, r: int) -> torch.Tensor:
        return self.buffer[self.bounds[r] : self.bounds[r + 1]]

    def _of(self, blocks: dict[int, list[int]] | None, r: int) -> list[int]:
        return [b for b in (blocks[r] if blocks else [r]) if self.lengths[b]]

    def scatter(self, step: Step) -> _Plan:
        """A reduce-scatter: each peer's blocks to it; theirs of this rank's added (in float32 at least)."""
        rank, buf = self.rank, self.buffer
        codec, peers, blocks = step.codec, step.peers, step.blocks
        residuals = self.residuals if step.feedback else None
        identity = is_identity(codec, buf.dtype)
        coding = uniform(codec, self.world, buf.dtype, step.name)
        padded = coding[rank].padded(self.lengths, rank, buf.device)
        sent = [(p, b) for p in peers for b in self._of(blocks, p)]
        # What goes out of each block: the block itself, or with residuals,
        # block + residual, in float32 at least (in bfloat16 the sum would
        # round away most of the residual, and the loss be carried nowhere).
        out = {b: self.block(b) for _, b in sent}
        sinks = []
        if residuals is not None and not identity:
            assert residuals.scatter is not None
            for _, b in sent:
                lost = residuals.scatter[self.bounds[b] : self.bounds[b + 1]]
                if buf.dtype.itemsize < 4:
                    out[b] = torch.add(out[b], lost)  # promoted to float32
                else:
                    out[b].add_(lost)
                sinks.append((out[b], Sink(self.lengths[b], None, lost)))
        # The sum runs in float32 at least: in place, in the blocks this rank
        # keeps (it sends them nowhere), or beside them for a narrower dtype.
        mine = {b: self.block(b) for b in self._of(blocks, rank)}
        into = {b: self.sums.get(b, block) for b, block in mine.items()}
        senders = [s for s in recv_order(rank, self.world) if s in peers]
        return _Plan(
            coding,
            padded,
            [([p], b) for p, b in sent],
            out,
            [(s, b) for s in senders for b in mine],
            into,
            mine,
            torch.promote_types(torch.float32, buf.dtype) != buf.dtype,
            [] if identity else list(out.values()),
            sinks,
        )

    def gather(self, step: Step, divide: int) -> _Plan:
        """An all-gather: this rank's blocks (divided by ``divide``) to each peer; theirs decoded."""
        rank, buf = self.rank, self.buffer
        codec, peers, blocks = step.codec, step.peers, step.blocks
        identity = is_identity(codec, buf.dtype)
        # The owner takes the values its peers decode, once its chunks
        # (perhaps read from its blocks) are encoded and sent.
        coding = uniform(codec, self.world, buf.dtype, step.name)
        padded = coding[rank].padded(self.lengths, rank, buf.device)
        residual = self.residuals.gather if self.residuals is not None and step.feedback else None
        out, sinks = {}, []
        for b in self._of(blocks, rank):
            mine = self.block(b)
            shard = self.sums.pop(b, mine)
            if divide > 1:
                shard.div_(divide)
            if identity:
                if shard is not mine:
                    mine.copy_(shard)
                shard = mine
            else:
                if shard.dtype != torch.float32:
                    shard = shard.float()
                if residual is not None:
                    shard.add_(residual)
                sinks.append((shard, Sink(len(mine), mine, residual)))
            out[b] = shard
        senders = [s for s in recv_order(rank, self.world) if s in peers]
        recvs = [(s, b) for s in senders for b in self._of(blocks, s)]
        return _Plan(
            coding,
            padded,
            [(peers, b) for b in out] if peers else [],
            out,
            recvs,
            {b: self.block(b) for _, b in recvs},
            {},
            False,
            [] if identity else list(out.values()),
            sinks,
        )
