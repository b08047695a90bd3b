r"""
The codec contract (:doc:`codecs`) in types: the protocol, what a codec
declares about itself, and the per-collective pair TorchRec sharders accept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import torch

# Defined where the command line can import them without torch.
from qcomm.errors import CodecError
from qcomm.ops import CommOp

__all__ = [
    "CodecError",
    "CodecInfo",
    "CommOp",
    "HostCodecs",
    "NoOpQuantizedCommCodec",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "codec_info",
]


@dataclasses.dataclass(frozen=True)
class CodecInfo:
    r"""
    What a codec declares about itself, held true by qcomm's tests and
    conformance kit; the error bound is that of :doc:`codecs`.

    Args:
        name (str): the codec's name, e.g. ``"int8"``.
        bits_per_element (float): wire bits per input element, metadata included.
        summable (bool, optional): whether the backend may sum wire tensors.
            Default: ``False``.
        stateful (bool, optional): whether it keeps state across calls.
            Default: ``False``.
        stochastic (bool, optional): whether the same input may encode to other
            bytes. Default: ``False``.
        devices (tuple[str, ...], optional): device types it runs on.
            Default: ``("cpu", "cuda")``.
        rel_error_bound (float, optional): relative part of the bound.
            Default: ``math.inf`` (nothing promised).
        abs_error_bound (float, optional): absolute part. Default: ``0.0``.
        error_block (int, optional): elements sharing a scale (``0``: the whole
            tensor). Default: ``1``.
        max_abs_input (float, optional): magnitude up to which the bound holds.
            Default: ``math.inf``.
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
    The codec contract of :doc:`codecs`, shaped exactly like TorchRec's
    ``QuantizedCommCodec``: any object with these members is a codec.
    """

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Float tensor in, wire tensor of :attr:`quantized_dtype` out.

        Args:
            input_tensor (Tensor): the float tensor.
            ctx (Any, optional): from :meth:`create_context`. Default: ``None``.
        """
        ...

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Wire tensor in, float tensor out.

        Args:
            input_grad (Tensor): the wire tensor.
            ctx (Any, optional): from :meth:`create_context`. Default: ``None``.
        """
        ...

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The dtype of the wire; a property (or a plain attribute), never called.
        """
        ...

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Wire elements for ``input_len`` input elements.

        Args:
            input_len (int): input elements.
            ctx (Any, optional): from :meth:`create_context`. Default: ``None``.
        """
        ...

    def create_context(self) -> Any | None:
        r"""
        create_context() -> Any | None

        Fresh per-call state, or ``None``.
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

        ``(padded_dim_sum, padding_size)`` of this rank's 2-D pooled input.

        Args:
            input_tensor (Tensor): this rank's input.
            dim_per_rank (list[int]): every rank's width.
            my_rank (int): this rank.
            qcomm_ctx (Any): from :meth:`create_context`; records every rank's padded width.
        """
        ...


class NoOpQuantizedCommCodec(QuantizedCommCodec):
    r"""
    The codec that changes nothing, used wherever no codec is configured:
    ``encode`` and ``decode`` return their input. Unlike TorchRec's, its
    :attr:`quantized_dtype` is a property, not a method.

    Args:
        dtype (torch.dtype, optional): the wire dtype reported.
            Default: ``torch.float32``.

    Examples::

        >>> codec = NoOpQuantizedCommCodec()
        >>> x = torch.arange(4.0)
        >>> codec.decode(codec.encode(x)).equal(x), codec.calc_quantized_size(10)
        (True, 10)
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self._dtype = dtype
        self.info = CodecInfo(
            name="noop",
            bits_per_element=float(dtype_bits(dtype)),
            summable=True,
            rel_error_bound=0.0,
        )

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype given to the constructor; a property, never called.
        """
        return self._dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Returns ``input_tensor`` itself.

        Args:
            input_tensor (Tensor): the input.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Returns ``input_grad`` itself.

        Args:
            input_grad (Tensor): the wire.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        return input_grad

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any | None = None) -> None

        Copies ``input_grad`` into ``out``, which has as many elements.

        Args:
            input_grad (Tensor): the wire.
            out (Tensor): where to write.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        if out.numel() != input_grad.numel():
            raise ValueError(
                f"out: expected {input_grad.numel()} elements (the wire's), got {out.numel()}"
            )
        out.copy_(input_grad.view(out.shape))

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        r"""
        calc_quantized_size(input_len: int, ctx: Any | None = None) -> int

        Returns ``input_len``.

        Args:
            input_len (int): input elements.
            ctx (Any, optional): ignored. Default: ``None``.
        """
        return input_len

    def create_context(self) -> None:
        r"""
        create_context() -> None

        No context: returns ``None``.
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

        No padding: ``(dim_per_rank[my_rank], 0)``.

        Args:
            input_tensor (Tensor): this rank's input.
            dim_per_rank (list[int]): every rank's width.
            my_rank (int): this rank.
            qcomm_ctx (Any): ignored.
        """
        return dim_per_rank[my_rank], 0

    def __repr__(self) -> str:
        return "NoOpQuantizedCommCodec()"


@dataclasses.dataclass
class QuantizedCommCodecs:
    r"""
    The codec pair of one collective, as TorchRec's ``QuantizedCommCodecs``:
    ``forward`` for the collective's output, ``backward`` for the gradients.

    Args:
        forward (QuantizedCommCodec, optional): Default: a
            :class:`NoOpQuantizedCommCodec`.
        backward (QuantizedCommCodec, optional): Default: a
            :class:`NoOpQuantizedCommCodec`.
    """

    forward: Any = dataclasses.field(default_factory=NoOpQuantizedCommCodec)
    backward: Any = dataclasses.field(default_factory=NoOpQuantizedCommCodec)


@dataclasses.dataclass
class HostCodecs(QuantizedCommCodecs):
    r"""
    Codecs by where the peer is: one pair for the ranks on this rank's host,
    another for the ranks on other hosts, so that only the slow link between
    hosts carries compressed data. qcomm's collectives and its DDP hook apply
    them peer by peer (see :doc:`topology`).

    ``forward`` and ``backward`` are set to the other hosts' codecs: what a
    driver that encodes the whole tensor with one codec (TorchRec's own
    collectives) applies to every peer.

    Args:
        same_host (QuantizedCommCodecs, optional): the pair between ranks of
            one host. Default: no-op codecs (the data travels as it is).
        other_host (QuantizedCommCodecs, optional): the pair between ranks of
            different hosts. Default: no-op codecs.
        ranks_per_host (int, optional): ranks ``[k * n, (k + 1) * n)`` of the
            default group share host ``k``. Default: ``None``
            (``QCOMM_RANKS_PER_HOST``, else torchrun's ``LOCAL_WORLD_SIZE``,
            else the ranks' host names).

    Examples::

        >>> from qcomm import load_codec
        >>> codecs = HostCodecs(other_host=QuantizedCommCodecs(load_codec("int8"), load_codec("bf16")))
        >>> codecs.forward is codecs.other_host.forward
        True
    """

    forward: Any = dataclasses.field(init=False, default=None)
    backward: Any = dataclasses.field(init=False, default=None)
    same_host: QuantizedCommCodecs = dataclasses.field(default_factory=QuantizedCommCodecs)
    other_host: QuantizedCommCodecs = dataclasses.field(default_factory=QuantizedCommCodecs)
    ranks_per_host: int | None = None

    def __post_init__(self) -> None:
        for name in ("same_host", "other_host"):
            pair = getattr(self, name)
            if not (hasattr(pair, "forward") and hasattr(pair, "backward")):
                raise TypeError(
                    f"{name}: expected a QuantizedCommCodecs (forward and backward codecs), "
                    f"got {type(pair).__name__}"
                )
            if isinstance(pair, HostCodecs):
                raise TypeError(f"{name}: expected a QuantizedCommCodecs, got a HostCodecs")
        n = self.ranks_per_host
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"ranks_per_host: expected None or a positive int, got {n!r}")
        self.forward = self.other_host.forward
        self.backward = self.other_host.backward


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
    r"""
    dtype_bits(dtype: torch.dtype) -> int

    Bits of one element of ``dtype``.

    Args:
        dtype (torch.dtype): the dtype.
    """
    return dtype.itemsize * 8


def contract_problem(value: Any) -> str | None:
    r"""
    contract_problem(value: Any) -> str | None

    How ``value`` breaks the codec contract, or ``None`` if it follows it.

    Args:
        value (Any): the would-be codec.
    """
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

    The codec's ``quantized_dtype``, read as a property or, as TorchRec's no-op
    codec has it, called; ``None`` when missing. The value is not checked.

    Args:
        codec (Any): the codec.

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

    The codec's :class:`CodecInfo`, or conservative defaults for a codec
    without one: not summable, stateful, no error bound, the wire dtype's bits.

    Args:
        codec (Any): the codec.

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
