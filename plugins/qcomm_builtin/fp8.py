r"""
The row-wise scaled FP8 codecs ``fp8_e4m3`` and ``fp8_e5m2``, in fbgemm-gpu's
row-wise FP8 wire format (``FloatToFP8RowwiseQuantized``, the format TorchRec's
FP8 comms send when ``fp8_quantize_dim`` is set).

fbgemm's element formats are its "HFP8" ones: 1-4-3 with exponent bias 15
(largest value 0.9375) for its forward pass, 1-5-2 with bias 31 (largest
0.875) for its backward pass. They are the OCP ``float8_e4m3fn`` /
``float8_e5m2`` bit patterns scaled by :math:`2^{-8}` / :math:`2^{-16}`, so a
vectorized torch cast produces exactly fbgemm's bytes.

fbgemm has no CPU kernel for this format (only CUDA), so the torch code runs
everywhere; on CPU qcomm's C kernels (``qcomm_builtin._kernels``) run instead
when they were built, with the same bits (tested). The element rounding is
tested bit for bit against fbgemm's CPU kernel of the same element format
(``FloatToHFP8Quantized``); the row layout, the scale formula and the
decoding follow fbgemm's CUDA sources. Two
deliberate differences: the bytes between ``row_dim`` and the next multiple of
4, which fbgemm's kernel leaves unwritten, are zero here; and for a
``row_dim`` that is not a multiple of 4 ``decode`` returns ``row_dim`` values
per row, where fbgemm's decoder also returns the padding.
"""

from __future__ import annotations

import math

import torch

from qcomm import CodecInfo
from qcomm_builtin._blocks import (
    BlockCodec,
    check_block_size,
    pad_to_blocks,
)
from qcomm_builtin._native import kernels

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
        self.block = check_block_size("row_dim", row_dim)
        self._values_bytes = _aligned(self.block)
        self.block_bytes = self._values_bytes + _META_BYTES
        # Every element is off by at most half a step of the top binade
        # (0.5 <= |y| < 1 for both formats), relative to max_pos = the row's
        # max-abs; plus a few float32 roundings in scaling and unscaling.
        # Subnormal steps are smaller, and the 1e-20 added to the max-abs
        # gives the absolute part (it only matters for rows below ~1e-19).
        half_step = 2.0 ** (math.floor(math.log2(self._max_pos)) - self._mbits - 1)
        self.info = CodecInfo(
            name=self._name,
            bits_per_element=8.0 * self.block_bytes / self.block,
            summable=False,
            rel_error_bound=half_step / self._max_pos + 2.0**-20,
            abs_error_bound=2.0 * half_step * _EPSILON / self._max_pos,
            error_block=self.block,
            max_abs_input=2.0**126,
        )

    @property
    def row_dim(self) -> int:
        r"""
        row_dim() -> int

        Elements per row (one scale each).
        """
        return self.block

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype, ``torch.uint8`` (gloo carries no float8 dtype).
        """
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
        bad = ~torch.isfinite(max_abs)
        if bool(bad.any()):
            scale.masked_fill_(bad, math.nan)
            out[bad.view(-1), : self.block] = 0
        out[:, self._values_bytes : self._values_bytes + 4] = scale.view(torch.uint8)

    def _encode_flat(self, flat: torch.Tensor) -> torch.Tensor:
        k = kernels() if flat.device.type == "cpu" else None
        if k is not None:
            out = torch.empty(self.calc_quantized_size(flat.numel()), dtype=torch.uint8)
            k.fp8_encode(flat.data_ptr(), flat.numel(), out.data_ptr(), self.block, self._e5m2)
            return out
        rows = pad_to_blocks(flat, self.block).view(-1, self.block)
        # Zero-filled, so padding bytes and the reserved 4 bytes are 0.
        out = torch.zeros(rows.shape[0], self.block_bytes, dtype=torch.uint8, device=rows.device)
        if rows.shape[0] > 0:
            self._encode_rows(rows, out)
        return out.view(-1)

    def _decode_flat(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.block_bytes)
        if rows.shape[0] == 0:
            return torch.zeros(0, device=rows.device)
        k = kernels() if rows.device.type == "cpu" else None
        if k is not None:
            n = rows.shape[0] * self.block
            out = torch.empty(n, dtype=torch.float32)
            k.fp8_decode(
                wire.data_ptr(), rows.shape[0], out.data_ptr(), self.block, self._e5m2, n, n
            )
            return out
        a = self._values_bytes
        scale = rows[:, a : a + 4].clone(memory_format=torch.contiguous_format).view(torch.float32)
        # value / (scale * shift) is the same float32 as fbgemm's value / scale
        # for the value in fbgemm's units: dividing by the power of two
        # `shift` is exact.
        values = rows[:, : self.block].view(self._fp8).to(torch.float32)
        return values.div_(scale.mul_(self._shift)).view(-1)

    def _decode_lines(
        self, wire: torch.Tensor, blocks: int, out: torch.Tensor, width: int, stride: int
    ) -> bool:
        k = kernels()
        if k is None:
            return False
        k.fp8_decode(wire.data_ptr(), blocks, out.data_ptr(), self.block, self._e5m2, width, stride)
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(row_dim={self.block})"


class FP8E4M3Codec(_RowwiseFP8Codec):
    r"""
    The ``fp8_e4m3`` codec: row-wise scaled FP8 with 4 exponent and 3 mantissa
    bits (fbgemm's forward format: bias 15, largest value
    :math:`\text{max\_pos} = 0.9375`); 10 bits per element at the default
    ``row_dim``.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`), per row with max-abs
    :math:`m`:
    :math:`|\hat{x} - x| \le (2^{-5}/0.9375 + 2^{-20})\, m + 6.7 \cdot 10^{-22}`
    for :math:`|x| \le 2^{126}`: half a step of the top binade of the
    scaled row, whose largest magnitude is 0.9375.

    Wire (``uint8``), per row, fbgemm's row-wise FP8 layout: the ``row_dim``
    FP8 values, zero bytes up to a multiple of 4, the float32 scale
    :math:`s = \text{max\_pos} / (m + 10^{-20})` (:math:`m` the row's
    max-abs), then 4 zero bytes. Element :math:`i` is
    :math:`\mathrm{fp8}(\mathrm{clamp}(x_i s, \pm\text{max\_pos}))`, rounded to
    nearest even with gradual underflow; decoding divides by :math:`s`.

    Any length: a partial last row is padded with zeros (which leaves its
    max-abs unchanged) and :meth:`decode` returns whole rows,
    ``ceil(n / row_dim) * row_dim`` elements; the first ``n`` are the decoded
    input. Each input row (the last dimension of an input of
    two or more dimensions) that is not a multiple of ``row_dim`` is padded
    that way, so that no quantization row straddles two input rows (see
    :mod:`qcomm_builtin._blocks`). Sizes add up for lengths that are
    multiples of ``row_dim``; :meth:`padded_size` pads pooled embeddings to
    whole rows.

    Non-finite input: **propagates row-wise**. A row holding NaN or
    :math:`\pm\infty` is sent with a NaN scale and zero values and decodes to
    all NaN; other rows are unaffected. (fbgemm's kernel would saturate a NaN
    to the largest value, a finite number.)

    Args:
        row_dim (int, optional): elements per row, each with its own scale,
            at most 65536. Default: ``32`` (fbgemm's ``QuantizationContext`` default).

    Raises:
        TypeError: if ``row_dim`` is not an int.
        ValueError: if ``row_dim`` is not in ``[1, 65536]``.

    Examples::

        >>> import torch
        >>> codec = FP8E4M3Codec(row_dim=4)
        >>> wire = codec.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
        >>> wire.numel(), codec.calc_quantized_size(4)
        (12, 12)
        >>> codec.decode(wire).tolist()
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
    The ``fp8_e5m2`` codec: row-wise scaled FP8 with 5 exponent and 2 mantissa
    bits (fbgemm's backward format: bias 31, largest value
    :math:`\text{max\_pos} = 0.875`); wider range, coarser steps than
    ``fp8_e4m3``.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`), per row with max-abs
    :math:`m`:
    :math:`|\hat{x} - x| \le (2^{-4}/0.875 + 2^{-20})\, m + 1.5 \cdot 10^{-21}`
    for :math:`|x| \le 2^{126}`: half a step of the top binade of the
    scaled row, whose largest magnitude is 0.875.

    Wire (``uint8``), per row, fbgemm's row-wise FP8 layout: the ``row_dim``
    FP8 values, zero bytes up to a multiple of 4, the float32 scale
    :math:`s = \text{max\_pos} / (m + 10^{-20})` (:math:`m` the row's
    max-abs), then 4 zero bytes. Element :math:`i` is
    :math:`\mathrm{fp8}(\mathrm{clamp}(x_i s, \pm\text{max\_pos}))`, rounded to
    nearest even with gradual underflow; decoding divides by :math:`s`.

    Any length: a partial last row is padded with zeros (which leaves its
    max-abs unchanged) and :meth:`decode` returns whole rows,
    ``ceil(n / row_dim) * row_dim`` elements; the first ``n`` are the decoded
    input. Each input row (the last dimension of an input of
    two or more dimensions) that is not a multiple of ``row_dim`` is padded
    that way, so that no quantization row straddles two input rows (see
    :mod:`qcomm_builtin._blocks`). Sizes add up for lengths that are
    multiples of ``row_dim``; :meth:`padded_size` pads pooled embeddings to
    whole rows.

    Non-finite input: **propagates row-wise**. A row holding NaN or
    :math:`\pm\infty` is sent with a NaN scale and zero values and decodes to
    all NaN; other rows are unaffected. (fbgemm's kernel would saturate a NaN
    to the largest value, a finite number.)

    Args:
        row_dim (int, optional): elements per row, each with its own scale,
            at most 65536. Default: ``32`` (fbgemm's ``QuantizationContext`` default).

    Raises:
        TypeError: if ``row_dim`` is not an int.
        ValueError: if ``row_dim`` is not in ``[1, 65536]``.

    Examples::

        >>> import torch
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
