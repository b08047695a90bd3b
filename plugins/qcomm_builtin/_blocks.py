r"""
Block arithmetic shared by the block codecs (row-wise int8 and FP8, MX4).

A block codec cuts its flat input into blocks of ``block`` consecutive
elements that share one scale. Any input length works: a partial last block
is padded up to ``block`` elements before encoding, so the wire always holds
whole blocks and ``decode`` returns ``num_blocks(n, block) * block`` elements,
of which the first ``n`` are the decoded input (the caller, who knows ``n``,
drops the rest).

For 2-D pooled inputs ``[batch, dim_sum]`` TorchRec asks the codec for column
padding (:func:`block_padded_size`) so that every rank's rows are whole blocks;
then every destination's share of the wire is aligned and the wire sizes add
up: ``q(a) + q(b) == q(a + b)`` whenever ``a`` is a multiple of ``block``.

API (stable; other plugins import it):

- :func:`check_block_size` validates a block-size option.
- :func:`num_blocks`, :func:`padded_length` do the length arithmetic.
- :func:`flatten_input` validates and flattens an ``encode`` input.
- :func:`pad_to_blocks` pads a flat tensor to whole blocks.
- :func:`check_wire` validates a wire tensor before decoding.
- :class:`BlockContext` is the per-call context of a block codec.
- :func:`block_padded_size` implements the codec's ``padded_size``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from qcomm_builtin._native import check_out, copy_into, lines_of

__all__ = [
    "BlockContext",
    "block_padded_size",
    "check_block_size",
    "check_wire",
    "flatten_input",
    "num_blocks",
    "pad_to_blocks",
    "padded_length",
]


@dataclasses.dataclass
class BlockContext:
    r"""
    Per-call context of a block codec, shaped like fbgemm's
    ``QuantizationContext`` where TorchRec reads it.

    It is never sent: every rank builds its own with ``create_context()``.

    Args:
        row_dim (int): elements per block (a row of int8/FP8, a group of MX4).
        padded_dim_sum_per_rank (list[int], optional): every rank's column
            count after padding, written by :func:`block_padded_size` and read
            by the receiver to size its splits and strip the padding.
            Default: ``None``.

    Examples::

        >>> BlockContext(row_dim=32)
        BlockContext(row_dim=32, padded_dim_sum_per_rank=None)
    """

    row_dim: int
    padded_dim_sum_per_rank: list[int] | None = None


def check_block_size(name: str, value: object) -> int:
    r"""
    check_block_size(name: str, value: object) -> int

    Validates a block-size option such as ``row_dim`` or ``group_size``.

    Args:
        name (str): the option's name, used in the error message.
        value (object): what the user passed.

    Returns:
        int: ``value`` as a plain ``int``.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` is refused).
        ValueError: if ``value`` is not positive.

    Examples::

        >>> check_block_size("row_dim", 64)
        64
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def num_blocks(n: int, block: int) -> int:
    r"""
    num_blocks(n: int, block: int) -> int

    Number of blocks holding ``n`` elements, a partial last block counted whole.

    Args:
        n (int): number of elements, ``>= 0``.
        block (int): elements per block, ``> 0``.

    Returns:
        int: :math:`\lceil n / \text{block} \rceil`.

    Raises:
        ValueError: if ``n`` is negative.

    Examples::

        >>> num_blocks(0, 32), num_blocks(1, 32), num_blocks(64, 32), num_blocks(65, 32)
        (0, 1, 2, 3)
    """
    if n < 0:
        raise ValueError(f"input_len must be >= 0, got {n}")
    return -(-n // block)


def padded_length(n: int, block: int) -> int:
    r"""
    padded_length(n: int, block: int) -> int

    ``n`` rounded up to a multiple of ``block``: what ``decode`` returns.

    Args:
        n (int): number of elements, ``>= 0``.
        block (int): elements per block, ``> 0``.

    Returns:
        int: ``num_blocks(n, block) * block``.

    Examples::

        >>> padded_length(33, 32)
        64
    """
    return num_blocks(n, block) * block


def flatten_input(input_tensor: torch.Tensor, codec: str) -> torch.Tensor:
    r"""
    flatten_input(input_tensor: Tensor, codec: str) -> Tensor

    Checks that an ``encode`` input is a floating tensor and returns it as a
    contiguous 1-D float32 tensor (a view where possible; never modified),
    detached: quantizing is not differentiable, the collectives carry the
    gradients with the backward codec.

    TorchRec hands a padded 2-D tensor to ``encode``; it is read row-major.

    Args:
        input_tensor (Tensor): the values to encode, any shape.
        codec (str): the codec's name, used in the error message.

    Returns:
        Tensor: 1-D float32.

    Raises:
        TypeError: if ``input_tensor`` is not a floating-point tensor.

    Examples::

        >>> flatten_input(torch.ones(2, 3), "int8").shape
        torch.Size([6])
    """
    if not isinstance(input_tensor, torch.Tensor):
        raise TypeError(
            f"{codec}.encode: input_tensor must be a torch.Tensor, got {type(input_tensor).__name__}"
        )
    if not input_tensor.is_floating_point():
        raise TypeError(
            f"{codec}.encode: input_tensor must be a floating-point tensor, got {input_tensor.dtype}"
        )
    return input_tensor.detach().reshape(-1).to(torch.float32).contiguous()


def pad_to_blocks(flat: torch.Tensor, block: int, *, edge: bool = False) -> torch.Tensor:
    r"""
    pad_to_blocks(flat: Tensor, block: int, *, edge: bool = False) -> Tensor

    Pads a 1-D tensor to a whole number of blocks; returns ``flat`` itself
    when it is already aligned.

    Args:
        flat (Tensor): 1-D tensor.
        block (int): elements per block.
        edge (bool, optional): repeat the last element instead of padding with
            zeros, so that the padded block keeps the minimum and maximum of
            its real elements (min/max codecs). Default: ``False``.

    Returns:
        Tensor: 1-D, ``padded_length(flat.numel(), block)`` elements.

    Examples::

        >>> pad_to_blocks(torch.tensor([1.0, 2.0, 3.0]), 2).tolist()
        [1.0, 2.0, 3.0, 0.0]
        >>> pad_to_blocks(torch.tensor([1.0, 2.0, 3.0]), 2, edge=True).tolist()
        [1.0, 2.0, 3.0, 3.0]
    """
    n = flat.numel()
    extra = padded_length(n, block) - n
    if extra == 0:
        return flat
    fill = flat[-1:].expand(extra) if edge else flat.new_zeros(extra)
    return torch.cat([flat, fill])


def check_wire(wire: torch.Tensor, dtype: torch.dtype, unit: int, codec: str) -> torch.Tensor:
    r"""
    check_wire(wire: Tensor, dtype: torch.dtype, unit: int, codec: str) -> Tensor

    Checks a wire tensor before decoding it, so that a malformed one raises
    instead of being read out of bounds.

    Args:
        wire (Tensor): what ``decode`` received.
        dtype (torch.dtype): the codec's ``quantized_dtype``.
        unit (int): wire elements per block; the length must be a multiple.
        codec (str): the codec's name, used in the error message.

    Returns:
        Tensor: the wire as a contiguous 1-D tensor.

    Raises:
        ValueError: if ``wire`` has the wrong dtype or its length is not a
            multiple of ``unit``.

    Examples::

        >>> check_wire(torch.zeros(40, dtype=torch.uint8), torch.uint8, 40, "int8").shape
        torch.Size([40])
    """
    if not isinstance(wire, torch.Tensor):
        raise ValueError(
            f"{codec}.decode: input_grad must be a torch.Tensor, got {type(wire).__name__}"
        )
    if wire.dtype != dtype:
        raise ValueError(f"{codec}.decode: input_grad must have dtype {dtype}, got {wire.dtype}")
    flat = wire.reshape(-1)
    if flat.numel() % unit:
        raise ValueError(
            f"{codec}.decode: input_grad length must be a multiple of {unit} "
            f"(wire elements per block), got {flat.numel()}"
        )
    return flat.contiguous()


def block_padded_size(
    input_tensor: torch.Tensor,
    dim_per_rank: list[int],
    my_rank: int,
    qcomm_ctx: BlockContext | None,
    block: int,
) -> tuple[int, int]:
    r"""
    block_padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: BlockContext | None, block: int) -> tuple[int, int]

    The ``padded_size`` of a block codec: pads every rank's column count up to
    a multiple of ``block`` and records all of them in
    ``qcomm_ctx.padded_dim_sum_per_rank``.

    A 1-D input needs no column padding (as in fbgemm): it returns
    ``(numel, 0)`` and records nothing.

    Args:
        input_tensor (Tensor): the pooled input ``[batch, dim_sum]``.
        dim_per_rank (list[int]): embedding dim sum of every rank.
        my_rank (int): this rank.
        qcomm_ctx (BlockContext, optional): the call's context; nothing is
            recorded when ``None``.
        block (int): elements per block.

    Returns:
        tuple[int, int]: ``(padded_dim_sum, padding_size)`` of this rank.

    Raises:
        ValueError: if ``my_rank`` is out of range, a dim is negative, or the
            input's column count is not ``dim_per_rank[my_rank]``.

    Examples::

        >>> ctx = BlockContext(row_dim=32)
        >>> block_padded_size(torch.zeros(4, 40), [40, 64, 1], 0, ctx, 32)
        (64, 24)
        >>> ctx.padded_dim_sum_per_rank
        [64, 64, 32]
    """
    if input_tensor.dim() == 1:
        return input_tensor.shape[0], 0
    if not 0 <= my_rank < len(dim_per_rank):
        raise ValueError(f"my_rank must be in [0, {len(dim_per_rank)}), got {my_rank}")
    if any(d < 0 for d in dim_per_rank):
        raise ValueError(f"dim_per_rank must hold non-negative ints, got {dim_per_rank}")
    if input_tensor.dim() != 2 or input_tensor.shape[1] != dim_per_rank[my_rank]:
        raise ValueError(
            f"input_tensor must be [batch, {dim_per_rank[my_rank]}] "
            f"(dim_per_rank[{my_rank}]), got shape {list(input_tensor.shape)}"
        )
    padded = [padded_length(d, block) for d in dim_per_rank]
    if qcomm_ctx is not None:
        qcomm_ctx.padded_dim_sum_per_rank = padded
    return padded[my_rank], padded[my_rank] - dim_per_rank[my_rank]


class BlockCodec:
    r"""
    The members every block codec shares: a block of :attr:`block` input
    elements travels as :attr:`block_bytes` wire bytes, a partial last block
    is padded, pooled inputs get their columns padded to whole blocks, and
    :meth:`decode_into` writes straight into the caller's layout where the
    codec's C kernel can.

    Subclasses set both attributes in ``__init__`` and add ``encode``,
    ``decode``, ``quantized_dtype``, ``info`` and, when they have a C
    decoder, ``_decode_lines``.
    """

    #: input elements per block (``row_dim`` or ``group_size``)
    block: int
    #: wire bytes per block, metadata included
    block_bytes: int

    def calc_quantized_size(self, input_len: int, ctx: BlockContext | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: BlockContext | None = None) -> int

        Wire bytes for ``input_len`` elements: :attr:`block_bytes` per
        (started) block.

        Args:
            input_len (int): number of input elements.
            ctx (BlockContext, optional): ignored. Default: ``None``.

        Returns:
            int: ``ceil(input_len / block) * block_bytes``.

        Raises:
            ValueError: if ``input_len`` is negative.
        """
        return num_blocks(input_len, self.block) * self.block_bytes

    def create_context(self) -> BlockContext:
        r"""
        create_context() -> BlockContext

        A fresh context; :meth:`padded_size` records every rank's padded width in it.
        """
        return BlockContext(row_dim=self.block)

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: BlockContext | None,
    ) -> tuple[int, int]:
        r"""
        padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: BlockContext | None) -> tuple[int, int]

        Pads every rank's embedding width to a multiple of :attr:`block` and
        records all of them in ``qcomm_ctx.padded_dim_sum_per_rank``, as
        TorchRec's block-codec path expects.

        Args:
            input_tensor (Tensor): the pooled input ``[batch, dim_sum]``.
            dim_per_rank (list[int]): embedding dim sum of every rank.
            my_rank (int): this rank.
            qcomm_ctx (BlockContext, optional): the call's context.

        Returns:
            tuple[int, int]: ``(padded_dim_sum, padding_size)`` of this rank.

        Raises:
            ValueError: if the input's width is not ``dim_per_rank[my_rank]``.
        """
        return block_padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx, self.block)

    def _decode_lines(
        self, wire: torch.Tensor, blocks: int, out: torch.Tensor, width: int, stride: int
    ) -> bool:
        # Decodes `blocks` blocks of `wire` with the C kernel into `out`, laid
        # out as lines of `width` floats `stride` apart; False where no kernel
        # may (the caller then decodes and copies).
        return False

    def decode_into(self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any = None) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any = None) -> None

        Writes what ``decode`` returns into ``out``, in row-major order. With
        the C kernels, a contiguous ``out``, or lines of whole blocks such as
        a column band ``big[:, a:b]`` of a larger matrix, is written directly;
        any other layout gets a decoded copy.

        Args:
            input_grad (Tensor): ``uint8`` wire of whole blocks.
            out (Tensor): float32, :attr:`block` elements per wire block, any
                shape and strides.
            ctx (Any, optional): ignored. Default: ``None``.

        Raises:
            ValueError: if ``input_grad`` is malformed (as ``decode``), or
                ``out`` is not a float32 tensor of that many elements.
        """
        name = self.info.name  # type: ignore[attr-defined]
        wire = check_wire(input_grad, torch.uint8, self.block_bytes, name)
        blocks = wire.numel() // self.block_bytes
        check_out(out, blocks * self.block, name)
        if blocks == 0:
            return
        lines = lines_of(out, self.block) if wire.device.type == "cpu" else None
        if lines is None or not self._decode_lines(wire, blocks, out, *lines):
            copy_into(out, self.decode(wire, ctx))  # type: ignore[attr-defined]
