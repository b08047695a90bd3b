r"""
The sequence-embedding all-to-all: rows of a ``[N, D]`` tensor go to the
rank that needs them (TorchRec's ``SEQUENCE_EMBEDDINGS_ALL_TO_ALL``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qcomm.awaitable import Awaitable
from qcomm.collectives._args import (
    check_chunk_bytes,
    check_input,
    check_splits,
    resolve_codecs,
)
from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call, begin
from qcomm.collectives._exchange import (
    Flat,
    copy_in_parts,
    offsets,
    recv_order,
    send_order,
    start_exchange,
)
from qcomm.collectives._pending import Pending
from qcomm.collectives._wire import padded_lengths

__all__ = ["all_to_all_sequence"]


def all_to_all_sequence(
    input: torch.Tensor,
    *,
    input_splits: list[int],
    output_splits: list[int],
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    chunk_bytes: int | None = None,
) -> Awaitable[torch.Tensor]:
    r"""
    all_to_all_sequence(input, *, input_splits, output_splits, group=None, codecs=None, chunk_bytes=None) -> Awaitable[Tensor]

    All-to-all of rows (sequence embeddings), encoded with a codec on each pass.

    Rank :math:`k` sends ``input_splits[r]`` consecutive rows to rank
    :math:`r`, in rank order; rank :math:`r` receives ``output_splits[k]``
    rows from rank :math:`k`, in rank order, so ``output_splits[k]`` on rank
    :math:`r` must equal ``input_splits[r]`` on rank :math:`k`. Each block is
    padded at its end to what the codec's
    :meth:`~qcomm.QuantizedCommCodec.padded_size` asks for (the block seen as
    one row). The gradient goes back through the reverse all-to-all.

    See :mod:`qcomm.collectives` for what all three collectives share.

    Args:
        input (Tensor): ``[sum(input_splits), D]`` floating-point rows (any
            trailing shape travels with its row).
        input_splits (list[int]): rows sent to every rank.
        output_splits (list[int]): rows received from every rank.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs: the data travels in its
            own dtype).
        chunk_bytes (int, optional): the pipeline's chunk size in float32
            bytes. Default: ``None`` (automatic).

    Returns:
        Awaitable[Tensor]: the ``[sum(output_splits), D]`` rows, in ``input``'s
        dtype.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if shapes and split lists disagree, or the device does not
            suit the backend.
        CodecError: if a codec fails or breaks its contract, the ranks' splits
            do not mirror each other, the ranks disagree otherwise, or another
            rank's arguments are invalid.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.arange(6.0).view(3, 2)
        >>> all_to_all_sequence(x, input_splits=[3], output_splits=[3]).wait().equal(x)
        True
        >>> dist.destroy_process_group()
    """
    with begin("all_to_all_sequence forward", group, input, "all_to_all_sequence") as call:
        pg, world = call.group, call.world
        with call.agreement("all_to_all_sequence", input) as agree:
            check_input(input, "input", pg)
            sends = check_splits(
                input_splits, "input_splits", world, input.shape[0], "input.shape[0]"
            )
            recvs = check_splits(output_splits, "output_splits", world)
            chunk = check_chunk_bytes(chunk_bytes)
            forward, backward = resolve_codecs(codecs, input.dtype, input.device, pg)
            rest = tuple(input.shape[1:])
            agree.same("input.shape[1:]", rest)
            agree.same("codecs.forward", forward)
            agree.same("codecs.backward", backward)
            agree.same("chunk_bytes", [chunk or 0])
            agree.mirror(sends, recvs)
        dtype = input.dtype
        finish = _start(input.detach(), sends, recvs, rest, forward, call, dtype, chunk)
        # Named after its forward call: ranks that run their backward passes
        # in different orders (outputs waited for in different orders) raise
        # instead of swapping gradients.
        backward_name = f"all_to_all_sequence backward of call {call.transport.number}"

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        with begin(backward_name, pg, grad) as back:
            return _start(grad, recvs, sends, rest, backward, back, dtype, chunk)()

    return Pending(input, finish, backward_fn)


def _start(
    x: torch.Tensor,
    send_rows: list[int],
    recv_rows: list[int],
    rest: tuple[int, ...],
    codec: Any,
    call: Call,
    dtype: torch.dtype,
    chunk_bytes: int | None,
) -> Callable[[], torch.Tensor]:
    # Each peer's rows are one flat segment, padded at its end to what the
    # codec's padded_size asks for the segment seen as one row.
    width = math.prod(rest)
    world, rank = len(send_rows), call.rank
    send_lengths = [n * width for n in send_rows]
    recv_lengths = [n * width for n in recv_rows]
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, send_lengths + recv_lengths, rank, x.device)
    source = x.to(dtype).reshape(-1)
    out = lease((sum(recv_rows), *rest), dtype, x.device)
    flat = out.view(-1)
    so, ro = offsets(send_lengths), offsets(recv_lengths)
    sends = [([r], Flat(source[so[r] : so[r + 1]], padded[r])) for r in send_order(rank, world)]
    recvs = [(s, Flat(flat[ro[s] : ro[s + 1]], padded[world + s])) for s in recv_order(rank, world)]
    finish = start_exchange(
        sends,
        recvs,
        codec,
        ctx,
        call.transport,
        dtype,
        chunk_bytes,
        call=call.name,
        local=copy_in_parts(flat[ro[rank] : ro[rank + 1]], source[so[rank] : so[rank + 1]]),
        background=True,
    )

    def done() -> torch.Tensor:
        finish()
        return out

    return done
