r"""
The ``int8`` codec: row-wise min/max 8-bit quantization in fbgemm's fused
format (``FloatToFused8BitRowwiseQuantized``), scale and bias in-band.

On CPU it runs qcomm's C kernels (``qcomm_builtin._kernels``) when they were
built, else fbgemm-gpu's kernel when present, else a torch implementation;
all three give the same bytes and values (tested bit for bit).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from qcomm import CodecInfo
from qcomm_builtin._blocks import (
    BlockCodec,
    check_block_size,
    pad_to_blocks,
)
from qcomm_builtin._fbgemm import fbgemm_ops
from qcomm_builtin._native import kernels

__all__ = ["DEFAULT_ROW_DIM", "Int8Codec"]

# fbgemm's quantize_comm.ROW_DIM_DEFAULT, what TorchRec's int8 comms use.
DEFAULT_ROW_DIM = 32

# fbgemm adds this to the row's range before inverting it (kEpsilon).
_EPSILON = 1e-8
_META_BYTES = 8  # float32 scale, float32 bias


def _quantize_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    # The torch twin of fbgemm's FloatToFused8BitRowwiseQuantized on CPU:
    # q = round_half_even((x - min) * (255 / (range + 1e-8))), then the
    # float32 scale range / 255 and bias min. Each float32 operation is the
    # one fbgemm does, in the same order; divisions are by tensors (torch
    # turns a division by a Python scalar into a multiply by the reciprocal,
    # which rounds differently).
    d = rows.shape[1]
    # amin and amax apart: on CPU both are several times faster than one
    # aminmax over short rows.
    mn, mx = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    rng = mx - mn
    scale = rng / torch.full_like(rng, 255.0)
    inverse = torch.full_like(rng, 255.0) / (rng + _EPSILON)
    q = (rows - mn).mul_(inverse).round_().clamp_(0, 255)
    out[:, :d] = q.nan_to_num_(0.0)
    out[:, d:] = torch.cat([scale, mn], dim=1).view(torch.uint8)
    _mark_bad_rows(rng.view(-1), out)


def _mark_bad_rows(rng: torch.Tensor, out: torch.Tensor) -> None:
    # A row holding NaN or +-Inf, or whose max - min overflows float32 (its
    # `rng`), gets a NaN scale and bias and zero values: it decodes to NaN.
    bad = ~torch.isfinite(rng)
    if bool(bad.any()):
        d = out.shape[1] - _META_BYTES
        out[bad, :d] = 0
        nan = torch.full((int(bad.sum()), 2), math.nan, device=out.device)
        out[bad, d:] = nan.view(torch.uint8)


def _quantize_rows_fbgemm(ops: Any, rows: torch.Tensor) -> torch.Tensor:
    out = ops.FloatToFused8BitRowwiseQuantized(rows)
    # fbgemm would encode a NaN as the row's minimum. One pass clears the
    # common case: a sum is NaN or infinite whenever an element is; when it
    # only overflows (huge finite values), the exact per-row check below runs
    # and finds nothing.
    if not bool(torch.isfinite(rows.sum(dtype=torch.float32))):
        _mark_bad_rows(rows.amax(dim=1) - rows.amin(dim=1), out)
    return out


def _dequantize_rows(rows: torch.Tensor, d: int) -> torch.Tensor:
    # q * scale + bias of every wire row, the torch way.
    scale_bias = rows[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    values = rows[:, :d].to(torch.float32)
    return torch.addcmul(scale_bias[:, 1:], values, scale_bias[:, :1]).view(-1)


@functools.cache
def _rounds_once() -> bool | None:
    # Whether _dequantize_rows rounds q * scale + bias once (a fused
    # multiply-add: torch's CPU kernels where the CPU has FMA) or twice, the
    # same for any row length; the C kernel then does the same. None when it
    # depends on the row length. The probe: 192 * (1 + 2**-23) lies halfway
    # between 192 + 2**-16 (odd) and 192 + 2**-15 (even), and the bias
    # -2**-30 pulls it below: one rounding goes down, two go to the even one.
    q, scale, bias = 192, 1.0 + 2.0**-23, -(2.0**-30)
    once, twice = 192.0 + 2.0**-16, 192.0 + 2.0**-15
    results = set()
    for d in (1, 3, 8, 32, 33):
        meta = torch.tensor([scale, bias], dtype=torch.float32).view(torch.uint8)
        row = torch.cat([torch.full((d,), q, dtype=torch.uint8), meta])
        results |= set(_dequantize_rows(row.repeat(5, 1), d).tolist())
    return {once: True, twice: False}.get(results.pop()) if len(results) == 1 else None


def _decode_kernels() -> Any | None:
    # The C kernels, when int8 decoding may use them (see _rounds_once).
    k = kernels()
    return k if k is not None and _rounds_once() is not None else None


class Int8Codec(BlockCodec):
    r"""
    The ``int8`` codec: every row of ``row_dim`` consecutive elements is
    quantized to ``uint8`` between its own minimum and maximum.

    Wire (``uint8``), per row, exactly fbgemm's fused 8-bit row-wise format as
    its CPU kernel writes it: ``row_dim`` bytes
    :math:`q_i = \mathrm{round}((x_i - \min) \cdot 255 / (\max - \min + 10^{-8}))`
    (round half to even), then the float32 scale :math:`(\max - \min)/255` and
    the float32 bias :math:`\min`, little-endian: ``row_dim + 8`` bytes per row,
    so :math:`8 + 64/\text{row\_dim}` bits per element. Decoding computes
    :math:`q_i \cdot \text{scale} + \text{bias}` with one fused multiply-add,
    as fbgemm does. fbgemm's CUDA kernel pads the values of a row to a
    multiple of 4 bytes; for ``row_dim`` a multiple of 4 (such as the
    default) both layouts are the same.

    Any length: a partial last row is padded by repeating its last element
    (so it keeps its real minimum and maximum) and :meth:`decode` returns
    whole rows, ``ceil(n / row_dim) * row_dim`` elements; the first ``n`` are
    the decoded input. Each input row (the last dimension of an input of
    two or more dimensions) that is not a multiple of ``row_dim`` is padded
    that way, so that no quantization row straddles two input rows (see
    :mod:`qcomm_builtin._blocks`). Sizes add up for lengths that are
    multiples of ``row_dim``; :meth:`padded_size` pads pooled embeddings to
    whole rows.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`), per row with largest
    magnitude :math:`m`:
    :math:`|\hat{x} - x| \le (1/255 + 2^{-20})\, m + 1.01 \cdot 10^{-8}` for
    :math:`|x| \le 2^{126}`: half a step of :math:`(\max - \min)/255 \le 2m/255`,
    float32 rounding, and fbgemm's :math:`10^{-8}` in the divisor.

    Non-finite input: **propagates row-wise**. A row holding NaN or
    :math:`\pm\infty` (or whose :math:`\max - \min` overflows float32, which
    needs :math:`|x| > 1.7 \cdot 10^{38}`) is sent with NaN scale and bias and
    decodes to all NaN; the other rows are unaffected. (fbgemm alone would
    encode a NaN as the row's minimum.)

    Args:
        row_dim (int, optional): elements per row, each row with its own
            scale and bias, at most 65536. Default: ``32`` (fbgemm's and TorchRec's default).

    Raises:
        TypeError: if ``row_dim`` is not an int.
        ValueError: if ``row_dim`` is not in ``[1, 65536]``.

    Examples::

        >>> import torch
        >>> codec = Int8Codec(row_dim=4)
        >>> x = torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0, 1.0])
        >>> wire = codec.encode(x)
        >>> wire.dtype, wire.numel(), codec.calc_quantized_size(6)
        (torch.uint8, 24, 24)
        >>> wire[:4].tolist()
        [0, 85, 170, 255]
        >>> [round(v, 4) for v in codec.decode(wire).tolist()]
        [0.0, 1.0, 2.0, 3.0, -1.0, 1.0, 1.0, 1.0]
    """

    _edge_pad = True  # a padded row keeps its real minimum and maximum

    def __init__(self, row_dim: int = DEFAULT_ROW_DIM) -> None:
        self.block = check_block_size("row_dim", row_dim)
        self.block_bytes = self.block + _META_BYTES
        self.info = CodecInfo(
            name="int8",
            bits_per_element=8.0 * self.block_bytes / self.block,
            summable=False,
            rel_error_bound=1.0 / 255.0 + 2.0**-20,
            abs_error_bound=1.01 * _EPSILON,
            error_block=self.block,
            max_abs_input=2.0**126,
        )

    @property
    def row_dim(self) -> int:
        r"""
        row_dim() -> int

        Elements per row (one scale and bias each).
        """
        return self.block

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype, ``torch.uint8``.
        """
        return torch.uint8

    def _encode_flat(self, flat: torch.Tensor) -> torch.Tensor:
        k = kernels() if flat.device.type == "cpu" else None
        if k is not None:
            out = torch.empty(self.calc_quantized_size(flat.numel()), dtype=torch.uint8)
            k.int8_encode(flat.data_ptr(), flat.numel(), out.data_ptr(), self.block)
            return out
        rows = pad_to_blocks(flat, self.block, edge=True).view(-1, self.block)
        if rows.shape[0] == 0:
            return torch.zeros(0, dtype=torch.uint8, device=rows.device)
        ops = fbgemm_ops() if rows.device.type == "cpu" else None
        if ops is not None:
            return _quantize_rows_fbgemm(ops, rows).view(-1)
        out = torch.empty(rows.shape[0], self.block_bytes, dtype=torch.uint8, device=rows.device)
        _quantize_rows(rows, out)
        return out.view(-1)

    def _decode_flat(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.block_bytes)
        d = self.block
        if rows.shape[0] == 0:
            return torch.zeros(0, device=rows.device)
        k = _decode_kernels() if rows.device.type == "cpu" else None
        if k is not None:
            n = rows.shape[0] * d
            out = torch.empty(n, dtype=torch.float32)
            k.int8_decode(wire.data_ptr(), rows.shape[0], out.data_ptr(), d, n, n, _rounds_once())
            return out
        ops = fbgemm_ops() if rows.device.type == "cpu" else None
        if ops is not None:
            return ops.Fused8BitRowwiseQuantizedToFloat(rows).view(-1)
        return _dequantize_rows(rows, d)

    def _decode_lines(
        self, wire: torch.Tensor, blocks: int, out: torch.Tensor, width: int, stride: int
    ) -> bool:
        k = _decode_kernels()
        if k is None:
            return False
        k.int8_decode(
            wire.data_ptr(), blocks, out.data_ptr(), self.block, width, stride, _rounds_once()
        )
        return True

    def __repr__(self) -> str:
        return f"Int8Codec(row_dim={self.block})"
