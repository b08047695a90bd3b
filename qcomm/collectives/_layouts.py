"""
How each collective lays its tensors out as the exchange's regions, both
passes: the pooled all-to-all (rows out, columns in), the sequence all-to-all
(a flat segment per peer), and blocks summed or gathered (the reduce-scatter
and the all-gather, each the other's backward pass; ``lengths`` are every
rank's block in elements, padded to what the codec's ``padded_size`` asks for,
a block seen as one row).

Each takes ``codecs``, the codec of every rank (``codecs[p]`` for the data
between this rank and peer ``p``, both ways), and pads each peer's region to
what that peer's codec asks for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call
from qcomm.collectives._coding import PeerCodings, collective_of
from qcomm.collectives._exchange import (
    Flat,
    Rows,
    copy_in_parts,
    offsets,
    recv_order,
    send_order,
    start_exchange,
)


def _blocks(splits: list[int], rest: tuple[int, ...]) -> list[int]:
    """Every rank's block in elements: ``splits[r]`` rows of shape ``rest``."""
    return [s * math.prod(rest) for s in splits]


def sum_blocks(
    x: torch.Tensor,
    splits: list[int],
    codecs: list[Any],
    call: Call,
    chunk_bytes: int | None,
    background: bool = False,
) -> Callable[[], torch.Tensor]:
    """
    Starts the sum over ranks of their block ``rank`` of ``x`` (rank ``r``'s
    block is ``splits[r]`` rows, one after the other); returns the function
    that waits for it, ``[splits[rank], *x.shape[1:]]`` in ``x``'s dtype.
    """
    dtype, rest = x.dtype, tuple(x.shape[1:])
    lengths = _blocks(splits, rest)
    world, rank = len(lengths), call.rank
    shape = (splits[rank], *rest)
    codings = PeerCodings(codecs, dtype, collective_of(call.name))
    padded = codings.padded(lengths, rank, x.device)
    flat = x.reshape(-1)
    o = offsets(lengths)
    mine = flat[o[rank] : o[rank + 1]]
    # The sum runs in float32 at least, in this rank's buffer, over the
    # blocks in rank order, this rank's own in its place: every rank sums
    # x_0 + x_1 + ... + x_{W-1} in that order, the float sum a reference
    # computed from all ranks' data gives. An order that starts with the own
    # block differs from it in the last bits from 3 ranks on, on some ranks
    # only.
    acc = lease(shape, torch.promote_types(torch.float32, dtype), x.device)
    sends = [([r], Flat(flat[o[r] : o[r + 1]], padded[r][r])) for r in send_order(rank, world)]
    peers = [s for s in range(world) if s != rank]
    recvs = [(s, Flat(acc.view(-1), padded[s][rank])) for s in peers]
    started = added = False
    # A call waited for later has read its input when it returns: its own
    # block, added in its place later, is kept aside before then.
    own, keep = mine, None
    if background:
        own = mine if rank == 0 else lease((mine.numel(),), dtype, x.device)

        def keep(part: int, parts: int) -> None:
            nonlocal started, added
            if part == 0 and rank == 0:  # the sum starts with it
                acc.view(-1).copy_(mine)
                started = added = True
            elif part == 0:
                own.copy_(mine)

    def before(peer: int | None) -> None:
        # Runs before each peer's first message, in rank order, and at the end.
        nonlocal started, added
        if not started:
            started = True
            if rank == 0:
                acc.view(-1).copy_(own)
                added = True
            else:
                acc.zero_()
        if not added and (peer is None or peer > rank):
            acc.view(-1).add_(own)
            added = True

    finish = start_exchange(
        sends,
        recvs,
        codings,
        call,
        dtype,
        chunk_bytes,
        add=True,
        local=keep,
        background=background,
        before=before,
    )

    def done() -> torch.Tensor:
        finish()
        return acc.to(dtype)

    return done


def gather_blocks(
    mine: torch.Tensor,
    splits: list[int],
    codecs: list[Any],
    call: Call,
    chunk_bytes: int | None,
    background: bool = False,
) -> Then:
    """
    Starts sending this rank's block ``mine`` (``splits[rank]`` rows) to every
    rank, encoded once per codec, and receiving theirs (``splits[r]`` rows each);
    returns the function that waits for every rank's block, one after the
    other in rank order, as ``[sum(splits), *mine.shape[1:]]``.
    """
    rest = tuple(mine.shape[1:])
    lengths = _blocks(splits, rest)
    world, rank = len(lengths), call.rank
    shape = (sum(splits), *rest)
    codings = PeerCodings(codecs, mine.dtype, collective_of(call.name))
    padded = codings.padded(lengths, rank, mine.device)
    flat_mine = mine.reshape(-1)
    out = lease(shape, mine.dtype, mine.device)
    flat = out.view(-1)
    o = offsets(lengths)
    sends = [
        (peers, Flat(flat_mine, padded[peers[0]][rank]))
        for peers in codings.groups(send_order(rank, world))
    ]
    recvs = [(s, Flat(flat[o[s] : o[s + 1]], padded[s][s])) for s in recv_order(rank, world)]
    finish = start_exchange(
        sends,
        recvs,
        codings,
        call,
        mine.dtype,
        chunk_bytes,
        local=copy_in_parts(flat[o[rank] : o[rank + 1]], flat_mine),
        background=background,
    )
    return _then(finish, out)


def pooled_forward(
    x: torch.Tensor,
    batches: list[int],
    dims: list[int],
    codecs: list[Any],
    call: Call,
    chunk_bytes: int | None,
) -> Then:
    """
    Starts the pooled all-to-all: rank ``k`` sends rows ``rows[r]`` of its
    ``[sum B, D_k]`` input to rank ``r``, which receives them as columns
    ``cols[k]`` of its ``[B_r, sum D]`` output; returns the function that
    waits for the output.
    """
    rank = call.rank
    codings = PeerCodings(codecs, x.dtype, collective_of(call.name))
    padded = codings.padded(dims, rank, x.device, probe=x)
    rows, cols = offsets(batches), offsets(dims)
    out = lease((batches[rank], cols[-1]), x.dtype, x.device)
    band = [out[:, cols[s] : cols[s + 1]] for s in range(len(dims))]
    sends = [
        ([r], Rows(x[rows[r] : rows[r + 1]], padded[r][rank])) for r in send_order(rank, len(dims))
    ]
    recvs = [(s, Rows(band[s], padded[s][s])) for s in recv_order(rank, len(dims))]
    local = copy_in_parts(band[rank], x[rows[rank] : rows[rank + 1]])
    finish = start_exchange(
        sends, recvs, codings, call, x.dtype, chunk_bytes, local=local, background=True
    )
    return _then(finish, out)


def pooled_backward(
    grad: torch.Tensor,
    batches: list[int],
    dims: list[int],
    codecs: list[Any],
    call: Call,
    divide: int,
    chunk_bytes: int | None,
) -> torch.Tensor:
    """
    The pooled all-to-all's backward pass: columns ``cols[r]`` of the
    ``[B_k, sum D]`` gradient go back to rank ``r`` as rows ``rows[k]`` of its
    ``[sum B, D_r]`` input gradient, in ``grad``'s dtype (the input's).
    """
    g = grad
    dtype = g.dtype
    rank = call.rank
    codings = PeerCodings(codecs, dtype, collective_of(call.name))
    rows, cols = offsets(batches), offsets(dims)
    band = [g[:, cols[r] : cols[r + 1]] for r in range(len(dims))]
    padded = codings.padded(dims, rank, g.device, probe=band[rank])
    grad_input = lease((rows[-1], dims[rank]), dtype, g.device)
    block = [grad_input[rows[s] : rows[s + 1]] for s in range(len(batches))]
    sends = [([r], Rows(band[r], padded[r][r])) for r in send_order(rank, len(batches))]
    recvs = [(s, Rows(block[s], padded[s][rank])) for s in recv_order(rank, len(batches))]
    start_exchange(
        sends,
        recvs,
        codings,
        call,
        dtype,
        chunk_bytes,
        local=copy_in_parts(block[rank], band[rank]),
    )()
    if divide > 1:
        grad_input.div_(divide)
    return grad_input


def sequence_exchange(
    x: torch.Tensor,
    send_rows: list[int],
    recv_rows: list[int],
    codecs: list[Any],
    call: Call,
    chunk_bytes: int | None,
    background: bool = False,
) -> Then:
    """
    Starts the sequence all-to-all (either pass): ``send_rows[r]`` rows of
    ``x`` to rank ``r``, ``recv_rows[s]`` rows from rank ``s``, each peer's
    rows one flat segment padded at its end to what the codec's
    ``padded_size`` asks for (the segment seen as one row); returns the
    function that waits for the ``[sum(recv_rows), *x.shape[1:]]`` output in
    ``x``'s dtype.
    """
    rest, dtype = tuple(x.shape[1:]), x.dtype
    width = math.prod(rest)
    world, rank = len(send_rows), call.rank
    send_lengths = [n * width for n in send_rows]
    recv_lengths = [n * width for n in recv_rows]
    codings = PeerCodings(codecs, dtype, collective_of(call.name))
    padded = codings.padded(send_lengths + recv_lengths, rank, x.device)
    source = x.reshape(-1)
    out = lease((sum(recv_rows), *rest), dtype, x.device)
    flat = out.view(-1)
    so, ro = offsets(send_lengths), offsets(recv_lengths)
    sends = [([r], Flat(source[so[r] : so[r + 1]], padded[r][r])) for r in send_order(rank, world)]
    recvs = [
        (s, Flat(flat[ro[s] : ro[s + 1]], padded[s][world + s])) for s in recv_order(rank, world)
    ]
    finish = start_exchange(
        sends,
        recvs,
        codings,
        call,
        dtype,
        chunk_bytes,
        local=copy_in_parts(flat[ro[rank] : ro[rank + 1]], source[so[rank] : so[rank + 1]]),
        background=background,
    )
    return _then(finish, out)


class Then:
    """
    Finishes an exchange, then returns its output, which exists from the
    start (:attr:`out`: the call's output is tied into the autograd graph
    when the call is made, see :class:`~._pending.Pending`).
    """

    __slots__ = ("_finish", "out")

    def __init__(self, finish: Callable[[], None], out: torch.Tensor) -> None:
        self._finish = finish
        self.out = out

    def __call__(self) -> torch.Tensor:
        self._finish()
        return self.out


def _then(finish: Callable[[], None], out: torch.Tensor) -> Then:
    """The function that finishes the exchange, then returns ``out``."""
    return Then(finish, out)
