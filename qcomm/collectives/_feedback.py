"""
Error feedback of the all-reduce (see docs/ddp.rst): what each codec lost
of what this rank sent, kept in :class:`Residuals` and added back on the
next call. The exchange tells a :class:`Record` of every chunk it encodes
(its ``encoded`` hook) and when its sends are out (its ``sent`` hook); the
record then decodes them into the residuals and, for the all-gather, into
this rank's own result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from qcomm.collectives._exchange import Piece
from qcomm.collectives._wire import checked_decode


@dataclasses.dataclass
class Residuals:
    r"""
    What the codecs lost on one buffer, added back on the next call (error
    feedback); :func:`all_reduce` fills empty ones with
    zeros.

    Args:
        scatter (Tensor, optional): float32, as long as the buffer: what the
            reduce-scatter codec lost of every block this rank sent.
            Default: ``None``.
        gather (Tensor, optional): float32, as long as this rank's block:
            what the all-gather codec lost of its shard. Default: ``None``.
    """

    scatter: torch.Tensor | None = None
    gather: torch.Tensor | None = None


def check_residuals(residuals: Residuals, numel: int, own: int, device: torch.device) -> None:
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


def mark_infinities(x: torch.Tensor) -> None:
    """Turns infinities into NaN, in place and without a host synchronisation."""
    # A codec may saturate an infinity into a finite value (fp16 and bf16 do,
    # as fbgemm's); the built-in codecs all keep NaN. 0 * inf is NaN.
    x.add_(x, alpha=0)


class Sink(NamedTuple):
    """
    Where the decoded values of one sent region go: ``out`` (its first
    ``length`` elements, the rest being padding) and what the codec lost,
    ``residual``; either may be ``None``.
    """

    length: int
    out: torch.Tensor | None
    residual: torch.Tensor | None


class _Chunk(NamedTuple):
    piece: Piece
    x: torch.Tensor
    wire: torch.Tensor
    ctx: Any


class Record:
    """
    What one exchange of one call encodes (:meth:`keep` is the exchange's
    ``encoded`` hook), for :meth:`drain` to decode into ``sinks``: by tensor
    sent, where what the codec makes of it goes. The chunks are matched to
    their tensor by the region they were read from, in any order. Each call
    keeps its own record: a codec object may serve calls on other threads
    and groups at once.
    """

    def __init__(self, codec: Any, sinks: Sequence[tuple[torch.Tensor, Sink]]) -> None:
        self._codec = codec
        self._decodes_into = getattr(codec, "decode_into", None) is not None
        # By identity: the exchange reads each chunk from the very tensor sent.
        self._sinks = {id(sent): (sent, sink) for sent, sink in sinks}
        self._chunks: list[_Chunk] = []

    def keep(self, piece: Piece, x: torch.Tensor, wire: torch.Tensor, ctx: Any) -> None:
        """Hears of one chunk encoded (see :data:`~._exchange.Encoded`)."""
        self._chunks.append(_Chunk(piece, x, wire, ctx))

    def _into(self, out: torch.Tensor) -> bool:
        return out.dtype == torch.float32 and self._decodes_into

    def drain(self) -> None:
        """Decodes every chunk encoded into its tensor's sink (once the sends are out)."""
        chunks, self._chunks = self._chunks, []
        covered = dict.fromkeys(self._sinks, 0)
        for chunk in chunks:
            region = chunk.piece.region
            key = id(region.region) if region is not None else None
            if key not in self._sinks:
                raise RuntimeError("qcomm: the exchange encoded a tensor it was not given")
            covered[key] += chunk.piece.stop - chunk.piece.start
            self._decode(chunk, self._sinks[key][1])
        if any(n < len(self._sinks[k][0]) for k, n in covered.items()):
            raise RuntimeError("qcomm: the exchange encoded less than it was given")

    def _decode(self, chunk: _Chunk, sink: Sink) -> None:
        piece, x, ctx = chunk.piece, chunk.x, chunk.ctx
        wire = chunk.wire.reshape(-1)
        n = x.numel()
        lo, hi = piece.start, min(piece.stop, sink.length)
        if hi <= lo:
            return
        out = sink.out[lo:hi] if sink.out is not None else None
        if out is not None and sink.residual is None and hi - lo == n and self._into(out):
            checked_decode(self._codec, ctx, wire, n, into=out)
            return
        decoded = checked_decode(self._codec, ctx, wire, n)[: hi - lo]
        if out is not None and out.dtype != decoded.dtype:
            # Rounded as it will be stored (by every rank alike), so that
            # the residual carries the rounding too.
            decoded = decoded.to(out.dtype).to(decoded.dtype)
        if sink.residual is not None:
            # Before the output, which may be where the chunk was read from.
            # A NaN or an infinity is not carried into later calls.
            residual = sink.residual[lo:hi]
            torch.sub(x.reshape(-1)[: hi - lo], decoded, out=residual)
            residual.nan_to_num_(0.0, 0.0, 0.0)
        if out is not None:
            out.copy_(decoded)
