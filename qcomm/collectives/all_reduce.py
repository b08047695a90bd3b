r"""
The all-reduce of a flat buffer with codecs, which the DDP communication hook
(:func:`~qcomm.ddp_comm_hook`) runs on every gradient bucket: an encoded
reduce-scatter, then an encoded all-gather, on the exchange of the other
collectives. See :doc:`ddp` for the steps, their error bound and error
feedback.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._args import check_chunk_bytes, check_codec, check_input
from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call, begin
from qcomm.collectives._exchange import Flat, is_identity, recv_order, send_order, start_exchange
from qcomm.collectives._wire import checked_decode, padded_lengths
from qcomm.types import CodecInfo, NoOpQuantizedCommCodec

__all__ = ["Residuals", "all_reduce", "granule", "layout"]

# The largest block alignment asked of the layout: a codec that scales
# longer blocks than this pads its last block instead.
_MAX_GRANULE = 4096


@dataclasses.dataclass
class Residuals:
    r"""
    What the codecs lost on one buffer, added back on the next call (error
    feedback); :func:`all_reduce` fills empty ones with zeros.

    Args:
        scatter (Tensor, optional): float32, as long as the buffer: what the
            reduce-scatter codec lost of every block this rank sent.
            Default: ``None``.
        gather (Tensor, optional): float32, as long as this rank's block:
            what the all-gather codec lost of its shard. Default: ``None``.
    """

    scatter: torch.Tensor | None = None
    gather: torch.Tensor | None = None


def granule(*codecs: Any) -> int:
    r"""
    granule(*codecs: Any) -> int

    The block alignment that :func:`layout` takes: the least common multiple
    of the codecs' :attr:`~qcomm.CodecInfo.error_block`, so that only the
    last block pads (``1`` when none declares one, or it is over 4096).

    Args:
        *codecs (Any): the codecs.

    Returns:
        int: elements.

    Examples::

        >>> from qcomm import NoOpQuantizedCommCodec
        >>> granule(NoOpQuantizedCommCodec())
        1
    """
    out = 1
    for codec in codecs:
        info = getattr(codec, "info", None)
        if isinstance(info, CodecInfo) and info.error_block >= 1:
            out = math.lcm(out, info.error_block)
    return out if out <= _MAX_GRANULE else 1


def layout(numel: int, world: int, granule: int) -> list[int]:
    r"""
    layout(numel: int, world: int, granule: int) -> list[int]

    Where each rank's block of a buffer starts: at multiples of ``granule``;
    the last blocks may be shorter, or empty.

    Args:
        numel (int): elements of the buffer.
        world (int): ranks, one block each.
        granule (int): block alignment, in elements.

    Returns:
        list[int]: ``world + 1`` offsets; block :math:`r` is
        ``[offsets[r], offsets[r + 1])``.

    Examples::

        >>> layout(100, 2, 32)
        [0, 64, 100]
        >>> layout(10, 3, 32)
        [0, 10, 10, 10]
        >>> layout(9, 3, 1)
        [0, 3, 6, 9]
    """
    per = -(-numel // world // granule) * granule
    return [min(r * per, numel) for r in range(world)] + [numel]


class _Sink:
    """Where the decoded values of one sent region go, and its residual."""

    def __init__(
        self, length: int, padded: int, out: torch.Tensor | None, residual: torch.Tensor | None
    ) -> None:
        self.length = length
        self.padded = padded
        self.out = out
        self.residual = residual


class _Tap:
    """The codec, keeping each chunk it encodes for :meth:`drain` to decode into the sinks."""

    def __init__(self, codec: Any) -> None:
        self._codec = codec
        self._sinks: list[_Sink] = []
        self._encoded: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_codec"], name)

    def __repr__(self) -> str:
        return repr(self._codec)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Tap:
        return _Tap(copy.deepcopy(self._codec, memo))

    def expect(self, sinks: list[_Sink]) -> None:
        """Where the chunks of the next exchange go, in sending order."""
        self._sinks = sinks
        self._encoded.clear()

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        wire: torch.Tensor = self._codec.encode(input_tensor, ctx)
        self._encoded.append((input_tensor, wire, ctx))
        return wire

    def _into(self, out: torch.Tensor) -> bool:
        return out.dtype == torch.float32 and getattr(self._codec, "decode_into", None) is not None

    def drain(self) -> None:
        """Decodes every chunk encoded, in order, into the sinks (once the sends are out)."""
        encoded, self._encoded = self._encoded, []
        sinks, self._sinks = self._sinks, []
        index, offset = 0, 0
        for x, wire, ctx in encoded:
            n = x.numel()
            while index < len(sinks) and offset == sinks[index].padded:
                index, offset = index + 1, 0
            if index == len(sinks) or offset + n > sinks[index].padded:
                raise RuntimeError("qcomm: the exchange encoded chunks it had not declared")
            sink = sinks[index]
            lo, hi = offset, min(offset + n, sink.length)
            offset += n
            if hi <= lo:
                continue
            out = sink.out[lo:hi] if sink.out is not None else None
            if out is not None and sink.residual is None and hi - lo == n and self._into(out):
                checked_decode(self._codec, ctx, wire.reshape(-1), n, into=out)
                continue
            decoded = checked_decode(self._codec, ctx, wire.reshape(-1), n)[: hi - lo]
            if sink.residual is not None:
                # Before the output, which may be where the chunk was read from.
                # A NaN or an infinity is not carried into later calls.
                residual = sink.residual[lo:hi]
                torch.sub(x.reshape(-1)[: hi - lo], decoded, out=residual)
                residual.nan_to_num_(0.0, 0.0, 0.0)
            if out is not None:
                out.copy_(decoded)
        left = sum(s.padded for s in sinks[index + 1 :])
        if left or (sinks and offset != sinks[index].padded):
            raise RuntimeError("qcomm: the exchange encoded fewer chunks than it declared")


# One tap per codec object, kept across calls: the exchange fingerprints the
# codec it is given, and does so once per object.
_taps: collections.OrderedDict[int, tuple[Any, _Tap]] = collections.OrderedDict()
_TAPS = 16


def _tap(codec: Any) -> _Tap:
    found = _taps.get(id(codec))
    if found is None or found[0] is not codec:
        found = _taps[id(codec)] = (codec, _Tap(codec))
        while len(_taps) > _TAPS:
            _taps.popitem(last=False)
    _taps.move_to_end(id(codec))
    return found[1]


def _mark_infinities(x: torch.Tensor) -> None:
    """Turns infinities into NaN, in place and without a host synchronisation."""
    # A codec may saturate an infinity into a finite value (fp16 and bf16 do,
    # as fbgemm's); the built-in codecs all keep NaN. 0 * inf is NaN.
    x.add_(x, alpha=0)


def _check_residuals(residuals: Residuals, numel: int, own: int, device: torch.device) -> None:
    """Fills in empty residuals with zeros and checks the others."""
    for name, size in (("scatter", numel), ("gather", own)):
        value = getattr(residuals, name)
        if value is None:
            setattr(residuals, name, torch.zeros(size, device=device))
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"residuals.{name}: expected a float32 tensor, got {got}")
        if value.numel() != size:
            raise ValueError(
                f"residuals.{name}: expected {size} elements for this buffer and rank, "
                f"got {value.numel()}"
            )
        if value.device != device or not value.is_contiguous() or value.dim() != 1:
            setattr(residuals, name, value.to(device).contiguous().view(-1))


def all_reduce(
    buffer: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    reduce_codec: Any | None = None,
    gather_codec: Any | None = None,
    average: bool = False,
    residuals: Residuals | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    r"""
    all_reduce(buffer, *, group=None, reduce_codec=None, gather_codec=None, average=False, residuals=None, chunk_bytes=None) -> Tensor

    Sums (or averages) a 1-D buffer over the ranks in place: an encoded
    reduce-scatter, then an encoded all-gather.

    Every rank ends with the same values, each off the exact sum by at most
    what the codecs' bounds allow (see :class:`~qcomm.CodecInfo` and
    :doc:`ddp`). An infinity or NaN on any rank leaves that place not finite
    on every rank, with codecs that keep NaN as the built-in ones do. With
    ``residuals``, what each codec lost is added to what this rank sends from
    the same place on the next call (error feedback).

    .. note::
        Every rank of ``group`` must make the same calls, in the same order,
        with buffers of the same length and dtype, the same codecs and the
        same ``average``, ``chunk_bytes`` and use of ``residuals``; the
        first call on each group checks that they do, as the other
        collectives do. The call returns when the buffer holds the result.

    Args:
        buffer (Tensor): 1-D contiguous floating-point tensor; overwritten.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        reduce_codec (QuantizedCommCodec, optional): the reduce-scatter's
            codec. Default: ``None`` (the no-op codec: the buffer's dtype travels).
        gather_codec (QuantizedCommCodec, optional): the all-gather's codec.
            Default: ``None`` (the no-op codec).
        average (bool, optional): divide the sum by the world size.
            Default: ``False``.
        residuals (Residuals, optional): error feedback state of this buffer,
            filled in on first use, emptied when a call fails and left empty
            when both codecs are the no-op codec. Default: ``None`` (no error
            feedback).
        chunk_bytes (int, optional): the exchanges' chunk size, as for the
            collectives. Default: ``None`` (automatic).

    Returns:
        Tensor: ``buffer``, holding the result.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if ``buffer`` is not 1-D and contiguous, ``chunk_bytes``
            is not positive, or ``residuals`` does not fit the buffer.
        CodecError: if a codec fails or breaks its contract, on this rank or
            another, or the ranks' calls disagree (checked as for the other
            collectives: see :mod:`qcomm.collectives`).

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> all_reduce(torch.ones(4), average=True).tolist()
        [1.0, 1.0, 1.0, 1.0]
        >>> dist.destroy_process_group()
    """
    with begin("all_reduce", group, buffer, "all_reduce") as call:
        rank, world = call.rank, call.world
        with call.agreement as agree:
            check_input(buffer, "buffer", call.backend, ndim=1)
            if not buffer.is_contiguous():
                raise ValueError("buffer: expected a contiguous tensor")
            if not isinstance(average, bool):
                raise TypeError(
                    f"average: expected a bool, got {type(average).__name__} {average!r}"
                )
            if residuals is not None and not isinstance(residuals, Residuals):
                raise TypeError(
                    f"residuals: expected a Residuals or None, got {type(residuals).__name__}"
                )
            chunk = check_chunk_bytes(chunk_bytes)
            codecs = []
            for name, codec in (("reduce_codec", reduce_codec), ("gather_codec", gather_codec)):
                codec = NoOpQuantizedCommCodec(buffer.dtype) if codec is None else codec
                check_codec(codec, name, call.backend)
                codecs.append(codec)
            bounds = layout(buffer.numel(), world, granule(*codecs))
            if all(is_identity(codec, buffer.dtype) for codec in codecs):
                residuals = None  # nothing is lost, nothing to keep
            if residuals is not None:
                own = bounds[rank + 1] - bounds[rank]
                _check_residuals(residuals, buffer.numel(), own, buffer.device)
            agree.same("buffer", f"{buffer.numel()} elements of {buffer.dtype}")
            agree.same("reduce_codec", codecs[0])
            agree.same("gather_codec", codecs[1])
            agree.same("average", str(average))
            agree.same("residuals", "error feedback" if residuals is not None else "none")
            agree.same("chunk_bytes", [chunk or 0])
        if world == 1 or buffer.numel() == 0:
            return buffer  # nothing to move: no communication at all
        state = _Call(buffer, call, bounds, residuals, chunk)
        try:
            shard = state.reduce_scatter(codecs[0])
            state.all_gather(codecs[1], shard, average)
        except BaseException:
            call.abandon()
            if residuals is not None:
                residuals.scatter = residuals.gather = None
            raise
    return buffer


class _Call:
    """The two exchanges of one all-reduce on this rank."""

    def __init__(
        self,
        buffer: torch.Tensor,
        call: Call,
        bounds: list[int],
        residuals: Residuals | None,
        chunk_bytes: int | None,
    ) -> None:
        self.buffer = buffer
        self.call = call
        self.group = call.group
        self.rank = call.rank
        self.world = call.world
        self.bounds = bounds
        self.lengths = [bounds[r + 1] - bounds[r] for r in range(self.world)]
        self.residuals = residuals
        self.chunk_bytes = chunk_bytes

    def block(self, r: int) -> torch.Tensor:
        return self.buffer[self.bounds[r] : self.bounds[r + 1]]

    def reduce_scatter(self, codec: Any) -> torch.Tensor:
        """Sends every peer its block, returns this rank's summed block (float32 at least)."""
        rank, world, buf = self.rank, self.world, self.buffer
        ctx = codec.create_context()
        padded = padded_lengths(codec, ctx, self.lengths, rank, buf.device)
        peers = [r for r in send_order(rank, world) if self.lengths[r]]
        tap: Any = codec
        if self.residuals is not None and not is_identity(codec, buf.dtype):
            assert self.residuals.scatter is not None
            sinks = []
            for r in peers:
                residual = self.residuals.scatter[self.bounds[r] : self.bounds[r + 1]]
                self.block(r).add_(residual)
                sinks.append(_Sink(self.lengths[r], padded[r], None, residual))
            tap = _tap(codec)
            tap.expect(sinks)
        if not is_identity(codec, buf.dtype):
            for r in peers:
                _mark_infinities(self.block(r))
        mine = self.lengths[rank]
        own = self.block(rank)
        # The sum runs in float32 at least: in place, in the block this rank
        # keeps (it sends it nowhere), or beside it for a narrower dtype.
        dtype = torch.promote_types(torch.float32, buf.dtype)
        acc = own if dtype == buf.dtype else lease((mine,), dtype, buf.device)
        sends = [([r], Flat(self.block(r), padded[r])) for r in peers]
        recvs = [(s, Flat(acc, padded[rank])) for s in recv_order(rank, world) if mine]
        self.call.next_exchange("all_reduce reduce-scatter")
        finish = start_exchange(
            sends, recvs, tap, ctx, self.call, buf.dtype, self.chunk_bytes, add=True
        )
        if isinstance(tap, _Tap):
            tap.drain()
        if acc is not own:
            acc.copy_(own)
        finish()
        return acc

    def all_gather(self, codec: Any, shard: torch.Tensor, average: bool) -> None:
        """Sends this rank's shard to every peer and decodes theirs into the buffer."""
        rank, world, buf = self.rank, self.world, self.buffer
        mine = self.block(rank)
        if average:
            shard.div_(world)
        identity = is_identity(codec, buf.dtype)
        residual = None
        if self.residuals is not None and not identity:
            residual = self.residuals.gather
            assert residual is not None
            shard.add_(residual)
        if identity:
            if shard is not mine:
                mine.copy_(shard)
            shard = mine
        elif shard.dtype != torch.float32:
            shard = shard.float()
        if not identity:
            _mark_infinities(shard)
        ctx = codec.create_context()
        padded = padded_lengths(codec, ctx, self.lengths, rank, buf.device)
        tap: Any = codec
        if not identity:
            # Every rank taps (the exchange checks that all use one codec);
            # the owner takes the values its peers decode, once its chunks
            # (perhaps read from its block) are encoded and sent.
            tap = _tap(codec)
            tap.expect([_Sink(len(mine), padded[rank], mine, residual)] if len(mine) else [])
        sends = [(send_order(rank, world), Flat(shard, padded[rank]))] if len(mine) else []
        recvs = [
            (s, Flat(self.block(s), padded[s])) for s in recv_order(rank, world) if self.lengths[s]
        ]
        self.call.next_exchange("all_reduce all-gather")
        finish = start_exchange(sends, recvs, tap, ctx, self.call, buf.dtype, self.chunk_bytes)
        if isinstance(tap, _Tap):
            tap.drain()
        finish()
