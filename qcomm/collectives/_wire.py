"""
The codec calls every collective shares, each checked against the contract:
a wire of the wrong size, dtype or device, a decoded tensor of the wrong
length, or a codec that raises, raises :class:`~qcomm.CodecError` naming the
codec before anything is sent or used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from qcomm.types import CodecError, codec_info, read_quantized_dtype

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
    """The codec's ``quantized_dtype``, a property or (TorchRec's no-op codec) a method."""
    dtype = read_quantized_dtype(codec)
    if not isinstance(dtype, torch.dtype):
        raise CodecError(
            f"codec {_name(codec)!r}: quantized_dtype must be a torch.dtype, got {dtype!r}"
        )
    return dtype


def encodable(x: torch.Tensor, codec: Any) -> torch.Tensor:
    """What ``encode`` is given: ``x`` if float32 or of the wire dtype, else ``x`` as float32."""
    if x.dtype in (torch.float32, wire_dtype(codec)):
        return x
    return x.float()


def quantized_sizes(codec: Any, ctx: Any, lengths: list[int]) -> list[int]:
    """The wire size of each length, from ``calc_quantized_size``."""
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


def padded_lengths(
    codec: Any,
    ctx: Any,
    lengths: list[int],
    index: int,
    device: torch.device,
    probe: torch.Tensor | None = None,
) -> list[int]:
    """
    The codec's padded width for every entry of ``lengths``.

    ``padded_size`` is asked about entry ``index`` and may record every entry's
    width in ``ctx.padded_dim_sum_per_rank``; else it is asked about each. An
    entry's padding must depend on its width alone, so that sender and receiver,
    each asking with their own context, agree.
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


def checked_encode(
    codec: Any, ctx: Any, x: torch.Tensor, size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``codec.encode(x, ctx)`` as a 1-D wire, checked to be ``size`` elements of ``dtype``."""
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


def checked_decode(
    codec: Any, ctx: Any, wire: torch.Tensor, length: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """``codec.decode`` (or ``decode_into`` ``into``) as 1-D, checked to be ``length`` elements."""
    if length == 0 and wire.numel() == 0:
        return wire.new_empty(0, dtype=torch.float32)
    if wire.storage_offset() * wire.element_size() % 4:
        # TorchRec always hands decode a fresh buffer, and codecs that view
        # in-band float32 scales in a byte wire rely on it; a piece of a
        # larger wire may start at any byte, so give it an aligned copy (of
        # the wire, not of the decoded data).
        wire = wire.clone()
    what = f"decode of {wire.numel()} wire elements"
    if into is not None:
        _guard(codec, what, lambda: codec.decode_into(wire, into, ctx))
        return into
    out = _guard(codec, what, lambda: codec.decode(wire, ctx))
    if not isinstance(out, torch.Tensor) or out.numel() != length:
        got = f"{out.numel()} elements" if isinstance(out, torch.Tensor) else type(out).__name__
        raise CodecError(
            f"codec {_name(codec)!r}: decode of {wire.numel()} wire elements returned {got}, "
            f"expected {length} elements"
        )
    return out.reshape(-1)
