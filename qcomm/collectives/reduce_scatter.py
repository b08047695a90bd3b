r"""
The pooled-embedding reduce-scatter: every rank holds partial sums for every
rank's block and receives the total of its own block (TorchRec's
``POOLED_EMBEDDINGS_REDUCE_SCATTER``).

A summable codec's wire tensors are summed by the backend's native
reduce-scatter. Any other codec goes through an all-to-all of encoded blocks
and a local float32 sum after decoding, because the sum of two scaled wire
tensors is not the encoding of the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

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
    all_gather_single,
    assemble,
    decode_segments,
    encodable,
    encode_segments,
    exchange_segments,
    pad_segments,
    padded_lengths,
    quantized_sizes,
    reduce_scatter_single,
)
from qcomm.types import CommOp, codec_info

__all__ = ["reduce_scatter_pooled"]


def reduce_scatter_pooled(
    input: torch.Tensor,
    *,
    input_splits: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    gradient_division: bool = False,
) -> Awaitable[torch.Tensor]:
    r"""
    reduce_scatter_pooled(input, *, input_splits=None, group=None, codecs=None, gradient_division=False) -> Awaitable[Tensor]

    Reduce-scatter of pooled embeddings along dim 0, encoded with a codec on
    each pass.

    ``input`` is split on dim 0 into one block per rank (``input_splits[r]``
    rows for rank :math:`r`); the output on rank :math:`r` is the sum over all
    ranks of their block :math:`r`:

    .. math::

        \text{output}_r = \sum_{k} \text{input}^{(k)}_{[o_r, o_r + s_r)}, \quad
        o_r = \sum_{j < r} s_j

    A codec whose :class:`~qcomm.CodecInfo` says ``summable`` is summed by
    the backend in its wire dtype; any other codec's blocks travel through an
    all-to-all and are summed in float32 after decoding. Each block is padded
    at its end to what the codec's
    :meth:`~qcomm.QuantizedCommCodec.padded_size` asks for (the block seen as
    one row) and the padding is stripped after decoding. The gradient goes
    back through an all-gather encoded with the backward codec.

    .. note::
        Every rank of ``group`` must make the same sequence of calls with the
        same ``input_splits``, trailing shape and codecs, and must run the
        backward pass if any rank does.

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
        input (Tensor): ``[sum(input_splits), ...]`` floating-point partial sums.
        input_splits (list[int], optional): rows of every rank's block.
            Default: ``None`` (equal blocks; dim 0 must divide by the world size).
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs; the data travels in its
            own dtype).
        gradient_division (bool, optional): divide the input's gradient by
            the world size, as TorchRec does by default. Default: ``False``
            (the true gradient).

    Returns:
        Awaitable[Tensor]: the ``[input_splits[rank], ...]`` sum, in ``input``'s
        dtype, after :meth:`~qcomm.Awaitable.wait`.

    Raises:
        TypeError: if ``input`` is not a floating-point tensor, ``input_splits``
            holds something other than ints, or a codec does not follow the
            contract.
        ValueError: if shapes and ``input_splits`` disagree, or the device does
            not suit the backend.
        CodecError: if a codec breaks its contract or cannot run on the
            device, or the ranks disagree on ``input_splits``, the trailing
            shape or the codecs, or another rank's arguments are invalid
            (when checked, see the note).

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> reduce_scatter_pooled(torch.ones(2, 3)).wait().sum().item()
        6.0
        >>> dist.destroy_process_group()
    """
    pg, rank, world = resolve_group(group)
    with Agreement(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER, pg, rank, world, input) as agree:
        check_input(input, "input", pg)
        rows = input.shape[0]
        if input_splits is None:
            if rows % world:
                raise ValueError(
                    f"input: with input_splits=None, expected dim 0 divisible by the world size "
                    f"({world}), got {rows}"
                )
            splits = [rows // world] * world
        else:
            splits = check_splits(input_splits, "input_splits", world, rows, "input.shape[0]")
        divide = world if check_flag(gradient_division, "gradient_division") else 1
        forward, backward = resolve_codecs(codecs, input.dtype, input.device, pg)
        rest = tuple(input.shape[1:])
        agree.same("input_splits", splits)
        agree.same("input.shape[1:]", rest)
        agree.same("codecs.forward", forward)
        agree.same("codecs.backward", backward)
    lengths = [s * math.prod(rest) for s in splits]
    out_shape = (splits[rank], *rest)
    flat = input.detach().reshape(-1)
    if codec_info(forward).summable:
        finish = _start_native(flat, lengths, rank, forward, pg, out_shape)
    else:
        finish = _start_exchange(flat, lengths, rank, forward, pg, out_shape)
    in_shape = tuple(input.shape)

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        return _all_gather(grad, lengths, rank, backward, pg, in_shape, input.dtype, divide)

    return Pending(input, finish, backward_fn)


def _start_native(
    flat: torch.Tensor,
    lengths: list[int],
    rank: int,
    codec: Any,
    group: dist.ProcessGroup,
    out_shape: tuple[int, ...],
) -> Callable[[], torch.Tensor]:
    dtype = flat.dtype
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, lengths, rank, flat.device)
    source = pad_segments(encodable(flat, codec), lengths, padded)
    wire, sizes = encode_segments(codec, ctx, source, padded)
    out = _buffers.take(sizes[rank], wire.dtype, wire.device)
    if len(set(sizes)) == 1:
        work = reduce_scatter_single(out, wire, group=group, async_op=True)
    else:
        # gloo and NCCL both take uneven blocks through the list form.
        work = dist.reduce_scatter(out, list(wire.split(sizes)), group=group, async_op=True)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        _, blocks = decode_segments(codec, ctx, [out], [padded[rank]], out)
        result = blocks[0][: lengths[rank]].view(out_shape).to(dtype)
        _buffers.give(out, result)
        return result

    return finish


def _start_exchange(
    flat: torch.Tensor,
    lengths: list[int],
    rank: int,
    codec: Any,
    group: dist.ProcessGroup,
    out_shape: tuple[int, ...],
) -> Callable[[], torch.Tensor]:
    dtype = flat.dtype
    world = len(lengths)

    def total(whole: torch.Tensor | None, blocks: list[torch.Tensor]) -> torch.Tensor:
        # Sum in float32 at least, whatever the wire and input dtypes.
        acc = blocks[0].to(torch.promote_types(torch.float32, dtype), copy=True)
        for block in blocks[1:]:
            acc.add_(block)
        return acc.view(out_shape).to(dtype)

    return exchange_segments(flat, lengths, [lengths[rank]] * world, codec, rank, group, total)


def _all_gather(
    grad: torch.Tensor,
    lengths: list[int],
    rank: int,
    codec: Any,
    group: dist.ProcessGroup,
    in_shape: tuple[int, ...],
    dtype: torch.dtype,
    divide: int,
) -> torch.Tensor:
    ctx = codec.create_context()
    padded = padded_lengths(codec, ctx, lengths, rank, grad.device)
    flat = encodable(grad, codec).reshape(-1)
    source = pad_segments(flat, [lengths[rank]], [padded[rank]])
    wire, _ = encode_segments(codec, ctx, source, [padded[rank]])
    sizes = quantized_sizes(codec, ctx, padded)
    # all_gather_single wants equal pieces (gloo has no uneven
    # all-gather): pad every rank's wire to the largest.
    widest = max(sizes)
    if widest > wire.numel():
        wire = torch.cat([wire, wire.new_zeros(widest - wire.numel())])
    gathered = _buffers.take(widest * len(sizes), wire.dtype, wire.device)
    if widest:
        all_gather_single(gathered, wire, group=group, async_op=True).wait()
    pieces = [gathered[r * widest : r * widest + size] for r, size in enumerate(sizes)]
    even = all(size == widest for size in sizes)
    whole, blocks = decode_segments(codec, ctx, pieces, padded, gathered if even else None)
    if padded != lengths:
        whole, blocks = None, [b[:n] for b, n in zip(blocks, lengths)]
    grad_input = assemble(whole, blocks, in_shape, dtype)
    _buffers.give(gathered, grad_input)
    if divide > 1:
        grad_input = grad_input.div_(divide)
    return grad_input
