r"""
The pooled-embedding all-to-all: every rank holds its tables' pooled
embeddings for the whole global batch and receives every table's columns for
its own part of the batch (TorchRec's ``POOLED_EMBEDDINGS_ALL_TO_ALL``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qcomm.awaitable import Awaitable
from qcomm.collectives import _buffers
from qcomm.collectives._args import (
    check_flag,
    check_input,
    check_splits,
    resolve_codecs,
    resolve_group,
)
from qcomm.collectives._pending import Pending
from qcomm.collectives._verify import Agreement
from qcomm.collectives._wire import (
    all_to_all,
    assemble,
    decode_segments,
    encodable,
    encode_segments,
    padded_lengths,
    quantized_sizes,
)
from qcomm.types import CommOp

__all__ = ["all_to_all_pooled"]


def all_to_all_pooled(
    input: torch.Tensor,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    *,
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    gradient_division: bool = False,
) -> Awaitable[torch.Tensor]:
    r"""
    all_to_all_pooled(input, batch_size_per_rank, dim_sum_per_rank, *, group=None, codecs=None, gradient_division=False) -> Awaitable[Tensor]

    All-to-all of pooled embeddings, encoded with a codec on each pass.

    Rank :math:`k` sends rows ``sum(batch_size_per_rank[:r])`` onwards
    (``batch_size_per_rank[r]`` of them) to rank :math:`r`, which places them
    in its output's columns ``sum(dim_sum_per_rank[:k])`` onwards. With
    :math:`B_r` = ``batch_size_per_rank[r]`` and :math:`D_r` =
    ``dim_sum_per_rank[r]``, the input on rank :math:`k` is
    :math:`[\sum_r B_r, D_k]` and the output is :math:`[B_k, \sum_r D_r]`.

    The communication starts at once; the result is decoded and laid out on
    :meth:`~qcomm.Awaitable.wait`. The forward codec pads each rank's columns
    to what its :meth:`~qcomm.QuantizedCommCodec.padded_size` asks for, every
    destination's block is encoded on its own, and the padding is stripped
    after decoding. The output is differentiable: its gradient goes back
    through the inverse all-to-all, padded and encoded the same way with the
    backward codec.

    .. note::
        Every rank of ``group`` must make the same sequence of calls with the
        same ``batch_size_per_rank``, ``dim_sum_per_rank`` and codecs, and
        must run the backward pass if any rank does.

        The ranks check that they agree before the first call of each
        collective on each group (every call with ``QCOMM_VERIFY=1``, never
        with ``QCOMM_VERIFY=0``; the same setting on all ranks): one small
        exchange, after which ranks that disagree all raise
        :class:`~qcomm.CodecError` naming the rank and the argument, and a
        rank whose own arguments are invalid makes the others raise instead
        of waiting for it.

    .. warning::
        With a codec that returns its input (the no-op codec), the input's
        memory is sent as it is: do not modify ``input`` in place before
        :meth:`~qcomm.Awaitable.wait`.

    Args:
        input (Tensor): ``[sum(batch_size_per_rank), dim_sum_per_rank[rank]]``
            floating-point pooled embeddings of this rank's tables.
        batch_size_per_rank (list[int]): every rank's batch size.
        dim_sum_per_rank (list[int]): every rank's sum of embedding dims.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs; the data travels in its
            own dtype).
        gradient_division (bool, optional): divide the input's gradient by
            the world size, as TorchRec does by default. Default: ``False``
            (the true gradient).

    Returns:
        Awaitable[Tensor]: the ``[batch_size_per_rank[rank], sum(dim_sum_per_rank)]``
        output, in ``input``'s dtype, after :meth:`~qcomm.Awaitable.wait`.

    Raises:
        TypeError: if ``input`` is not a floating-point tensor, a split list
            holds something other than ints, or a codec does not follow the
            contract.
        ValueError: if shapes and split lists disagree, or the device does not
            suit the backend.
        CodecError: if a codec breaks its contract (e.g. an encoded size
            differing from ``calc_quantized_size``) or cannot run on the
            device, or the ranks disagree on ``batch_size_per_rank``,
            ``dim_sum_per_rank`` or the codecs, or another rank's arguments
            are invalid (when checked, see the note).

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> pending = all_to_all_pooled(torch.ones(4, 3), [4], [3])
        >>> pending.wait().shape
        torch.Size([4, 3])
        >>> dist.destroy_process_group()
    """
    pg, rank, world = resolve_group(group)
    with Agreement(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, pg, rank, world, input) as agree:
        check_input(input, "input", pg, ndim=2)
        batches = check_splits(
            batch_size_per_rank, "batch_size_per_rank", world, input.shape[0], "input.shape[0]"
        )
        dims = check_splits(dim_sum_per_rank, "dim_sum_per_rank", world)
        if dims[rank] != input.shape[1]:
            raise ValueError(
                f"dim_sum_per_rank[{rank}]: expected this rank's width input.shape[1] "
                f"({input.shape[1]}), got {dims[rank]}"
            )
        divide = world if check_flag(gradient_division, "gradient_division") else 1
        forward, backward = resolve_codecs(codecs, input.dtype, input.device, pg)
        agree.same("batch_size_per_rank", batches)
        agree.same("dim_sum_per_rank", dims)
        agree.same("codecs.forward", forward)
        agree.same("codecs.backward", backward)
    finish = _start(input.detach(), batches, dims, rank, forward, pg)

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        return _backward(grad, batches, dims, rank, backward, pg, input.dtype, divide)

    return Pending(input, finish, backward_fn)


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _start(
    x: torch.Tensor,
    batches: list[int],
    dims: list[int],
    rank: int,
    codec: Any,
    group: dist.ProcessGroup,
) -> Callable[[], torch.Tensor]:
    dtype = x.dtype
    x = encodable(x, codec)
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, dims, rank, x.device, probe=x)
    pad = padded[rank] - dims[rank]
    # Rows are whole destination blocks: padding the columns once makes every
    # destination's block a run of whole padded rows.
    source = F.pad(x, (0, pad)) if pad else x.contiguous()
    wire, send_sizes = encode_segments(
        codec, ctx, source.view(-1), [b * padded[rank] for b in batches]
    )
    local = batches[rank]
    recv_lengths = [local * p for p in padded]
    recv_sizes = quantized_sizes(codec, ctx, recv_lengths)
    work, recv = all_to_all(wire, send_sizes, recv_sizes, group)

    def finish() -> torch.Tensor:
        work.wait()
        _, blocks = decode_segments(codec, ctx, list(recv.split(recv_sizes)), recv_lengths, recv)
        out = _columns(blocks, local, dims, padded, dtype, recv.device)
        _buffers.give(recv, out)
        return out

    return finish


def _columns(
    blocks: list[torch.Tensor],
    local: int,
    dims: list[int],
    padded: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    contributing = [s for s, d in enumerate(dims) if d > 0]
    if len(contributing) == 1 and padded == dims:
        # One source fills every column: its block is the output already.
        s = contributing[0]
        return blocks[s].view(local, dims[s]).to(dtype)
    # The layout change: each source's block becomes a band of columns.
    out = torch.empty((local, sum(dims)), dtype=dtype, device=device)
    cols = _offsets(dims)
    for s, block in enumerate(blocks):
        out[:, cols[s] : cols[s + 1]].copy_(block.view(local, padded[s])[:, : dims[s]])
    return out


def _backward(
    grad: torch.Tensor,
    batches: list[int],
    dims: list[int],
    rank: int,
    codec: Any,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    divide: int,
) -> torch.Tensor:
    local = batches[rank]
    g = encodable(grad, codec)
    cols = _offsets(dims)
    ctx = codec.create_context()
    mine = g[:, cols[rank] : cols[rank + 1]]
    padded = padded_lengths(codec, ctx, dims, rank, g.device, probe=mine)
    contributing = [r for r, d in enumerate(dims) if d > 0]
    if len(contributing) <= 1 and padded == dims:
        source = g.contiguous().view(-1)
    else:
        # The layout change the all-to-all needs (each destination's columns
        # as one run) and the padding happen in this one copy.
        source = _buffers.take(local * sum(padded), g.dtype, g.device)
        for r, block in enumerate(source.split([local * p for p in padded])):
            block2d = block.view(local, padded[r])
            block2d[:, : dims[r]].copy_(g[:, cols[r] : cols[r + 1]])
            block2d[:, dims[r] :].zero_()
    wire, send_sizes = encode_segments(codec, ctx, source, [local * p for p in padded])
    width = padded[rank]
    recv_lengths = [b * width for b in batches]
    recv_sizes = quantized_sizes(codec, ctx, recv_lengths)
    work, recv = all_to_all(wire, send_sizes, recv_sizes, group)
    work.wait()
    _buffers.give(source, grad)
    whole, blocks = decode_segments(codec, ctx, list(recv.split(recv_sizes)), recv_lengths, recv)
    shape = (sum(batches), dims[rank])
    if width == dims[rank]:
        grad_input = assemble(whole, blocks, shape, dtype)
    else:
        grad_input = torch.empty(shape, dtype=dtype, device=recv.device)
        rows = _offsets(batches)
        for s, block in enumerate(blocks):
            grad_input[rows[s] : rows[s + 1]].copy_(block.view(batches[s], width)[:, : dims[rank]])
    _buffers.give(recv, grad_input)
    if divide > 1:
        grad_input = grad_input.div_(divide)
    return grad_input
