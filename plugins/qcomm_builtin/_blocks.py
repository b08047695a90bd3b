r"""
Block arithmetic shared by the block codecs (row-wise int8 and FP8, MX4).

A block codec cuts its flat input into blocks of ``block`` consecutive
elements that share one scale. Any input length works: a partial last block
is padded up to ``block`` elements before encoding, so the wire always holds
whole blocks and ``decode`` returns ``num_blocks(n, block) * block`` elements,
of which the first ``n`` are the decoded input (the caller, who knows ``n``,
drops the rest).

Rows. An input of two or more dimensions is a stack of rows (its last
dimension). When a row is not whole blocks, every row is padded to whole
blocks, as fbgemm's MX4 does, so that no block straddles two rows; ``decode``
returns the rows padded. ``encode`` records the row length in its context
(:class:`BlockContext`), and with that context ``calc_quantized_size`` counts
whole rows and ``decode`` drops the padding of every row: TorchRec's sequence
all-to-all cuts its wire between rows and decodes with the same context.

For 2-D pooled inputs ``[batch, dim_sum]`` TorchRec asks the codec for column
padding (:func:`block_padded_size`) so that every rank's rows are whole blocks;
then every destination's share of the wire is aligned and the wire sizes add
up: ``q(a) + q(b) == q(a + b)`` whenever ``a`` is a multiple of ``block``.

A wire can be cut only between blocks (between rows for padded rows). After
``encode``, ``calc_quantized_size`` with its context refuses any other cut
but the whole input with a :class:`~qcomm.CodecError`, raised before anything
is sent: TorchRec cuts a 1-D tensor (its pooled backward, its variable-batch
all-to-all, its sequence forward) at multiples of the embedding dimension,
which falls inside a block when the block does not divide that dimension.

API (stable; other plugins import it):

- :func:`check_block_size` validates a block-size option.
- :func:`num_blocks`, :func:`padded_length` do the length arithmetic.
- :func:`flatten_input` validates and flattens an ``encode`` input.
- :func:`block_rows` flattens it with its rows padded to whole blocks.
- :func:`pad_to_blocks` pads a flat tensor to whole blocks.
- :func:`check_wire` validates a wire tensor before decoding.
- :class:`BlockContext` is the per-call context of a block codec.
- :func:`block_padded_size` implements the codec's ``padded_size``.
- :class:`BlockCodec` holds the members every block codec shares.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from qcomm import CodecError, CodecInfo
from qcomm_builtin._native import check_out, copy_into, lines_of

__all__ = [
    "MAX_BLOCK",
    "BlockCodec",
    "BlockContext",
    "block_padded_size",
    "block_rows",
    "check_block_size",
    "check_wire",
    "flatten_input",
    "num_blocks",
    "pad_to_blocks",
    "padded_length",
]

#: The largest block a codec accepts. A partial block is padded to a whole one,
#: so a block of 2**32 made a one-element tensor cost 16 GiB; past 65536
#: elements per scale the metadata is below 0.02% of the wire anyway.
MAX_BLOCK = 1 << 16


@dataclasses.dataclass
class BlockContext:
    r"""
    Per-call context of a block codec, shaped like fbgemm's
    ``QuantizationContext`` where TorchRec reads it.

    It is never sent: every rank builds its own with ``create_context()``,
    and what it records are shapes, which TorchRec's collectives share across
    ranks (all ranks of a sequence all-to-all have one embedding dimension).

    Args:
        row_dim (int): elements per block (a row of int8/FP8, a group of MX4).
        padded_dim_sum_per_rank (list[int], optional): every rank's column
            count after padding, written by :func:`block_padded_size` and read
            by the receiver to size its splits and strip the padding.
            Default: ``None``.
        row_length (int, optional): where the wire of this call's ``encode``
            may be cut, in input elements: the input's row length when its
            rows were padded to whole blocks, else ``row_dim``. Written by
            ``encode``. Default: ``None`` (nothing encoded yet).
        input_length (int, optional): the number of elements ``encode`` was
            given (a cut there is the whole wire). Default: ``None``.

    Examples::

        >>> BlockContext(row_dim=32)
        BlockContext(row_dim=32, padded_dim_sum_per_rank=None, row_length=None, input_length=None)
    """

    row_dim: int
    padded_dim_sum_per_rank: list[int] | None = None
    row_length: int | None = None
    input_length: int | None = None


def check_block_size(name: str, value: object) -> int:
    r"""
    check_block_size(name: str, value: object) -> int

    Validates a block-size option such as ``row_dim`` or ``group_size``: at
    most :data:`MAX_BLOCK`.

    Args:
        name (str): the option's name, used in the error message.
        value (object): what the user passed.

    Returns:
        int: ``value`` as a plain ``int``.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` is refused).
        ValueError: if ``value`` is not in ``[1, MAX_BLOCK]``.

    Examples::

        >>> check_block_size("row_dim", 64)
        64
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if not 0 < int(value) <= MAX_BLOCK:
        raise ValueError(f"{name} must be an int from 1 to {MAX_BLOCK}, got {value!r}")
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


def block_rows(
    input_tensor: torch.Tensor, block: int, codec: str, *, edge: bool = False
) -> tuple[torch.Tensor, int]:
    r"""
    block_rows(input_tensor: Tensor, block: int, codec: str, *, edge: bool = False) -> tuple[Tensor, int]

    :func:`flatten_input`, with every row (the last dimension of an input of
    two or more dimensions) padded to whole blocks when it is not, as fbgemm
    pads MX4 input.

    Args:
        input_tensor (Tensor): the values to encode, any shape.
        block (int): elements per block.
        codec (str): the codec's name, used in error messages.
        edge (bool, optional): pad with the row's last element instead of
            zeros (see :func:`pad_to_blocks`). Default: ``False``.

    Returns:
        tuple[Tensor, int]: the 1-D float32 input, and where its wire may be
        cut: the row length when rows were padded, else ``block``.

    Raises:
        TypeError: if ``input_tensor`` is not a floating-point tensor.

    Examples::

        >>> flat, row = block_rows(torch.ones(2, 3), 2, "int8")
        >>> flat.tolist(), row
        ([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0], 3)
    """
    flat = flatten_input(input_tensor, codec)
    width = input_tensor.shape[-1] if input_tensor.dim() >= 2 else 0
    if width % block == 0:  # a 1-D input, or rows of whole blocks
        return flat, block
    rows = flat.view(-1, width)
    extra = padded_length(width, block) - width
    fill = rows[:, -1:].expand(-1, extra) if edge else rows.new_zeros(rows.shape[0], extra)
    return torch.cat([rows, fill], dim=1).view(-1), width


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


def _padded_row(ctx: object, block: int) -> int | None:
    # The row length of the call's encode when it padded rows, else None.
    row = ctx.row_length if isinstance(ctx, BlockContext) else None
    return row if row is not None and row % block else None


class ElementwiseCodec:
    r"""
    What every element-wise cast shares: one wire element per input element,
    no per-call context, no column padding.
    """

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        One wire element per input element.

        Args:
            input_len (int): number of input elements.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            int: ``input_len``.

        Raises:
            ValueError: if ``input_len`` is negative.
        """
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, got {input_len}")
        return input_len

    def create_context(self) -> None:
        r"""
        create_context() -> None

        A cast keeps no per-call state.
        """
        return None

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: Any,
    ) -> tuple[int, int]:
        r"""
        padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]

        A cast needs no column padding.

        Args:
            input_tensor (Tensor): the pooled input ``[batch, dim_sum]``.
            dim_per_rank (list[int]): embedding dim sum of every rank.
            my_rank (int): this rank.
            qcomm_ctx (Any): ignored (the context is ``None``).

        Returns:
            tuple[int, int]: ``(dim_per_rank[my_rank], 0)`` for a 2-D input.

        Raises:
            ValueError: if the input's width is not ``dim_per_rank[my_rank]``.
        """
        return block_padded_size(input_tensor, dim_per_rank, my_rank, None, 1)


class BlockCodec:
    r"""
    The members every block codec shares: a block of :attr:`block` input
    elements travels as :attr:`block_bytes` wire bytes, a partial last block
    (or row, see the module) is padded, pooled inputs get their columns padded
    to whole blocks, the context records where the wire may be cut, and
    :meth:`decode_into` writes straight into the caller's layout where the
    codec's C kernel can.

    Subclasses set :attr:`block`, :attr:`block_bytes` and ``info`` in
    ``__init__``, and add ``quantized_dtype``, ``_encode_flat`` (whole
    blocks of a flat float32 input, a partial last one padded, to the wire),
    ``_decode_flat`` (a checked wire to its blocks' values) and, when they
    have a C decoder, ``_decode_lines``.
    """

    #: input elements per block (``row_dim`` or ``group_size``)
    block: int
    #: wire bytes per block, metadata included
    block_bytes: int
    info: CodecInfo
    #: pad partial blocks with their last element instead of zeros (min/max codecs)
    _edge_pad = False
    # TorchRec's variable-batch all-to-all reads fbgemm's private
    # `_comm_precision` of a codec whose context has `row_dim > 0`, to pad
    # its splits for fbgemm's row-wise FP8 alone. None is no fbgemm precision:
    # TorchRec sends the splits as they are, and calc_quantized_size refuses
    # a split that would cut a block.
    _comm_precision = None

    def _encode_flat(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_flat(self, wire: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, input_tensor: torch.Tensor, ctx: BlockContext | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: BlockContext | None = None) -> Tensor

        Encodes block by block into the codec's wire (see the class).

        Args:
            input_tensor (Tensor): floating-point values, any shape, read
                row-major and computed in float32; rows (the last dimension)
                that are not whole blocks are padded row by row.
            ctx (BlockContext, optional): records where the wire may be cut
                (see :class:`~qcomm_builtin._blocks.BlockContext`). Default: ``None``.

        Returns:
            Tensor: 1-D ``uint8`` wire of whole blocks.

        Raises:
            TypeError: if ``input_tensor`` is not a floating-point tensor.
        """
        flat, row = block_rows(input_tensor, self.block, self.info.name, edge=self._edge_pad)
        if isinstance(ctx, BlockContext):
            ctx.row_length, ctx.input_length = row, input_tensor.numel()
        return self._encode_flat(flat)

    def decode(self, input_grad: torch.Tensor, ctx: BlockContext | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: BlockContext | None = None) -> Tensor

        Decodes every block of the wire.

        Args:
            input_grad (Tensor): ``uint8`` wire of whole blocks.
            ctx (BlockContext, optional): when this call's ``encode`` padded
                rows, the wire is taken as such rows and their padding is
                dropped. Default: ``None``.

        Returns:
            Tensor: 1-D float32, :attr:`block` elements per wire block, or
            the rows without their padding.

        Raises:
            ValueError: if ``input_grad`` is not ``uint8``, or its length is
                not whole blocks (whole rows with such a context).
        """
        name = self.info.name
        wire = check_wire(input_grad, torch.uint8, self.block_bytes, name)
        row = _padded_row(ctx, self.block)
        if row is None:
            return self._decode_flat(wire)
        row_bytes = num_blocks(row, self.block) * self.block_bytes
        if wire.numel() % row_bytes:
            raise ValueError(
                f"{name}.decode: input_grad must be whole rows of {row} elements "
                f"({row_bytes} bytes each, as this call's encode wrote them), got {wire.numel()} bytes"
            )
        values = self._decode_flat(wire).view(-1, padded_length(row, self.block))
        return values[:, :row].reshape(-1)

    def calc_quantized_size(self, input_len: int, ctx: BlockContext | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: BlockContext | None = None) -> int

        Wire bytes for ``input_len`` elements: :attr:`block_bytes` per
        (started) block, or per block of every row when this call's
        ``encode`` padded rows.

        Args:
            input_len (int): number of input elements.
            ctx (BlockContext, optional): the call's context. Default: ``None``.

        Returns:
            int: ``ceil(input_len / block) * block_bytes``, or ``rows *
            ceil(row_length / block) * block_bytes`` for padded rows.

        Raises:
            ValueError: if ``input_len`` is negative.
            CodecError: if, after ``encode``, ``input_len`` would cut its
                wire inside a block or row (see the module), other than at
                its end.
        """
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, got {input_len}")
        blocks = num_blocks(input_len, self.block)
        if not isinstance(ctx, BlockContext) or ctx.row_length is None:
            return blocks * self.block_bytes
        row, flat = ctx.row_length, ctx.row_length == self.block
        if input_len % row == 0 or (flat and input_len == ctx.input_length):
            if not flat:  # every row padded to whole blocks
                blocks = input_len // row * num_blocks(row, self.block)
            return blocks * self.block_bytes
        unit = "block" if flat else "row"
        raise CodecError(
            f"codec {self.info.name!r}: calc_quantized_size({input_len}) cuts the wire of this "
            f"call's encode ({ctx.input_length} elements, {unit}s of {row}) inside a {unit}, "
            f"whose elements would go to two destinations. TorchRec cuts 1-D tensors at "
            f"multiples of the embedding dimension: give the codec a block size that divides "
            f"every embedding dimension"
        )

    def create_context(self) -> BlockContext:
        r"""
        create_context() -> BlockContext

        A fresh context; :meth:`padded_size` records every rank's padded
        width in it, :meth:`encode` where its wire may be cut.
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

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: BlockContext | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: BlockContext | None = None) -> None

        Writes what :meth:`decode` returns into ``out``, in row-major order.
        With the C kernels, a contiguous ``out``, or lines of whole blocks
        such as a column band ``big[:, a:b]`` of a larger matrix, is written
        directly; any other layout, and rows whose padding is dropped, get a
        decoded copy.

        Args:
            input_grad (Tensor): ``uint8`` wire of whole blocks.
            out (Tensor): float32, as many elements as :meth:`decode`
                returns, any shape and strides.
            ctx (BlockContext, optional): as for :meth:`decode`. Default: ``None``.

        Raises:
            ValueError: if ``input_grad`` is malformed (as ``decode``), or
                ``out`` is not a float32 tensor of that many elements.
        """
        name = self.info.name
        wire = check_wire(input_grad, torch.uint8, self.block_bytes, name)
        if _padded_row(ctx, self.block) is not None:
            values = self.decode(wire, ctx)
            copy_into(check_out(out, values.numel(), name), values)
            return
        blocks = wire.numel() // self.block_bytes
        check_out(out, blocks * self.block, name)
        if blocks == 0:
            return
        lines = lines_of(out, self.block) if wire.device.type == "cpu" else None
        if lines is None or not self._decode_lines(wire, blocks, out, *lines):
            copy_into(out, self._decode_flat(wire))
