r"""
``example_fp16_scaled``: float16 on the wire, with a power-of-two scale per
block of ``block_size`` elements.

A plain float16 cast overflows above 65504 and flushes magnitudes below
``6e-8`` to zero. Scaling each block so that its largest magnitude lands in
:math:`[2^{14}, 2^{15})` before the cast keeps the whole float32 range, at the
cost of one extra float16 word per block.

Wire format, for ``n`` input elements in blocks of ``B = block_size``: for each
block, one float16 word holding the integer exponent :math:`e` of the block's
scale :math:`2^e`, then the block's elements divided by :math:`2^e` as float16.
The last block may be short, so the wire has ``n + ceil(n / B)`` words and the
decoder recovers ``n`` from the wire length alone. Blocks never straddle a
multiple of ``B``: the wire of a concatenation of ``B``-aligned pieces is the
concatenation of the pieces' wires, which is what an all-to-all needs.

Non-finite input: NaN and +-Inf propagate to the same element of the output;
they do not enter the block's scale, so the other elements of the block are
unaffected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from qcomm import CodecInfo

__all__ = ["ScaledFP16Context", "ScaledFP16Codec"]

# The block maximum is scaled into [2**14, 2**15): below float16's largest
# finite value (65504) even after rounding up, with 11 significant bits.
_TOP_EXPONENT = 14
# Scales stay normal float32 numbers, so the scale factors are exact powers
# of two built from their bits; blocks smaller than 2**-112 just use 2**-126.
_MIN_EXPONENT = -126
# The largest block_size: as large as the built-in block codecs allow.
_MAX_BLOCK = 1 << 16


@dataclasses.dataclass
class ScaledFP16Context:
    r"""
    Per-call context of :class:`ScaledFP16Codec`.

    Encoding and decoding need nothing from it (everything travels in-band);
    it only carries what :meth:`ScaledFP16Codec.padded_size` records for
    TorchRec.

    Args:
        padded_dim_sum_per_rank (list[int], optional): every rank's column
            count after padding to whole blocks. Default: ``None``.
    """

    padded_dim_sum_per_rank: list[int] | None = None


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    # 2**e assembled from its float32 bit pattern: exact, unlike exp2 or pow,
    # whose vectorized kernels may be off by an ulp. Needs -126 <= e <= 127.
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


class ScaledFP16Codec:
    r"""
    Float16 with a power-of-two scale per block of ``block_size`` elements;
    see the module docstring for the wire format.

    Error bound: scaling by a power of two is exact, and the float16 cast
    rounds to nearest with 11 significant bits, so every element is within
    :math:`2^{-11}` of its block's largest magnitude (elements that are
    float16 subnormals after scaling are within :math:`2^{-39}` of it).

    Args:
        block_size (int, optional): elements sharing one scale. Default: ``64``.

    Raises:
        ValueError: if ``block_size`` is not an integer from 1 to 65536.

    Examples::

        >>> import torch
        >>> codec = ScaledFP16Codec(block_size=4)
        >>> x = torch.tensor([1e30, -2.5e29, 3.0, 1e-30, 0.5])
        >>> wire = codec.encode(x)
        >>> wire.dtype, wire.numel(), codec.calc_quantized_size(5)
        (torch.float16, 7, 7)
        >>> bool(((codec.decode(wire) - x).abs() <= 2**-11 * 1e30).all())
        True
    """

    def __init__(self, block_size: int = 64) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 1 <= block_size <= _MAX_BLOCK:
            # A block is padded whole: a huge one makes a one-element tensor huge.
            raise ValueError(f"block_size must be between 1 and {_MAX_BLOCK}, got {block_size}")
        self.block_size = block_size
        self.info = CodecInfo(
            name="example_fp16_scaled",
            bits_per_element=16.0 * (block_size + 1) / block_size,
            rel_error_bound=2.0**-11,
            error_block=block_size,
        )

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype: ``torch.float16``.
        """
        return torch.float16

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Wire words for ``input_len`` elements: one per element plus one per block.

        Args:
            input_len (int): number of input elements.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            int: ``input_len + ceil(input_len / block_size)``.

        Raises:
            ValueError: if ``input_len`` is negative.

        Examples::

            >>> ScaledFP16Codec(block_size=64).calc_quantized_size(130)
            133
        """
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, got {input_len}")
        return input_len + -(-input_len // self.block_size)

    def create_context(self) -> ScaledFP16Context:
        r"""
        create_context() -> ScaledFP16Context

        A fresh context; only :meth:`padded_size` writes to it.

        Returns:
            ScaledFP16Context: an empty context.
        """
        return ScaledFP16Context()

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Encodes floats into the float16 wire format.

        Args:
            input_tensor (Tensor): floating-point values of any shape (TorchRec
                hands over a padded 2-D tensor); read in row-major order.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: 1-D float16 wire tensor of
            ``calc_quantized_size(input_tensor.numel())`` words.

        Raises:
            TypeError: if ``input_tensor`` is not floating-point.
        """
        if not input_tensor.is_floating_point():
            raise TypeError(f"input_tensor must be floating-point, got {input_tensor.dtype}")
        x = input_tensor.reshape(-1).float()
        n, block = x.numel(), self.block_size
        blocks = -(-n // block)
        rows = torch.nn.functional.pad(x, (0, blocks * block - n)).view(blocks, block)
        # Non-finite elements stay out of the scale so they spoil only themselves.
        finite_abs = torch.where(rows.isfinite(), rows.abs(), 0.0)
        _, top = torch.frexp(finite_abs.amax(dim=1))  # max = m * 2**top, 0.5 <= m < 1
        exponent = (top - 1 - _TOP_EXPONENT).clamp(min=_MIN_EXPONENT)
        body = (rows * _pow2(-exponent).unsqueeze(1)).to(torch.float16)
        wire = torch.cat([exponent.to(torch.float16).unsqueeze(1), body], dim=1)
        # The padding sits at the end of the last row, so cutting the flat
        # view drops exactly it.
        return wire.view(-1)[: n + blocks]

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Decodes a wire tensor (or a concatenation of whole wire tensors of
        ``block_size``-aligned inputs) back into float32.

        Args:
            input_grad (Tensor): 1-D float16 wire tensor.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: 1-D float32 tensor of the decoded values.

        Raises:
            TypeError: if ``input_grad`` is not a float16 tensor.
            ValueError: if its length is no valid wire length.
        """
        if not isinstance(input_grad, torch.Tensor):
            raise TypeError(
                f"input_grad must be a float16 wire tensor, got {type(input_grad).__name__}"
            )
        if input_grad.dtype != torch.float16:
            raise TypeError(f"input_grad must be a float16 wire tensor, got {input_grad.dtype}")
        wire = input_grad.reshape(-1)
        block = self.block_size
        full, rest = divmod(wire.numel(), block + 1)
        if rest == 1:
            raise ValueError(
                f"input_grad has {wire.numel()} words, which is no wire length for "
                f"block_size {block} (a block is 1 scale word plus 1 to {block} values)"
            )
        blocks = full + (rest > 0)
        rows = torch.nn.functional.pad(wire, (0, blocks * (block + 1) - wire.numel()))
        rows = rows.view(blocks, block + 1)
        scale = _pow2(rows[:, 0].float())
        values = rows[:, 1:].float() * scale.unsqueeze(1)
        return values.view(-1)[: wire.numel() - blocks]

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: Any,
    ) -> tuple[int, int]:
        r"""
        padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]

        Pads every rank's column count to whole blocks, so that each rank's
        share of a pooled all-to-all starts on a block boundary.

        Args:
            input_tensor (Tensor): this rank's input ``[batch, dim_per_rank[my_rank]]``.
            dim_per_rank (list[int]): embedding dim sum of every rank.
            my_rank (int): this rank.
            qcomm_ctx (Any): the call's context; every rank's padded width is
                recorded in its ``padded_dim_sum_per_rank`` (TorchRec reads it
                to size the receive splits and strip the padding).

        Returns:
            tuple[int, int]: ``(padded_dim_sum, padding_size)`` of this rank.

        Raises:
            ValueError: if ``input_tensor``'s width is not ``dim_per_rank[my_rank]``.

        Examples::

            >>> import torch
            >>> codec = ScaledFP16Codec(block_size=8)
            >>> ctx = codec.create_context()
            >>> codec.padded_size(torch.zeros(2, 5), [5, 16, 9], 0, ctx)
            (8, 3)
            >>> ctx.padded_dim_sum_per_rank
            [8, 16, 16]
        """
        if input_tensor.dim() == 1:
            return input_tensor.shape[0], 0
        width = dim_per_rank[my_rank]
        if input_tensor.dim() != 2 or input_tensor.shape[1] != width:
            raise ValueError(
                f"input_tensor must be [batch, {width}] (dim_per_rank[{my_rank}]), "
                f"got shape {tuple(input_tensor.shape)}"
            )
        block = self.block_size
        padded = [math.ceil(d / block) * block for d in dim_per_rank]
        if qcomm_ctx is not None:
            qcomm_ctx.padded_dim_sum_per_rank = padded
        return padded[my_rank], padded[my_rank] - width

    def __repr__(self) -> str:
        return f"ScaledFP16Codec(block_size={self.block_size})"
