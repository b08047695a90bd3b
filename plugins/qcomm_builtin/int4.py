r"""The ``int4`` codec: row-wise min/max 4-bit quantization, two codes per byte."""

from __future__ import annotations

import torch

from qcomm import BlockCodec, CodecInfo


def _fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    # Toward +inf (up) or -inf: to nearest, then one step back where that went past.
    h = x.half()
    bits, wrong = h.view(torch.int16), (h.float() < x if up else h.float() > x)
    step = torch.where((bits < 0) == up, -1, 1)
    return torch.where(wrong, bits + step, bits).to(torch.int16).view(torch.float16)


class Int4Codec(BlockCodec):
    r"""
    The ``int4`` codec: each row of ``row_dim`` elements travels as 4-bit codes
    :math:`q_i = \mathrm{round}((x_i - b) / s) \in [0, 15]`, two per byte
    (element :math:`2i` in the low nibble), then the float16 scale
    :math:`s \ge (\max - b) / 15` and bias :math:`b \le \min`: fbgemm's fused
    4-bit row-wise layout. Error bound, per row with max-abs :math:`m`:
    :math:`((1 + 2^{-9})/15 + 2^{-20})\, m + 2^{-24}` for :math:`|x| \le 65504`;
    a row holding NaN or :math:`\pm\infty` (or too wide for float16) decodes to NaN.

    Args:
        row_dim (int, optional): elements per row, at most 65536. Default: ``32``.

    Examples::

        >>> Int4Codec(4).decode(Int4Codec(4).encode(torch.tensor([0.0, 1.0, 7.5, 15.0]))).tolist()
        [0.0, 1.0, 8.0, 15.0]
    """

    edge_pad = True  # a padded row keeps its real minimum and maximum

    def __init__(self, row_dim: int = 32) -> None:
        super().__init__(row_dim, option="row_dim")
        self.wire_per_block = (self.block + 1) // 2 + 4
        # Half a step s / 2, s <= (2m + a float16 step down of b) / 15 and a step up
        # (2**-10 relative, 2**-24 in the subnormals); 2**-20 m covers float32's roundings.
        self.info = CodecInfo(
            "int4",
            bits_per_element=8.0 * self.wire_per_block / self.block,
            rel_error_bound=(1.0 + 2.0**-9) / 15.0 + 2.0**-20,
            abs_error_bound=2.0**-24,
            error_block=self.block,
            max_abs_input=65504.0,
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
        rows = self.pad_blocks(flat).view(-1, self.block)
        bias = _fp16(rows.amin(dim=1), up=False)
        rng = rows.amax(dim=1) - bias.float()
        scale = _fp16((rng / torch.full_like(rng, 15.0)).clamp_(min=2.0**-24), up=True)
        q = ((rows - bias.float()[:, None]) / scale.float()[:, None]).round_().clamp_(0, 15)
        bad = (~(bias.isfinite() & scale.isfinite()))[:, None]
        q = torch.nn.functional.pad(q.masked_fill_(bad, 0).to(torch.uint8), (0, self.block % 2))
        meta = torch.stack([scale, bias], dim=1).masked_fill_(bad, torch.nan)
        return torch.cat([q[:, 0::2] | (q[:, 1::2] << 4), meta.view(torch.uint8)], 1).view(-1)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.view(-1, self.wire_per_block)
        meta = rows[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float16)
        q = torch.stack([rows[:, :-4] & 15, rows[:, :-4] >> 4], dim=2).flatten(1)
        # q * s is exact in float32 (4 + 11 bits): one rounding, fused or not.
        return (q[:, : self.block].float() * meta[:, :1].float() + meta[:, 1:].float()).view(-1)
