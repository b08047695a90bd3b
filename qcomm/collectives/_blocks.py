"""
Every rank's blocks summed, or every rank's block to all: the exchanges of the
reduce-scatter and the all-gather, each the other's backward pass. ``lengths``
are every rank's block in elements; the blocks are padded to what the codec's
``padded_size`` asks for (a block seen as one row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call
from qcomm.collectives._exchange import (
    Flat,
    copy_in_parts,
    offsets,
    recv_order,
    send_order,
    start_exchange,
)
from qcomm.collectives._wire import padded_lengths


def sum_blocks(
    x: torch.Tensor,
    lengths: list[int],
    codec: Any,
    call: Call,
    shape: tuple[int, ...],
    chunk_bytes: int | None,
    background: bool = False,
) -> Callable[[], torch.Tensor]:
    """
    Starts the sum over ranks of their block ``rank`` of ``x`` (all blocks
    flat, one after the other); returns the function that waits for it, in
    ``x``'s dtype and ``shape``.
    """
    dtype = x.dtype
    world, rank = len(lengths), call.rank
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, lengths, rank, x.device)
    flat = x.reshape(-1)
    o = offsets(lengths)
    # The sum runs in float32 at least, in this rank's buffer, seeded with
    # its own block; the peers' blocks are added in a fixed order.
    acc = lease(shape, torch.promote_types(torch.float32, dtype), x.device)
    sends = [([r], Flat(flat[o[r] : o[r + 1]], padded[r])) for r in send_order(rank, world)]
    recvs = [(s, Flat(acc.view(-1), padded[rank])) for s in recv_order(rank, world)]

    def seed(part: int, parts: int) -> None:
        # The own block seeds the sum before the first peer's is added.
        if part == 0:
            acc.view(-1).copy_(flat[o[rank] : o[rank + 1]])

    finish = start_exchange(
        sends,
        recvs,
        codec,
        ctx,
        call,
        dtype,
        chunk_bytes,
        add=True,
        local=seed,
        background=background,
    )

    def done() -> torch.Tensor:
        finish()
        return acc.to(dtype)

    return done


def gather_blocks(
    mine: torch.Tensor,
    lengths: list[int],
    codec: Any,
    call: Call,
    shape: tuple[int, ...],
    chunk_bytes: int | None,
    background: bool = False,
) -> Callable[[], torch.Tensor]:
    """
    Starts sending this rank's block ``mine`` to every rank, encoded once, and
    receiving theirs; returns the function that waits for every rank's block,
    one after the other in rank order, as ``shape``.
    """
    world, rank = len(lengths), call.rank
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, lengths, rank, mine.device)
    flat_mine = mine.reshape(-1)
    out = lease(shape, mine.dtype, mine.device)
    flat = out.view(-1)
    o = offsets(lengths)
    sends = [(send_order(rank, world), Flat(flat_mine, padded[rank]))]
    recvs = [(s, Flat(flat[o[s] : o[s + 1]], padded[s])) for s in recv_order(rank, world)]
    finish = start_exchange(
        sends,
        recvs,
        codec,
        ctx,
        call,
        mine.dtype,
        chunk_bytes,
        local=copy_in_parts(flat[o[rank] : o[rank + 1]], flat_mine),
        background=background,
    )

    def done() -> torch.Tensor:
        finish()
        return out

    return done
