r"""
The ``fp8_e4m3_tensor`` codec: TorchRec's default FP8 communication (its
``CommType.FP8`` without ``fp8_quantize_dim``), an unscaled cast to fbgemm's
"HFP8" 1-4-3 format with exponent bias 15, clamped to its largest value.
Unlike the row-wise ``fp8_e4m3`` it keeps the tensor's shape, so it can carry
TorchRec's reduce-scatter backward.

fbgemm's 1-4-3 values are the OCP ``float8_e4m3fn`` bit patterns scaled by
:math:`2^{-8}`, and fbgemm clamps to :math:`0.9375` first, so a torch cast
gives its bytes exactly (tested against ``fp32_to_hfp8_with_clamp``).
"""

from __future__ import annotations

import torch

from qcomm import CodecInfo, ElementwiseCodec

__all__ = ["MAX_POS", "FP8E4M3TensorCodec"]

#: The largest value of fbgemm's 1-4-3 format with bias 15, where larger inputs saturate.
MAX_POS = 0.9375
_SHIFT = 2.0**8  # fbgemm's value * _SHIFT is the float8_e4m3fn value, bit for bit


class FP8E4M3TensorCodec(ElementwiseCodec):
    r"""
    The ``fp8_e4m3_tensor`` codec: one unscaled FP8 byte per element, in the
    input's shape, byte for byte fbgemm's ``fp32_to_hfp8_with_clamp(x, 4, 3,
    15)``: ``x`` clamped to :math:`\pm 0.9375`, rounded to nearest even.

    Error bound: :math:`|\hat{x} - x| \le 2^{-4}|x| + 2^{-18}` for
    :math:`|x| \le 0.9375`; larger values and :math:`\pm\infty` **saturate**.
    NaN stays NaN (code ``0x7F``, which fbgemm never writes; it would send 0.9375).

    Examples::

        >>> codec = FP8E4M3TensorCodec()
        >>> codec.decode(codec.encode(torch.tensor([[0.5, -0.3], [2.0, float("nan")]]))).tolist()
        [[0.5, -0.3125], [0.9375, nan]]
    """

    info = CodecInfo(
        name="fp8_e4m3_tensor",
        bits_per_element=8.0,
        rel_error_bound=2.0**-4,
        abs_error_bound=2.0**-18,
        max_abs_input=MAX_POS,
    )

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype, ``torch.uint8`` (gloo carries no float8 dtype)."""
        return torch.uint8

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        # Clamping first keeps every product within float8_e4m3fn's finite
        # range, and multiplying by a power of two is exact: one rounding, the
        # cast's, to nearest even like fbgemm's. NaN passes the clamp.
        scaled = flat.clamp(-MAX_POS, MAX_POS).mul_(_SHIFT)
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        return wire.view(torch.float8_e4m3fn).to(torch.float32).mul_(1.0 / _SHIFT)
