r"""
The codec contract: what a codec is, what it declares about itself, and the
per-collective pair of codecs that TorchRec sharders accept.

A codec is duck-typed exactly like TorchRec's ``QuantizedCommCodec``: any
object with the members of :class:`~qcomm.QuantizedCommCodec` can be handed to
qcomm or to TorchRec unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CodecError",
    "CodecInfo",
    "CommOp",
    "NoOpQuantizedCommCodec",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "codec_info",
]


class CodecError(Exception):
    r"""
    Raised when a codec cannot be found, loaded, built or trusted.

    The message always names the codec, plugin, distribution or argument at
    fault, and what was expected.
    """


# CommOp value -> the qcomm collective that runs it.
_COLLECTIVES = {
    "pooled_embeddings_all_to_all": "all_to_all_pooled",
    "pooled_embeddings_reduce_scatter": "reduce_scatter_pooled",
    "sequence_embeddings_all_to_all": "all_to_all_sequence",
}


class CommOp(enum.Enum):
    r"""
    The collectives of sharded embeddings that a codec pair can be attached to.

    The member names are the keys of a TorchRec ``qcomm_codecs_registry``; the
    values are their lower-case spellings, used in codec spec strings.
    """

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"

    @property
    def collective(self) -> str:
        r"""
        The name of the qcomm collective that runs this operation, e.g.
        ``"all_to_all_pooled"`` for :attr:`POOLED_EMBEDDINGS_ALL_TO_ALL`.
        """
        return _COLLECTIVES[self.value]

    @classmethod
    def parse(cls, op: CommOp | str) -> CommOp:
        r"""
        parse(op: CommOp | str) -> CommOp

        Turns a :class:`CommOp`, its name or its value (any case) into a member.

        Args:
            op (CommOp | str): the operation, e.g. ``"POOLED_EMBEDDINGS_ALL_TO_ALL"``
                or ``"pooled_embeddings_all_to_all"``.

        Returns:
            CommOp: the member.

        Raises:
            CodecError: if ``op`` names no member; the message lists them.

        Examples::

            >>> CommOp.parse("pooled_embeddings_reduce_scatter").name
            'POOLED_EMBEDDINGS_REDUCE_SCATTER'
        """
        if isinstance(op, CommOp):
            return op
        if isinstance(op, str):
            key = op.strip().upper()
            if key in cls.__members__:
                return cls[key]
        known = ", ".join(m.value for m in cls)
        raise CodecError(f"unknown CommOp {op!r}: expected one of {known}")


@dataclasses.dataclass(frozen=True)
class CodecInfo:
    r"""
    What a codec declares about itself; qcomm and its tests hold it to this.

    The declared error bound reads: for every finite input element :math:`x_i`
    whose magnitude is at most :attr:`max_abs_input`,

    .. math::

        |\hat{x}_i - x_i| \le \text{rel\_error\_bound} \cdot s_i + \text{abs\_error\_bound}

    where :math:`s_i` is :math:`|x_i|` when :attr:`error_block` is ``1``, and
    the largest magnitude of the block of :attr:`error_block` consecutive
    elements holding :math:`x_i` otherwise (``0`` means the whole tensor).

    Args:
        name (str): the codec's name, e.g. ``"int8"``.
        bits_per_element (float): wire bits per input element, metadata
            (scales, exponents) included, for long inputs.
        summable (bool, optional): whether the backend may sum wire tensors
            element-wise and the sum decodes to the sum of inputs (true for
            plain float casts, false for scaled formats). Default: ``False``.
        stateful (bool, optional): whether the codec keeps state across calls.
            Default: ``False``.
        stochastic (bool, optional): whether encoding the same input twice may
            give different wire bytes. Default: ``False``.
        devices (tuple[str, ...], optional): device types the codec runs on.
            Default: ``("cpu", "cuda")``.
        rel_error_bound (float, optional): relative part of the error bound.
            Default: ``math.inf`` (nothing promised).
        abs_error_bound (float, optional): absolute part of the error bound,
            e.g. for values that underflow. Default: ``0.0``.
        error_block (int, optional): elements sharing one scale; see above.
            Default: ``1``.
        max_abs_input (float, optional): inputs larger in magnitude are
            saturated and the bound does not hold for them. Default: ``math.inf``.
    """

    name: str
    bits_per_element: float
    summable: bool = False
    stateful: bool = False
    stochastic: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda")
    rel_error_bound: float = math.inf
    abs_error_bound: float = 0.0
    error_block: int = 1
    max_abs_input: float = math.inf


@runtime_checkable
class QuantizedCommCodec(Protocol):
    r"""
    The codec contract, identical in shape to TorchRec's ``QuantizedCommCodec``.

    ``encode`` turns a 1-D float tensor into a 1-D wire tensor of
    :attr:`quantized_dtype`; ``decode`` turns it back. ``ctx`` is per-call state
    from :meth:`create_context`; both must also accept ``ctx=None``. The context
    never travels: anything the receiver needs (scales, exponents) is in-band.
    A codec may also carry an ``info`` attribute (:class:`CodecInfo`).
    """

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Encodes a 1-D float tensor into a 1-D wire tensor.

        Args:
            input_tensor (Tensor): the values to send.
            ctx (Any, optional): per-call context. Default: ``None``.

        Returns:
            Tensor: the wire tensor, of :attr:`quantized_dtype`.
        """
        ...

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Decodes a wire tensor back into floats.

        Args:
            input_grad (Tensor): the wire tensor received (TorchRec's name).
            ctx (Any, optional): per-call context. Default: ``None``.

        Returns:
            Tensor: the decoded float tensor.
        """
        ...

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The dtype of the wire tensors :meth:`encode` returns.
        """
        ...

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Number of wire elements for ``input_len`` input elements.

        Args:
            input_len (int): number of input elements.
            ctx (Any, optional): per-call context. Default: ``None``.

        Returns:
            int: equals ``encode(x).numel()`` for any ``x`` of that length.
        """
        ...

    def create_context(self) -> Any | None:
        r"""
        create_context() -> Any | None

        Returns fresh per-call state, or ``None`` for a stateless codec.
        """
        ...

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: Any,
    ) -> tuple[int, int]:
        r"""
        padded_size(input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]

        Column padding a block codec needs for a 2-D pooled input.

        Args:
            input_tensor (Tensor): the 2-D input ``[batch, dim_sum]``.
            dim_per_rank (list[int]): embedding dim sum of every rank.
            my_rank (int): this rank.
            qcomm_ctx (Any): the call's context; block codecs record every
                rank's padded width in ``qcomm_ctx.padded_dim_sum_per_rank``.

        Returns:
            tuple[int, int]: ``(padded_dim_sum, padding_size)`` for this rank.
        """
        ...


class NoOpQuantizedCommCodec:
    r"""
    The codec that changes nothing: float32 travels as is.

    Used wherever no codec is configured. Unlike TorchRec's own no-op codec,
    :attr:`quantized_dtype` is a property.

    Args:
        dtype (torch.dtype, optional): the wire dtype reported. Default:
            ``torch.float32``.

    Examples::

        >>> import torch
        >>> codec = NoOpQuantizedCommCodec()
        >>> x = torch.arange(4.0)
        >>> codec.decode(codec.encode(x)).equal(x)
        True
        >>> codec.calc_quantized_size(10)
        10
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self._dtype = dtype
        self.info = CodecInfo(
            name="noop",
            bits_per_element=float(torch.finfo(dtype).bits),
            summable=True,
            rel_error_bound=0.0,
        )

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Returns ``input_tensor`` itself.

        Args:
            input_tensor (Tensor): the values to send.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: ``input_tensor``.
        """
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Returns ``input_grad`` itself.

        Args:
            input_grad (Tensor): the wire tensor received.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: ``input_grad``.
        """
        return input_grad

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any | None = None) -> None

        Copies ``input_grad`` into ``out`` (the optional member of the
        contract, see :doc:`codecs`).

        Args:
            input_grad (Tensor): the wire tensor received.
            out (Tensor): where its values go: as many elements, any layout.
            ctx (Any, optional): ignored. Default: ``None``.

        Raises:
            ValueError: if ``out`` does not have as many elements.
        """
        if out.numel() != input_grad.numel():
            raise ValueError(
                f"out: expected {input_grad.numel()} elements (the wire's), got {out.numel()}"
            )
        out.copy_(input_grad.view(out.shape))

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype, ``torch.float32`` unless set otherwise.
        """
        return self._dtype

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Returns ``input_len``: one wire element per input element.

        Args:
            input_len (int): number of input elements.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            int: ``input_len``.
        """
        return input_len

    def create_context(self) -> None:
        r"""
        create_context() -> None

        The no-op codec keeps no per-call state.
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

        No padding: returns this rank's width and ``0``.

        Args:
            input_tensor (Tensor): the 2-D input ``[batch, dim_sum]``.
            dim_per_rank (list[int]): embedding dim sum of every rank.
            my_rank (int): this rank.
            qcomm_ctx (Any): ignored.

        Returns:
            tuple[int, int]: ``(dim_per_rank[my_rank], 0)``.
        """
        return dim_per_rank[my_rank], 0

    def __repr__(self) -> str:
        return "NoOpQuantizedCommCodec()"


@dataclasses.dataclass
class QuantizedCommCodecs:
    r"""
    The codec pair of one collective: ``forward`` encodes the collective's
    output direction, ``backward`` the gradients sent back.

    The same shape as TorchRec's ``QuantizedCommCodecs``: a dict of these keyed
    by :class:`CommOp` name is a valid ``qcomm_codecs_registry``.

    Args:
        forward (QuantizedCommCodec, optional): codec of the forward pass.
            Default: a :class:`NoOpQuantizedCommCodec`.
        backward (QuantizedCommCodec, optional): codec of the backward pass.
            Default: a :class:`NoOpQuantizedCommCodec`.
    """

    forward: Any = dataclasses.field(default_factory=NoOpQuantizedCommCodec)
    backward: Any = dataclasses.field(default_factory=NoOpQuantizedCommCodec)


_DTYPE_BITS = {
    torch.bool: 8,
    torch.uint8: 8,
    torch.int8: 8,
    torch.int16: 16,
    torch.int32: 32,
    torch.int64: 64,
}

# The members every codec has (the contract, docs/codecs.rst).
CODEC_MEMBERS = (
    "encode",
    "decode",
    "quantized_dtype",
    "calc_quantized_size",
    "create_context",
    "padded_size",
)


def dtype_bits(dtype: torch.dtype) -> int:
    """Bits of one element of ``dtype``."""
    return _DTYPE_BITS.get(dtype) or torch.finfo(dtype).bits


def contract_problem(value: Any) -> str | None:
    """How ``value`` breaks the codec contract, or ``None`` if it follows it."""
    kind = type(value).__name__
    if value is None:
        return "None"
    if isinstance(value, type):
        return (
            f"the class {value.__name__}, not a codec object (build one, e.g. {value.__name__}())"
        )
    try:
        missing = [m for m in CODEC_MEMBERS if not hasattr(value, m)]
        if missing:
            return f"{kind}, which lacks codec member(s) {', '.join(missing)}"
        methods = [m for m in CODEC_MEMBERS if m != "quantized_dtype"]
        not_callable = [m for m in methods if not callable(getattr(value, m))]
        dtype = read_quantized_dtype(value)
    except Exception as err:
        return f"{kind}, whose codec members raise when read: {type(err).__name__}: {err}"
    if not_callable:
        return f"{kind}, whose {', '.join(not_callable)} are not methods"
    if not isinstance(dtype, torch.dtype):
        return f"{kind}, whose quantized_dtype is {dtype!r}, not a torch.dtype"
    return None


def read_quantized_dtype(codec: Any) -> Any:
    r"""
    read_quantized_dtype(codec: Any) -> Any

    The codec's ``quantized_dtype``, read as a property or, as TorchRec's own
    no-op codec has it, called as a method. What comes back is not checked:
    callers decide what a value that is not a ``torch.dtype`` means.

    Args:
        codec (Any): any object following the codec contract.

    Returns:
        Any: the wire dtype, or ``None`` when the codec has no such member.

    Examples::

        >>> read_quantized_dtype(NoOpQuantizedCommCodec(torch.float16))
        torch.float16
    """
    dtype = getattr(codec, "quantized_dtype", None)
    if callable(dtype) and not isinstance(dtype, torch.dtype):
        dtype = dtype()
    return dtype


def codec_info(codec: Any) -> CodecInfo:
    r"""
    codec_info(codec: Any) -> CodecInfo

    The codec's :class:`CodecInfo`, or conservative defaults for a foreign codec
    without one: not summable, stateful, no error bound promised, and the wire
    dtype's width as bits per element.

    Args:
        codec (Any): any object following the codec contract.

    Returns:
        CodecInfo: what the codec declares, or what may safely be assumed.

    Examples::

        >>> codec_info(NoOpQuantizedCommCodec()).summable
        True
    """
    info = getattr(codec, "info", None)
    if isinstance(info, CodecInfo):
        return info
    dtype = read_quantized_dtype(codec)
    if isinstance(dtype, torch.dtype):
        bits = dtype_bits(dtype)
    else:
        bits = 32
    return CodecInfo(name=type(codec).__name__, bits_per_element=float(bits), stateful=True)
