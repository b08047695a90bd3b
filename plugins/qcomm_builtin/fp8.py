r"""
The row-wise scaled FP8 codecs ``fp8_e4m3`` and ``fp8_e5m2`` in fbgemm-gpu's
row-wise FP8 format (``FloatToFP8RowwiseQuantized``, what TorchRec's FP8 comms
send with ``fp8_quantize_dim``). Per row of ``row_dim`` elements with max-abs
:math:`m`: the FP8 values of :math:`x_i s`, :math:`s = \text{max\_pos} / (m +
10^{-20})` (clamped, rounded to nearest even), zero bytes up to a multiple of
4, the float32 :math:`s`, 4 zero bytes; decoding divides by :math:`s`. A
partial row is padded with zeros. A row holding NaN or :math:`\pm\infty` is
sent with a NaN scale and decodes to NaN (fbgemm would saturate a NaN).

fbgemm's elements are its "HFP8" formats, the OCP ``float8_e4m3fn`` /
``float8_e5m2`` bit patterns scaled by :math:`2^{-8}` / :math:`2^{-16}`, so a
torch cast gives its bytes: tested bit for bit against fbgemm's CPU element
kernel (``FloatToHFP8Quantized``); the layout and scale follow its CUDA
sources, which alone have this format. Two deliberate differences: the
padding bytes, unwritten by fbgemm, are zero; and for a ``row_dim`` not a
multiple of 4, ``decode`` returns ``row_dim`` values per row, not the padding.
On CUDA, decoding uses fbgemm's kernel where it is loaded (same floats).
"""

from __future__ import annotations

import math

import torch

from qcomm import BlockCodec, CodecInfo
from qcomm_builtin._fbgemm import cuda_op
from qcomm_builtin._native import kernel_input, kernels, lines_of, round_trip_error

__all__ = ["DEFAULT_ROW_DIM", "FP8E4M3Codec", "FP8E5M2Codec"]

# fbgemm's QuantizationContext default row_dim; TorchRec has no FP8 default
# (without fp8_quantize_dim it sends unscaled tensor-wise FP8).
DEFAULT_ROW_DIM = 32

_EPSILON = 1e-20  # fbgemm adds it to the row's max-abs before inverting
_META_BYTES = 8  # float32 scale, then 4 zero bytes (fbgemm reserves 8)


def _aligned(row_dim: int) -> int:
    # fbgemm's row layout rounds the values up to a multiple of 4 bytes so
    # that the float32 scale after them is aligned.
    return (row_dim + 3) // 4 * 4


class _RowwiseFP8Codec(BlockCodec):
    # Shared body of the two FP8 codecs; they differ only in the element format.
    _name: str
    _fp8: torch.dtype  # torch's OCP dtype with the same bit layout
    _max_pos: float  # fbgemm's largest element value
    _shift: float  # fbgemm value * shift == OCP value, bit for bit
    _mbits: int
    _e5m2: bool  # the element format the C kernels are asked for

    def __init__(self, row_dim: int = DEFAULT_ROW_DIM) -> None:
        super().__init__(row_dim, option="row_dim")
        self._values_bytes = _aligned(self.block)
        self.wire_per_block = self._values_bytes + _META_BYTES
        # Every element is off by at most half a step of the top binade
        # (0.5 <= |y| < 1 for both formats), relative to max_pos = the row's
        # max-abs; plus a few float32 roundings in scaling and unscaling.
        # Subnormal steps are smaller, and the 1e-20 added to the max-abs
        # gives the absolute part (it only matters for rows below ~1e-19).
        half_step = 2.0 ** (math.floor(math.log2(self._max_pos)) - self._mbits - 1)
        self.info = CodecInfo(
            name=self._name,
            bits_per_element=8.0 * self.wire_per_block / self.block,
            rel_error_bound=half_step / self._max_pos + 2.0**-20,
            abs_error_bound=2.0 * half_step * _EPSILON / self._max_pos,
            error_block=self.block,
            max_abs_input=2.0**126,
        )

    @property
    def row_dim(self) -> int:
        """Elements per row (one scale each)."""
        return self.block

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype, ``torch.uint8`` (gloo carries no float8 dtype)."""
        return torch.uint8

    def _encode_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        # amin and amax apart: on CPU both are several times faster than one
        # aminmax over short rows.
        mn, mx = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
        max_abs = torch.maximum(mx, mn.neg_())
        # A true division by a tensor, as fbgemm's float32 division (torch
        # multiplies by the reciprocal when dividing by a Python scalar).
        scale = torch.full_like(max_abs, self._max_pos).div_(max_abs.add_(_EPSILON))
        # x * scale * shift, rounded once into the OCP format straight into
        # the wire: multiplying by the power of two `shift` is exact, so the
        # bytes are fbgemm's. fbgemm clamps x * scale to max_pos first; here
        # |x * scale| <= max_pos * (1 + 2**-22), which rounds to max_pos.
        torch.mul(rows, scale * self._shift, out=out[:, : self.block].view(self._fp8))
        # A row holding NaN or +-Inf: zero values and a NaN scale, which is all
        # the receiver needs, so nothing has to reach the host. The mask goes
        # over every row without asking whether any is bad (on CUDA, asking
        # waits for the device): a bitwise and with 0 or 255 per row, on CPU
        # four times as fast as masked_fill_ with a broadcast mask.
        bad = ~torch.isfinite(max_abs)
        scale.masked_fill_(bad, math.nan)
        out[:, : self.block].bitwise_and_(torch.where(bad, 0, 255).to(torch.uint8))
        out[:, self._values_bytes : self._values_bytes + 4] = scale.view(torch.uint8)

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        k = kernels() if flat.device.type == "cpu" and flat.dim() == 1 else None
        src = kernel_input(flat, torch.float32) if k is not None else None
        if k is not None and src is not None:
            out = torch.empty(self.calc_quantized_size(src.numel()), dtype=torch.uint8)
            k.fp8_encode(src.data_ptr(), src.numel(), out.data_ptr(), self.block, self._e5m2)
            return out
        rows = self.pad_blocks(flat).view(-1, self.block)
        # Zero-filled, so padding bytes and the reserved 4 bytes are 0.
        out = torch.zeros(rows.shape[0], self.wire_per_block, dtype=torch.uint8, device=rows.device)
        if rows.shape[0] > 0:
            self._encode_rows(rows, out)
        return out.view(-1)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.wire_per_block)
        if rows.shape[0] == 0:
            return torch.zeros(0, device=rows.device)
        k = kernels() if rows.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        if k is not None and src is not None:
            n = rows.shape[0] * self.block
            out = torch.empty(n, dtype=torch.float32)
            k.fp8_decode(
                src.data_ptr(), rows.shape[0], out.data_ptr(), self.block, self._e5m2, n, n
            )
            return out
        # fbgemm's CUDA kernel decodes in one pass what takes two here, to the
        # same floats: its element value / scale is the quotient computed below.
        # It expects each row's values padded to a multiple of 4 bytes: this
        # wire's layout only when row_dim is a multiple of 4. Its encoder is
        # not used: rows whose max-abs is below 1e-20 (all-zero rows) get a
        # different scale in its many-row kernel, which starts the max-abs at
        # 1e-20 and then adds 1e-20 again; NaN saturates; and the padding bytes
        # are left unwritten.
        op = cuda_op("FP8RowwiseQuantizedToFloat", rows) if self.block % 4 == 0 else None
        if op is not None:
            return op(rows, not self._e5m2).view(-1)
        a = self._values_bytes
        scale = rows[:, a : a + 4].clone(memory_format=torch.contiguous_format).view(torch.float32)
        # value / (scale * shift) is the same float32 as fbgemm's value / scale
        # for the value in fbgemm's units: dividing by the power of two
        # `shift` is exact.
        values = rows[:, : self.block].view(self._fp8).to(torch.float32)
        return values.div_(scale.mul_(self._shift)).view(-1)

    def round_trip_error(self, input_tensor: torch.Tensor) -> tuple[float, float] | None:
        r"""
        round_trip_error(input_tensor: Tensor) -> tuple[float, float] | None

        The relative RMS and largest errors of ``decode(encode(input_tensor))``,
        from the C kernels in one pass (see :doc:`codecs`); ``None`` elsewhere.
        """
        return round_trip_error("fp8", input_tensor, self.block, self._e5m2)

    def dequantize_into(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        k = kernels() if wire.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        blocks = wire.numel() // self.wire_per_block
        lines = lines_of(out, blocks * self.block, self.block) if src is not None else None
        if k is None or src is None or lines is None:
            super().dequantize_into(wire, out)
            return
        k.fp8_decode(src.data_ptr(), blocks, out.data_ptr(), self.block, self._e5m2, *lines)


class FP8E4M3Codec(_RowwiseFP8Codec):
    r"""
    The ``fp8_e4m3`` codec: row-wise scaled FP8, 4 exponent and 3 mantissa bits
    (fbgemm's forward format, :math:`\text{max\_pos} = 0.9375`); 10 bits per
    element at the default ``row_dim``.

    Error bound, per row with max-abs :math:`m`:
    :math:`|\hat{x} - x| \le (2^{-5}/0.9375 + 2^{-20})\, m + 6.7 \cdot 10^{-22}`
    for :math:`|x| \le 2^{126}`: half a step of the scaled row's top binade.

    Args:
        row_dim (int, optional): elements per row, at most 65536.
            Default: ``32`` (fbgemm's ``QuantizationContext`` default).

    Examples::

        >>> codec = FP8E4M3Codec(row_dim=4)
        >>> codec.decode(codec.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))).tolist()
        [1.0, -0.5, 0.25, 0.0]
    """

    _name = "fp8_e4m3"
    _fp8 = torch.float8_e4m3fn
    _max_pos = 0.9375
    _shift = 2.0**8
    _mbits = 3
    _e5m2 = False


class FP8E5M2Codec(_RowwiseFP8Codec):
    r"""
    The ``fp8_e5m2`` codec: as :class:`FP8E4M3Codec` with 5 exponent and 2
    mantissa bits (fbgemm's backward format, :math:`\text{max\_pos} = 0.875`).

    Error bound, per row with max-abs :math:`m`:
    :math:`|\hat{x} - x| \le (2^{-4}/0.875 + 2^{-20})\, m + 1.5 \cdot 10^{-21}`
    for :math:`|x| \le 2^{126}`.

    Args:
        row_dim (int, optional): elements per row, at most 65536. Default: ``32``.

    Examples::

        >>> codec = FP8E5M2Codec(row_dim=4)
        >>> codec.decode(codec.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))).tolist()
        [1.0, -0.5, 0.25, 0.0]
    """

    _name = "fp8_e5m2"
    _fp8 = torch.float8_e5m2
    _max_pos = 0.875
    _shift = 2.0**16
    _mbits = 2
    _e5m2 = True
