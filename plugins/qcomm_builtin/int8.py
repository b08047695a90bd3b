r"""
The ``int8`` codec: row-wise min/max 8-bit quantization in fbgemm's fused
format (``FloatToFused8BitRowwiseQuantized``). On CPU it runs qcomm's C
kernels, else fbgemm's, else torch code: the same bytes and values (tested).
On other devices it runs the torch code, which reads nothing back to the host,
and decodes with fbgemm's CUDA kernel where that is loaded.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from qcomm import BlockCodec, CodecInfo
from qcomm_builtin._fbgemm import cuda_op, fbgemm_ops
from qcomm_builtin._native import kernel_input, kernels, lines_of, round_trip_error

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
    # A row holding NaN or +-Inf, or whose max - min overflows float32 (`rng`
    # not finite), gets zero codes and a NaN scale and bias: it decodes to NaN.
    # The NaN in the wire is all the receiver needs, so nothing about bad rows
    # has to reach the host: the mask goes over every row without asking
    # whether any is bad (on CUDA, asking waits for the device). The codes
    # need no mask: in a bad row `inverse` is 0 or NaN, so each code is 0 or
    # NaN, and NaN becomes 0.
    bad = ~torch.isfinite(rng)
    q = (rows - mn).mul_(inverse).round_().clamp_(0, 255)
    out[:, :d] = q.nan_to_num_(0.0)
    out[:, d:] = torch.cat([scale, mn], dim=1).masked_fill_(bad, math.nan).view(torch.uint8)


def _mark_bad_rows(rng: torch.Tensor, out: torch.Tensor) -> None:
    # What _quantize_rows does to a row whose `rng` (max - min) is not
    # finite, done to a finished wire; branch-free, like it.
    bad = ~torch.isfinite(rng).view(-1, 1)
    d = out.shape[1] - _META_BYTES
    out[:, :d].masked_fill_(bad, 0)
    nan = torch.full((1, 2), math.nan, device=out.device).view(torch.uint8)
    out[:, d:] = torch.where(bad, nan, out[:, d:])


def _quantize_rows_fbgemm(ops: Any, rows: torch.Tensor) -> torch.Tensor:
    out = ops.FloatToFused8BitRowwiseQuantized(rows)
    # fbgemm would encode a NaN as the row's minimum. One pass clears the
    # common case: a sum is NaN or infinite whenever an element is; when it
    # only overflows (huge finite values), the exact per-row check below runs
    # and finds nothing. Reading the flag is free on CPU (no device to wait
    # for); the marking it guards gives the bytes _quantize_rows gives.
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
    The ``int8`` codec: every row of ``row_dim`` elements is quantized to
    ``uint8`` between its own minimum and maximum.

    Wire, per row, fbgemm's fused 8-bit row-wise format as its CPU kernel writes
    it: the codes :math:`\mathrm{round}((x_i - \min) \cdot 255 / (\max - \min +
    10^{-8}))` (half to even), then the float32 scale :math:`(\max - \min)/255`
    and bias :math:`\min`; decoding is one fused multiply-add, as in fbgemm. A
    partial row is padded with its last element.

    Error bound, per row with largest magnitude :math:`m`:
    :math:`|\hat{x} - x| \le (1/255 + 2^{-20})\, m + 1.01 \cdot 10^{-8}` for
    :math:`|x| \le 2^{126}`: half a step, float32 rounding, and fbgemm's
    :math:`10^{-8}`. A row holding NaN or :math:`\pm\infty` (or whose range
    overflows float32) decodes to all NaN; fbgemm alone would send its minimum.

    Args:
        row_dim (int, optional): elements per row, at most 65536.
            Default: ``32`` (fbgemm's and TorchRec's).

    Examples::

        >>> codec = Int8Codec(row_dim=4)
        >>> wire = codec.encode(torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0, 1.0]))
        >>> wire.numel(), wire[:4].tolist()
        (24, [0, 85, 170, 255])
    """

    edge_pad = True  # a padded row keeps its real minimum and maximum

    def __init__(self, row_dim: int = DEFAULT_ROW_DIM) -> None:
        super().__init__(row_dim, option="row_dim")
        self.wire_per_block = self.block + _META_BYTES
        self.info = CodecInfo(
            name="int8",
            bits_per_element=8.0 * self.wire_per_block / self.block,
            rel_error_bound=1.0 / 255.0 + 2.0**-20,
            abs_error_bound=1.01 * _EPSILON,
            error_block=self.block,
            max_abs_input=2.0**126,
        )

    @property
    def row_dim(self) -> int:
        """Elements per row (one scale and bias each)."""
        return self.block

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype, ``torch.uint8``."""
        return torch.uint8

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        k = kernels() if flat.device.type == "cpu" and flat.dim() == 1 else None
        src = kernel_input(flat, torch.float32) if k is not None else None
        if k is not None and src is not None:
            out = torch.empty(self.calc_quantized_size(src.numel()), dtype=torch.uint8)
            k.int8_encode(src.data_ptr(), src.numel(), out.data_ptr(), self.block)
            return out
        rows = self.pad_blocks(flat).view(-1, self.block)
        if rows.shape[0] == 0:
            return torch.zeros(0, dtype=torch.uint8, device=rows.device)
        # fbgemm's CPU kernel only: its CUDA kernel adds 1e-20, not 1e-8, to the
        # range before inverting it, so its codes can differ in every row whose
        # range is below 0.25 (where adding 1e-8 still changes a float32).
        ops = fbgemm_ops() if rows.device.type == "cpu" else None
        if ops is not None:  # fbgemm reads a strided view as if it were packed
            return _quantize_rows_fbgemm(ops, rows.contiguous()).view(-1)
        out = torch.empty(rows.shape[0], self.wire_per_block, dtype=torch.uint8, device=rows.device)
        _quantize_rows(rows, out)
        return out.view(-1)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.wire_per_block)
        d = self.block
        if rows.shape[0] == 0:
            return torch.zeros(0, device=rows.device)
        k = _decode_kernels() if rows.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        if k is not None and src is not None:
            n = rows.shape[0] * d
            out = torch.empty(n, dtype=torch.float32)
            k.int8_decode(src.data_ptr(), rows.shape[0], out.data_ptr(), d, n, n, _rounds_once())
            return out
        ops = fbgemm_ops() if rows.device.type == "cpu" else None
        if ops is not None:  # fbgemm reads a strided view as if it were packed
            return ops.Fused8BitRowwiseQuantizedToFloat(rows.contiguous()).view(-1)
        # fbgemm's CUDA kernel: one pass instead of three. Its q * scale + bias
        # is contracted to one fused multiply-add by nvcc, as torch's addcmul
        # is on CUDA (tests/unit/test_codecs_cuda.py compares them). It expects each
        # row's codes padded to a multiple of 4 bytes: this wire's layout only
        # when row_dim is a multiple of 4.
        op = cuda_op("Fused8BitRowwiseQuantizedToFloat", rows) if d % 4 == 0 else None
        if op is not None:
            return op(rows).view(-1)
        return _dequantize_rows(rows, d)

    def round_trip_error(self, input_tensor: torch.Tensor) -> tuple[float, float] | None:
        r"""
        round_trip_error(input_tensor: Tensor) -> tuple[float, float] | None

        The relative RMS and largest errors of ``decode(encode(input_tensor))``,
        from the C kernels in one pass (see :doc:`codecs`); ``None`` elsewhere.
        """
        fused = _rounds_once()  # round_trip_error asks whether the kernels are there
        if fused is None:
            return None
        return round_trip_error("int8", input_tensor, self.block, fused)

    def dequantize_into(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        k = _decode_kernels() if wire.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        blocks = wire.numel() // self.wire_per_block
        lines = lines_of(out, blocks * self.block, self.block) if src is not None else None
        if k is None or src is None or lines is None:
            super().dequantize_into(wire, out)
            return
        k.int8_decode(src.data_ptr(), blocks, out.data_ptr(), self.block, *lines, _rounds_once())
