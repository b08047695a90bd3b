r"""
The ``fp8_e4m3_tensor`` codec: TorchRec's default FP8 communication (its
``CommType.FP8`` without ``fp8_quantize_dim``), an unscaled cast to fbgemm's
"HFP8" 1-4-3 format with exponent bias 15, clamped to its largest value.

It keeps one byte per element and the tensor's shape, so unlike the row-wise
``fp8_e4m3`` it can also carry TorchRec's reduce-scatter backward, which
all-gathers the gradient's wire into a buffer of the gradient's shape.

fbgemm's 1-4-3 values are the OCP ``float8_e4m3fn`` bit patterns scaled by
:math:`2^{-8}`, and fbgemm never writes the top exponent field (it clamps to
:math:`0.9375 = 240 \cdot 2^{-8}` first), so a torch cast gives its bytes
exactly (tested bit for bit against ``fp32_to_hfp8_with_clamp``); fbgemm's
CPU kernel, which takes 2-D input only, is not needed.
"""

from __future__ import annotations

from typing import Any

import torch

from qcomm import CodecInfo
from qcomm_builtin._blocks import ElementwiseCodec, check_wire, flatten_input
from qcomm_builtin._native import check_out, copy_into

__all__ = ["MAX_POS", "FP8E4M3TensorCodec"]

#: The largest value of fbgemm's 1-4-3 format with bias 15, where larger inputs saturate.
MAX_POS = 0.9375
_SHIFT = 2.0**8  # fbgemm's value * _SHIFT is the float8_e4m3fn value, bit for bit


class FP8E4M3TensorCodec(ElementwiseCodec):
    r"""
    The ``fp8_e4m3_tensor`` codec: float32 travels as one unscaled FP8 byte
    per element, fbgemm's 1-4-3 format with exponent bias 15, exactly as
    TorchRec's default FP8 comm sends it.

    Wire: one ``uint8`` per input element, in the input's shape, equal byte
    for byte to fbgemm's ``fp32_to_hfp8_with_clamp(x, 4, 3, 15)``: ``x``
    clamped to :math:`\pm 0.9375` and rounded to nearest even, with gradual
    underflow below :math:`2^{-14}` (steps of :math:`2^{-17}`). Not summable:
    adding two such bytes does not give the bytes of the sum.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`):
    :math:`|\hat{x} - x| \le 2^{-4}|x| + 2^{-18}` for :math:`|x| \le 0.9375`
    (half a step of 3 mantissa bits; half the subnormal step). There is no
    scale: larger values **saturate** to :math:`\pm 0.9375`, so the codec
    suits values known to be small (TorchRec's choice for its default FP8).

    Non-finite input: NaN stays NaN: it is sent as code ``0x7F`` (``0xFF``
    with its sign), which fbgemm never writes and its decoder reads as
    1.875; fbgemm's encoder would send 0.9375. :math:`\pm\infty`
    **saturates** to :math:`\pm 0.9375`, as in fbgemm.

    Examples::

        >>> import torch
        >>> codec = FP8E4M3TensorCodec()
        >>> wire = codec.encode(torch.tensor([[0.5, -0.3], [2.0, float("nan")]]))
        >>> wire.dtype, wire.shape
        (torch.uint8, torch.Size([2, 2]))
        >>> codec.decode(wire).tolist()
        [[0.5, -0.3125], [0.9375, nan]]
    """

    def __init__(self) -> None:
        self.info = CodecInfo(
            name="fp8_e4m3_tensor",
            bits_per_element=8.0,
            summable=False,
            rel_error_bound=2.0**-4,
            abs_error_bound=2.0**-18,
            error_block=1,
            max_abs_input=MAX_POS,
        )

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype, ``torch.uint8`` (gloo carries no float8 dtype).
        """
        return torch.uint8

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Clamps to :math:`\pm 0.9375` and rounds every element to the 1-4-3
        format.

        Args:
            input_tensor (Tensor): floating-point values, any shape; computed
                in float32.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: ``uint8`` wire of the input's shape.

        Raises:
            TypeError: if ``input_tensor`` is not a floating-point tensor.
        """
        flat = flatten_input(input_tensor, self.info.name)
        # Clamping first keeps every product within float8_e4m3fn's finite
        # range, and multiplying by a power of two is exact: one rounding, the
        # cast's, to nearest even like fbgemm's. NaN passes the clamp.
        scaled = flat.clamp(-MAX_POS, MAX_POS).mul_(_SHIFT)
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8).view(input_tensor.shape)

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Widens every byte to float32 (exactly).

        Args:
            input_grad (Tensor): ``uint8`` wire.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: float32 tensor of the wire's shape.

        Raises:
            ValueError: if ``input_grad`` is not a ``uint8`` tensor.
        """
        wire = check_wire(input_grad, torch.uint8, 1, self.info.name)
        values = wire.view(torch.float8_e4m3fn).to(torch.float32).mul_(1.0 / _SHIFT)
        return values.view(input_grad.shape)

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any | None = None) -> None

        Writes what :meth:`decode` returns into ``out``, in row-major order.

        Args:
            input_grad (Tensor): ``uint8`` wire.
            out (Tensor): float32, as many elements as ``input_grad``, any
                shape and strides.
            ctx (Any, optional): ignored. Default: ``None``.

        Raises:
            ValueError: if ``input_grad`` is not a ``uint8`` tensor, or ``out``
                is not a float32 tensor of that many elements.
        """
        wire = check_wire(input_grad, torch.uint8, 1, self.info.name)
        check_out(out, wire.numel(), self.info.name)
        copy_into(out, self.decode(wire).to(out.device))

    def __repr__(self) -> str:
        return "FP8E4M3TensorCodec()"
