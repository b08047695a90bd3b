r"""
``example_fp16_scaled``: float16 with a power-of-two scale per block, on
:class:`qcomm.BlockCodec`, which keeps the codec contract (docs/codecs.rst).
Scaling each block's largest magnitude into :math:`[2^{14}, 2^{15})` keeps
float32's whole range, which a plain cast loses. Wire, per block: the
exponent :math:`e` of the scale :math:`2^e`, then the elements over
:math:`2^e`. NaN and :math:`\pm\infty` spoil only their own element.
"""

from __future__ import annotations

import torch

from qcomm import BlockCodec, CodecInfo

__all__ = ["ScaledFP16Codec"]

# Block maxima land in [2**14, 2**15): below float16's largest value (65504)
# even when rounded up, with 11 significant bits.
_TOP_EXPONENT = 14
# Scales stay normal float32 numbers, built exactly from their bits.
_MIN_EXPONENT = -126


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    # 2**e from its float32 bit pattern: exact, unlike exp2 or pow, whose
    # vectorized kernels may be off by an ulp. Needs -126 <= e <= 127.
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


class ScaledFP16Codec(BlockCodec):
    r"""
    Float16 with a power-of-two scale per block of ``block_size`` elements.

    Error bound: scaling by a power of two is exact and the cast keeps 11
    significant bits: within :math:`2^{-11}` of the block's largest magnitude.

    Args:
        block_size (int, optional): elements per scale, 1 to 65536. Default: ``64``.

    Examples::

        >>> codec = ScaledFP16Codec(block_size=4)
        >>> x = torch.tensor([1e30, -2.5e29, 3.0, 1e-30, 0.5])
        >>> wire = codec.encode(x)
        >>> wire.dtype, wire.numel(), codec.calc_quantized_size(5)
        (torch.float16, 10, 10)
        >>> bool(((codec.decode(wire)[:5] - x).abs() <= 2**-11 * 1e30).all())
        True
    """

    def __init__(self, block_size: int = 64) -> None:
        super().__init__(block_size, option="block_size")
        self.wire_per_block = self.block + 1  # the exponent, then the values
        self.info = CodecInfo(
            name="example_fp16_scaled",
            bits_per_element=16.0 * self.wire_per_block / self.block,
            rel_error_bound=2.0**-11,
            error_block=self.block,
        )

    @property
    def block_size(self) -> int:
        """Elements per scale."""
        return self.block

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype, ``torch.float16``."""
        return torch.float16

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        rows = self.pad_blocks(flat).view(-1, self.block)
        finite_abs = torch.where(rows.isfinite(), rows.abs(), 0.0)
        _, top = torch.frexp(finite_abs.amax(dim=1))  # max = m * 2**top, 0.5 <= m < 1
        exponent = (top - 1 - _TOP_EXPONENT).clamp(min=_MIN_EXPONENT)
        values = (rows * _pow2(-exponent)[:, None]).half()
        return torch.cat([exponent.half()[:, None], values], dim=1).view(-1)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.wire_per_block).float()
        return (rows[:, 1:] * _pow2(rows[:, 0])[:, None]).reshape(-1)
