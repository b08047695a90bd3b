r"""
Segments on the wire: the split and padding arithmetic and the codec calls
that every collective shares.

A collective moves *segments*: consecutive runs of a flat tensor, one per
destination (or per source). Each segment is padded to the length the codec
asks for through ``padded_size``, encoded on its own (so that whatever a codec
keeps in-band, such as a scale per block, arrives with its segment), sent, and
decoded on its own. Element-wise codecs (a :class:`~qcomm.CodecInfo` with
``error_block == 1`` whose sizes add up) are encoded and decoded in one call
over all segments instead, which saves a copy: the segments of such a codec
are just slices of the whole.

Every codec call is checked against the contract: an encoded tensor of the
wrong size or dtype, or a decoded one of the wrong length, raises
:class:`~qcomm.CodecError` naming the codec before anything is sent or used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from qcomm.collectives import _buffers
from qcomm.types import CodecError, CodecInfo, codec_info, read_quantized_dtype

T = TypeVar("T")


def _name(codec: Any) -> str:
    return codec_info(codec).name


def _guard(codec: Any, what: str, fn: Callable[[], T]) -> T:
    # A codec failing inside a collective would otherwise surface as a bare
    # assertion from deep inside some kernel; name the codec and the step.
    try:
        return fn()
    except CodecError:
        raise
    except Exception as err:
        raise CodecError(
            f"codec {_name(codec)!r}: {what} failed: {type(err).__name__}: {err}"
        ) from err


def wire_dtype(codec: Any) -> torch.dtype:
    r"""
    wire_dtype(codec: Any) -> torch.dtype

    The codec's ``quantized_dtype``, read as a property or (TorchRec's no-op
    codec) called as a method.

    Args:
        codec (Any): the codec.

    Returns:
        torch.dtype: the dtype of its wire tensors.

    Raises:
        CodecError: if it is not a ``torch.dtype``.
    """
    dtype = read_quantized_dtype(codec)
    if not isinstance(dtype, torch.dtype):
        raise CodecError(
            f"codec {_name(codec)!r}: quantized_dtype must be a torch.dtype, got {dtype!r}"
        )
    return dtype


def encodable(x: torch.Tensor, codec: Any) -> torch.Tensor:
    r"""
    encodable(x: Tensor, codec: Any) -> Tensor

    What ``encode`` is given: ``x`` itself when it is float32 or already of
    the wire dtype, else ``x`` converted to float32 (the dtype codecs are
    written for).

    Args:
        x (Tensor): the data to send.
        codec (Any): the codec that will encode it.

    Returns:
        Tensor: ``x`` or its float32 copy.
    """
    if x.dtype in (torch.float32, wire_dtype(codec)):
        return x
    return x.float()


def _elementwise(codec: Any) -> bool:
    # Only a codec that declares it shares nothing between elements may be
    # encoded across segment boundaries; foreign codecs get the safe path.
    info = getattr(codec, "info", None)
    return isinstance(info, CodecInfo) and info.error_block == 1


def quantized_sizes(codec: Any, ctx: Any, lengths: list[int]) -> list[int]:
    r"""
    quantized_sizes(codec: Any, ctx: Any, lengths: list[int]) -> list[int]

    The wire size of each length, from ``calc_quantized_size``.

    Args:
        codec (Any): the codec.
        ctx (Any): the call's context.
        lengths (list[int]): input lengths.

    Returns:
        list[int]: wire elements for each length.

    Raises:
        CodecError: if the codec fails or answers something else than a
            non-negative int.
    """
    sizes = []
    for n in lengths:
        size = _guard(
            codec, f"calc_quantized_size({n})", functools.partial(codec.calc_quantized_size, n, ctx)
        )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CodecError(
                f"codec {_name(codec)!r}: calc_quantized_size({n}) must return a non-negative int, "
                f"got {size!r}"
            )
        sizes.append(size)
    return sizes


def _whole(codec: Any, ctx: Any, lengths: list[int], sizes: list[int]) -> bool:
    if not _elementwise(codec) or len(lengths) == 1:
        return False
    return quantized_sizes(codec, ctx, [sum(lengths)])[0] == sum(sizes)


def padded_lengths(
    codec: Any,
    ctx: Any,
    lengths: list[int],
    index: int,
    device: torch.device,
    probe: torch.Tensor | None = None,
) -> list[int]:
    r"""
    padded_lengths(codec: Any, ctx: Any, lengths: list[int], index: int, device: torch.device, probe: Tensor | None = None) -> list[int]

    The codec's padded width for every entry of ``lengths``.

    ``padded_size`` is asked once about entry ``index`` and is expected to
    record every entry's width in ``ctx.padded_dim_sum_per_rank``; a codec
    whose context does not record them is asked about each entry in turn.
    The padding of an entry must depend on its width alone, so that sender
    and receiver, each asking with their own context, agree.

    Args:
        codec (Any): the codec.
        ctx (Any): the call's context.
        lengths (list[int]): the widths (``dim_per_rank`` of ``padded_size``).
        index (int): the entry asked about (``my_rank``).
        device (torch.device): where empty probes are made.
        probe (Tensor, optional): the ``[rows, lengths[index]]`` input to show
            the codec. Default: ``None`` (an empty one).

    Returns:
        list[int]: the padded widths.

    Raises:
        CodecError: if the codec fails, answers inconsistently or shrinks a width.
    """

    def ask(i: int, tensor: torch.Tensor) -> int:
        result = _guard(
            codec,
            "padded_size",
            lambda: codec.padded_size(tensor, list(lengths), i, ctx),
        )
        if not (isinstance(result, tuple) and len(result) == 2):
            raise CodecError(
                f"codec {_name(codec)!r}: padded_size must return (padded_dim_sum, padding_size), "
                f"got {result!r}"
            )
        return int(result[0])

    def empty(n: int) -> torch.Tensor:
        return torch.empty((0, n), device=device)

    mine = ask(index, probe if probe is not None else empty(lengths[index]))
    recorded = getattr(ctx, "padded_dim_sum_per_rank", None) if ctx is not None else None
    if recorded is not None:
        padded = [int(p) for p in recorded]
    else:
        padded = [mine if i == index else ask(i, empty(n)) for i, n in enumerate(lengths)]
    if len(padded) != len(lengths) or padded[index] != mine:
        raise CodecError(
            f"codec {_name(codec)!r}: padded_size recorded widths {padded} for {lengths}, "
            f"inconsistent with its answer {mine} for entry {index}"
        )
    for n, p in zip(lengths, padded):
        if p < n:
            raise CodecError(
                f"codec {_name(codec)!r}: padded_size shrank width {n} to {p}; padding only grows"
            )
    return padded


def pad_segments(flat: torch.Tensor, lengths: list[int], padded: list[int]) -> torch.Tensor:
    r"""
    pad_segments(flat: Tensor, lengths: list[int], padded: list[int]) -> Tensor

    ``flat`` with each segment zero-padded at its end to its padded length.

    Args:
        flat (Tensor): 1-D, the segments end to end.
        lengths (list[int]): the segments' lengths.
        padded (list[int]): their padded lengths.

    Returns:
        Tensor: ``flat`` itself when nothing is padded, else a padded copy.
    """
    if padded == lengths:
        return flat
    out = flat.new_zeros(sum(padded))
    for src, dst, n in zip(flat.split(lengths), out.split(padded), lengths):
        dst[:n].copy_(src)
    return out


def _encode(codec: Any, ctx: Any, x: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    wire = _guard(codec, f"encode of {x.numel()} elements", lambda: codec.encode(x, ctx))
    if not isinstance(wire, torch.Tensor):
        raise CodecError(
            f"codec {_name(codec)!r}: encode must return a tensor, got {type(wire).__name__}"
        )
    if wire.dtype != dtype or wire.numel() != size or wire.device != x.device:
        raise CodecError(
            f"codec {_name(codec)!r}: encode of {x.numel()} elements returned {wire.numel()} "
            f"{wire.dtype} elements on {wire.device}; calc_quantized_size and quantized_dtype "
            f"promise {size} {dtype} elements on {x.device}"
        )
    return wire.reshape(-1)


def encode_segments(
    codec: Any, ctx: Any, source: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    r"""
    encode_segments(codec: Any, ctx: Any, source: Tensor, lengths: list[int]) -> tuple[Tensor, list[int]]

    Encodes the consecutive segments of ``source``, each on its own (or all in
    one call for an element-wise codec), checking every result against the
    codec's promises.

    Args:
        codec (Any): the codec.
        ctx (Any): the call's context.
        source (Tensor): 1-D, the segments end to end.
        lengths (list[int]): the segments' lengths.

    Returns:
        tuple[Tensor, list[int]]: the wire and each segment's wire size.

    Raises:
        CodecError: if the codec fails or returns a wire of another size,
            dtype or device than it promised.
    """
    dtype = wire_dtype(codec)
    sizes = quantized_sizes(codec, ctx, lengths)
    if _whole(codec, ctx, lengths, sizes):
        return _encode(codec, ctx, source, sum(sizes), dtype), sizes
    # Every segment is encoded, empty ones included: a codec may write a
    # header even for no data, and fills its context on encode.
    parts = [
        _encode(codec, ctx, segment, size, dtype)
        for segment, size in zip(source.split(lengths), sizes)
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), sizes


def _decode(codec: Any, ctx: Any, wire: torch.Tensor, length: int) -> torch.Tensor:
    if wire.numel() == 0 and length == 0:
        return wire.new_empty(0, dtype=torch.float32)
    if wire.storage_offset() * wire.element_size() % 4:
        # TorchRec always hands decode a fresh buffer, and codecs that view
        # in-band float32 scales in a byte wire rely on it; a piece of a
        # larger wire may start at any byte, so give it an aligned copy (of
        # the wire, not of the decoded data).
        wire = wire.clone()
    out = _guard(codec, f"decode of {wire.numel()} wire elements", lambda: codec.decode(wire, ctx))
    if not isinstance(out, torch.Tensor) or out.numel() != length:
        got = f"{out.numel()} elements" if isinstance(out, torch.Tensor) else type(out).__name__
        raise CodecError(
            f"codec {_name(codec)!r}: decode of {wire.numel()} wire elements returned {got}, "
            f"expected {length} elements"
        )
    return out.reshape(-1)


def decode_segments(
    codec: Any,
    ctx: Any,
    pieces: list[torch.Tensor],
    lengths: list[int],
    whole: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    r"""
    decode_segments(codec: Any, ctx: Any, pieces: list[Tensor], lengths: list[int], whole: Tensor | None = None) -> tuple[Tensor | None, list[Tensor]]

    Decodes wire ``pieces`` into 1-D blocks of ``lengths``.

    Args:
        codec (Any): the codec.
        ctx (Any): the call's context.
        pieces (list[Tensor]): one wire piece per block.
        lengths (list[int]): the decoded length of each.
        whole (Tensor, optional): the wire the pieces are consecutive slices
            of, which an element-wise codec decodes in one call.
            Default: ``None``.

    Returns:
        tuple[Tensor | None, list[Tensor]]: the blocks end to end as one
        tensor where they already are (else ``None``), and the blocks.

    Raises:
        CodecError: if the codec fails or returns another length.
    """
    sizes = [p.numel() for p in pieces]
    if whole is not None and _whole(codec, ctx, lengths, sizes):
        decoded = _decode(codec, ctx, whole, sum(lengths))
        return decoded, list(decoded.split(lengths))
    blocks = [_decode(codec, ctx, p, n) for p, n in zip(pieces, lengths)]
    if len(blocks) == 1:
        return blocks[0], blocks
    return None, blocks


def all_to_all(
    wire: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: dist.ProcessGroup
) -> tuple[Any, torch.Tensor]:
    r"""
    all_to_all(wire: Tensor, send_sizes: list[int], recv_sizes: list[int], group: ProcessGroup) -> tuple[Work, Tensor]

    Starts an asynchronous all-to-all of a wire tensor.

    Args:
        wire (Tensor): 1-D, the segments for every rank end to end.
        send_sizes (list[int]): wire elements for each rank.
        recv_sizes (list[int]): wire elements from each rank.
        group (ProcessGroup): the group.

    Returns:
        tuple[Work, Tensor]: the pending work and the receive buffer, to hand
        back with :func:`qcomm.collectives._buffers.give` once used.
    """
    recv = _buffers.take(sum(recv_sizes), wire.dtype, wire.device)
    work = dist.all_to_all_single(recv, wire, recv_sizes, send_sizes, group=group, async_op=True)
    return work, recv


# torch 2.13 renamed the tensor forms of reduce-scatter and all-gather and
# deprecated the old names; older releases have only those.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_segments(
    flat: torch.Tensor,
    send_lengths: list[int],
    recv_lengths: list[int],
    codec: Any,
    rank: int,
    group: dist.ProcessGroup,
    consume: Callable[[torch.Tensor | None, list[torch.Tensor]], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    r"""
    exchange_segments(flat: Tensor, send_lengths: list[int], recv_lengths: list[int], codec: Any, rank: int, group: ProcessGroup, consume: Callable) -> Callable[[], Tensor]

    Starts an all-to-all of the segments of ``flat``, each padded at its end
    (``padded_size`` asked about the segment seen as one row) and encoded
    with ``codec`` under a fresh context.

    Args:
        flat (Tensor): 1-D, the segments for every rank end to end.
        send_lengths (list[int]): elements for each rank.
        recv_lengths (list[int]): elements from each rank.
        codec (Any): the codec.
        rank (int): this rank.
        group (ProcessGroup): the group.
        consume (Callable[[Tensor | None, list[Tensor]], Tensor]): makes the
            result from what :func:`decode_segments` returns (the blocks cut
            back to ``recv_lengths``, the whole only when nothing was padded).

    Returns:
        Callable[[], Tensor]: waits for the data and returns what ``consume``
        makes of it.
    """
    ctx = codec.create_context()
    world = len(send_lengths)
    padded = padded_lengths(codec, ctx, send_lengths + recv_lengths, rank, flat.device)
    send_padded, recv_padded = padded[:world], padded[world:]
    source = pad_segments(encodable(flat, codec), send_lengths, send_padded)
    wire, send_sizes = encode_segments(codec, ctx, source, send_padded)
    recv_sizes = quantized_sizes(codec, ctx, recv_padded)
    work, recv = all_to_all(wire, send_sizes, recv_sizes, group)

    def finish() -> torch.Tensor:
        work.wait()
        whole, blocks = decode_segments(codec, ctx, list(recv.split(recv_sizes)), recv_padded, recv)
        if recv_padded != recv_lengths:
            whole, blocks = None, [b[:n] for b, n in zip(blocks, recv_lengths)]
        result = consume(whole, blocks)
        _buffers.give(recv, result)
        return result

    return finish


def assemble(
    whole: torch.Tensor | None,
    blocks: list[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    r"""
    assemble(whole: Tensor | None, blocks: list[Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> Tensor

    The blocks laid end to end as a tensor of ``shape`` and ``dtype``.

    Args:
        whole (Tensor, optional): the blocks already end to end, used as is
            (no copy unless the dtype differs).
        blocks (list[Tensor]): the 1-D blocks.
        shape (tuple[int, ...]): the result's shape.
        dtype (torch.dtype): the result's dtype.

    Returns:
        Tensor: the result.
    """
    if whole is not None:
        return whole.view(shape).to(dtype)
    out = torch.empty(shape, dtype=dtype, device=blocks[0].device if blocks else None)
    flat = out.view(-1)
    offset = 0
    for block in blocks:
        n = block.numel()
        flat[offset : offset + n].copy_(block)
        offset += n
    return out
