r"""
Base classes that keep the codec contract (:doc:`codecs`), so that a codec
writes its format alone: :class:`ElementwiseCodec`, :class:`BlockCodec`.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from typing import Any

import torch

from qcomm.types import CodecError, CodecInfo, QuantizedCommCodec

__all__ = ["MAX_BLOCK", "BlockCodec", "BlockContext", "ElementwiseCodec"]

#: The largest block. A partial block is padded to a whole one, so a block of
#: 2**32 made a one-element tensor cost 16 GiB; past 65536 elements per scale
#: the metadata is below 0.02% of the wire anyway.
MAX_BLOCK = 1 << 16


def _flatten(x: Any, codec: str) -> torch.Tensor:
    # Detached: quantizing is not differentiable, the collectives carry the
    # gradients with the backward codec.
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{codec}.encode: input_tensor must be a torch.Tensor, got {type(x).__name__}"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"{codec}.encode: input_tensor must be a floating-point tensor, got {x.dtype}"
        )
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _check_wire(wire: Any, dtype: torch.dtype, unit: int, codec: str) -> torch.Tensor:
    # Checked before decoding, so that a malformed wire raises instead of
    # being read out of bounds.
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


def _check_out(out: Any, numel: int, codec: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"{codec}.decode_into: out must be a torch.Tensor, got {type(out).__name__}"
        )
    if out.dtype != torch.float32 or out.numel() != numel:
        raise ValueError(
            f"{codec}.decode_into: out must be a float32 tensor of {numel} elements "
            f"(what decode returns), got {out.dtype} with {out.numel()} elements"
        )
    return out


def _padded_size(
    x: torch.Tensor, dim_per_rank: list[int], my_rank: int, ctx: Any, block: int
) -> tuple[int, int]:
    # A 1-D input needs no column padding (as in fbgemm) and records nothing.
    if x.dim() == 1:
        return x.shape[0], 0
    if not 0 <= my_rank < len(dim_per_rank):
        raise ValueError(f"my_rank must be in [0, {len(dim_per_rank)}), got {my_rank}")
    if any(d < 0 for d in dim_per_rank):
        raise ValueError(f"dim_per_rank must hold non-negative ints, got {dim_per_rank}")
    if x.dim() != 2 or x.shape[1] != dim_per_rank[my_rank]:
        raise ValueError(
            f"input_tensor must be [batch, {dim_per_rank[my_rank]}] "
            f"(dim_per_rank[{my_rank}]), got shape {list(x.shape)}"
        )
    padded = [-(-d // block) * block for d in dim_per_rank]
    if ctx is not None:
        ctx.padded_dim_sum_per_rank = padded
    return padded[my_rank], padded[my_rank] - dim_per_rank[my_rank]


class _Codec(QuantizedCommCodec, abc.ABC):
    # What a subclass of either base writes.
    info: CodecInfo

    @property
    @abc.abstractmethod
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype."""

    @abc.abstractmethod
    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        r"""
        quantize(flat: Tensor) -> Tensor

        The 1-D wire of ``flat``, a contiguous 1-D float32 tensor not to modify.
        """

    @abc.abstractmethod
    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        r"""
        dequantize(wire: Tensor) -> Tensor

        The float32 values of ``wire``, a checked, contiguous 1-D wire.
        """

    def dequantize_into(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        r"""
        dequantize_into(wire: Tensor, out: Tensor) -> None

        Writes :meth:`dequantize` into ``out`` (float32, any strides); override
        it to spare the temporary.
        """
        out.copy_(self.dequantize(wire).view(out.shape))


class ElementwiseCodec(_Codec):
    r"""
    Base of a codec with one wire element per input element, such as a cast.

    A subclass sets ``info`` (a :class:`~qcomm.CodecInfo`) and writes
    :attr:`quantized_dtype`, :meth:`quantize` and :meth:`dequantize`; the base
    keeps the rest of the contract (:doc:`codecs`). The wire keeps the input's
    shape (TorchRec's reduce-scatter reads it).

    Examples::

        >>> import torch, qcomm
        >>> class Half(qcomm.ElementwiseCodec):
        ...     info = qcomm.CodecInfo("half", bits_per_element=16.0, summable=True)
        ...     @property
        ...     def quantized_dtype(self) -> torch.dtype:
        ...         return torch.float16
        ...     def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        ...         return flat.half()
        ...     def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        ...         return wire.float()
        >>> Half().decode(Half().encode(torch.tensor([[1.0, 2.5]])))
        tensor([[1.0000, 2.5000]])
    """

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        See :meth:`~qcomm.QuantizedCommCodec.encode`; the wire keeps the input's shape.

        Args:
            input_tensor (Tensor): the float tensor.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        return self.quantize(_flatten(input_tensor, self.info.name)).view(input_tensor.shape)

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        See :meth:`~qcomm.QuantizedCommCodec.decode`; the output keeps the wire's shape.

        Args:
            input_grad (Tensor): the wire tensor.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        wire = _check_wire(input_grad, self.quantized_dtype, 1, self.info.name)
        return self.dequantize(wire).view(input_grad.shape)

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any | None = None) -> None

        Writes what :meth:`decode` returns into ``out``, in row-major order.

        Args:
            input_grad (Tensor): the wire tensor.
            out (Tensor): float32, as many elements as ``decode`` returns, any strides.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        wire = _check_wire(input_grad, self.quantized_dtype, 1, self.info.name)
        self.dequantize_into(wire, _check_out(out, wire.numel(), self.info.name))

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Returns ``input_len``: one wire element per input element.

        Args:
            input_len (int): input elements.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, got {input_len}")
        return input_len

    def create_context(self) -> None:
        r"""
        create_context() -> None

        No context: returns ``None``.
        """
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        r"""
        padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]

        No padding: ``(dim_per_rank[my_rank], 0)``, after checking the arguments.

        Args:
            input_tensor (Tensor): this rank's input.
            dim_per_rank (list[int]): every rank's width.
            my_rank (int): this rank.
            qcomm_ctx (Any): ignored.
        """
        return _padded_size(input_tensor, dim_per_rank, my_rank, None, 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclasses.dataclass
class BlockContext:
    r"""
    The per-call context of a :class:`~qcomm.BlockCodec`, shaped like fbgemm's
    ``QuantizationContext`` where TorchRec reads it.

    Args:
        row_dim (int): elements per block.
        padded_dim_sum_per_rank (list[int], optional): every rank's padded
            width, from ``padded_size``. Default: ``None``.
        row_length (int, optional): where ``encode``'s wire may be cut: the
            row length when it padded rows that ``padded_size`` did not
            declare, else ``row_dim``. Default: ``None``.
        input_length (int, optional): elements ``encode`` got, counted with
            the rows' padding where ``row_length`` is ``row_dim``. Default: ``None``.
    """

    row_dim: int
    padded_dim_sum_per_rank: list[int] | None = None
    row_length: int | None = None
    input_length: int | None = None


class BlockCodec(_Codec):
    r"""
    BlockCodec(block: int, *, option: str = "block")

    Base of a codec whose input is cut into blocks of :attr:`block` elements
    sharing a scale, each :attr:`wire_per_block` wire elements long.

    A subclass calls ``super().__init__(block)``, sets :attr:`wire_per_block`
    and ``info``, and writes :attr:`quantized_dtype`, :meth:`quantize` (whose
    input may end in a partial block: :meth:`pad_blocks`) and
    :meth:`dequantize` (whole blocks); the base keeps the rest of the
    contract (:doc:`codecs`). Rows of a 2-D input that are not whole blocks
    are padded one by one, and a ``decode`` with the context of the
    ``encode`` drops that padding, unless :meth:`padded_size` declared it on
    that context: then, as with fbgemm's codecs, ``calc_quantized_size``
    counts padded rows and ``decode`` returns them. The example plugin and
    ``qcomm_builtin.int4`` are short subclasses to copy.

    Args:
        block (int): input elements per block, 1 to 65536.
        option (str, optional): its name in error messages. Default: ``"block"``.

    Raises:
        TypeError: if ``block`` is not an int.
        ValueError: if ``block`` is out of range.

    Examples::

        >>> import qcomm
        >>> codec = qcomm.load_codec("int4")
        >>> codec.block, codec.wire_per_block, codec.create_context()
        (32, 20, BlockContext(row_dim=32, padded_dim_sum_per_rank=None, row_length=None, input_length=None))
    """

    #: input elements per block
    block: int
    #: wire elements per block, metadata included
    wire_per_block: int
    #: pad with the last element rather than zeros (keeps a min/max codec's range)
    edge_pad = False
    # TorchRec's variable-batch all-to-all reads fbgemm's private
    # `_comm_precision` of a codec whose context has `row_dim > 0`, to pad
    # its splits for fbgemm's row-wise FP8 alone. None is no fbgemm precision:
    # TorchRec sends the splits as they are, and calc_quantized_size refuses
    # a split that would cut a block.
    _comm_precision = None

    def __init__(self, block: int, *, option: str = "block") -> None:
        if isinstance(block, bool) or not isinstance(block, numbers.Integral):
            raise TypeError(
                f"{option} must be a positive int, got {type(block).__name__} {block!r}"
            )
        if not 0 < int(block) <= MAX_BLOCK:
            raise ValueError(f"{option} must be an int from 1 to {MAX_BLOCK}, got {block!r}")
        self.block = int(block)
        self._option: str = option

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._option}={self.block})"

    def pad_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        r"""
        pad_blocks(flat: Tensor) -> Tensor

        ``flat`` padded to whole blocks (see :attr:`edge_pad`), or itself.

        Args:
            flat (Tensor): a 1-D tensor.
        """
        extra = -flat.numel() % self.block
        if extra == 0:
            return flat
        fill = flat[-1:].expand(extra) if self.edge_pad else flat.new_zeros(extra)
        return torch.cat([flat, fill])

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        # The flat input, its rows padded to whole blocks when they are not
        # (as fbgemm pads MX4 rows), and where its wire may be cut.
        flat = _flatten(x, self.info.name)
        width = x.shape[-1] if x.dim() >= 2 else 0
        if width % self.block == 0:
            return flat, self.block
        rows = flat.view(-1, width)
        extra = -width % self.block
        fill = rows[:, -1:].expand(-1, extra) if self.edge_pad else rows.new_zeros(len(rows), extra)
        return torch.cat([rows, fill], dim=1).view(-1), width

    def _padded_row(self, ctx: Any) -> int | None:
        # The row length of the call's encode when it padded rows, else None.
        row = ctx.row_length if isinstance(ctx, BlockContext) else None
        return row if row is not None and row % self.block else None

    def encode(self, input_tensor: torch.Tensor, ctx: BlockContext | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: BlockContext | None = None) -> Tensor

        See :meth:`~qcomm.QuantizedCommCodec.encode`; returns 1-D whole blocks, recorded in ``ctx``.

        Args:
            input_tensor (Tensor): the float tensor.
            ctx (BlockContext, optional): this call's context. Default: ``None``.
        """
        flat, row = self._rows(input_tensor)
        if isinstance(ctx, BlockContext):
            if ctx.padded_dim_sum_per_rank is not None:
                # padded_size declared the padding (TorchRec's pooled path, the
                # codec tests of TorchRec and fbgemm): sizes and decode count the
                # padded rows, as fbgemm's codecs do.
                row = self.block
            ctx.row_length = row
            ctx.input_length = flat.numel() if row == self.block else input_tensor.numel()
        return self.quantize(flat)

    def decode(self, input_grad: torch.Tensor, ctx: BlockContext | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: BlockContext | None = None) -> Tensor

        See :meth:`~qcomm.QuantizedCommCodec.decode`; drops row padding recorded in ``ctx``.

        Args:
            input_grad (Tensor): the wire tensor.
            ctx (BlockContext, optional): this call's context. Default: ``None``.
        """
        name = self.info.name
        wire = _check_wire(input_grad, self.quantized_dtype, self.wire_per_block, name)
        row = self._padded_row(ctx)
        if row is None:
            return self.dequantize(wire)
        blocks = -(-row // self.block)
        row_wire = blocks * self.wire_per_block
        if wire.numel() % row_wire:
            raise ValueError(
                f"{name}.decode: input_grad must be whole rows of {row} elements "
                f"({row_wire} wire elements each, as this call's encode wrote them), "
                f"got {wire.numel()}"
            )
        return self.dequantize(wire).view(-1, blocks * self.block)[:, :row].reshape(-1)

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: BlockContext | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: BlockContext | None = None) -> None

        Writes what :meth:`decode` returns into ``out``, in row-major order.

        Args:
            input_grad (Tensor): the wire tensor.
            out (Tensor): float32, as many elements as ``decode`` returns, any strides.
            ctx (BlockContext, optional): this call's context. Default: ``None``.
        """
        name = self.info.name
        wire = _check_wire(input_grad, self.quantized_dtype, self.wire_per_block, name)
        if self._padded_row(ctx) is not None:
            values = self.decode(wire, ctx)
            _check_out(out, values.numel(), name).copy_(values.view(out.shape))
            return
        blocks = wire.numel() // self.wire_per_block
        _check_out(out, blocks * self.block, name)
        if blocks:
            self.dequantize_into(wire, out)

    def calc_quantized_size(self, input_len: int, ctx: BlockContext | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: BlockContext | None = None) -> int

        Raises :class:`~qcomm.CodecError` for a cut inside a block or a padded row.

        Args:
            input_len (int): input elements.
            ctx (BlockContext, optional): this call's context. Default: ``None``.
        """
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, got {input_len}")
        blocks = -(-input_len // self.block)
        if not isinstance(ctx, BlockContext) or ctx.row_length is None:
            return blocks * self.wire_per_block
        row, flat = ctx.row_length, ctx.row_length == self.block
        if input_len % row == 0 or (flat and input_len == ctx.input_length):
            if not flat:  # every row padded to whole blocks
                blocks = input_len // row * -(-row // self.block)
            return blocks * self.wire_per_block
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

        A fresh :class:`~qcomm.BlockContext` with ``row_dim`` :attr:`block`.
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

        Pads every rank's width to whole blocks, recorded in ``qcomm_ctx``.

        Args:
            input_tensor (Tensor): this rank's input.
            dim_per_rank (list[int]): every rank's width.
            my_rank (int): this rank.
            qcomm_ctx (BlockContext, optional): this call's context.
        """
        return _padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx, self.block)
