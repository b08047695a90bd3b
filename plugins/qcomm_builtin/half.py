r"""
The 16-bit float codecs ``fp16`` and ``bf16``: a clamped cast, optionally
with a loss scale. Their wire is summable (the backend may add wire tensors).

The wire bytes equal fbgemm-gpu's ``QuantizedCommCodec`` of ``SparseType.FP16``
/ ``SparseType.BF16`` (clamp to the format's finite range, then round to
nearest even) for the same input and loss scale. The clamp runs on the
16-bit result instead of on a float32 copy, which is what makes fbgemm's path
slower than a plain cast.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from qcomm import CodecInfo
from qcomm_builtin._blocks import ElementwiseCodec, check_wire, flatten_input
from qcomm_builtin._native import check_out, copy_into

__all__ = ["BF16Codec", "FP16Codec"]


# The loss scale multiplies and divides in float32: it must be a normal
# float32, else it rounds to inf or 0 (1.0 came back as 0.0, 0.0 as NaN) or
# loses the precision the error bound assumes.
_SCALE_MIN = 2.0**-126
_SCALE_MAX = float(torch.finfo(torch.float32).max)


def _check_loss_scale(loss_scale: object) -> float | None:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
        raise TypeError(
            f"loss_scale must be a positive finite float or None, got {type(loss_scale).__name__} {loss_scale!r}"
        )
    try:
        value = float(loss_scale)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if math.isnan(value) or value <= 0:
        raise ValueError(f"loss_scale must be a positive finite float or None, got {loss_scale!r}")
    if not _SCALE_MIN <= value <= _SCALE_MAX:
        raise ValueError(
            f"loss_scale must be a normal float32 value, between 2**-126 and {_SCALE_MAX:.8g} "
            f"(it is applied in float32), got {loss_scale!r}"
        )
    return value


def _clamped_cast(
    flat: torch.Tensor, dtype: torch.dtype, bound: float, scale: float | None
) -> torch.Tensor:
    # fbgemm computes (scale * x).clamp(-max, max).to(dtype). Casting first
    # and clamping the 16-bit result gives the same bytes: what rounds past
    # the largest finite value becomes +-inf, which the clamp turns back into
    # it, like values clamped before the cast; NaN stays NaN either way. It
    # saves a float32 temporary and two of fbgemm's three passes over it.
    scaled = flat if scale is None else flat * scale
    return scaled.to(dtype).clamp_(-bound, bound)


class _HalfCodec(ElementwiseCodec):
    # Shared body of FP16Codec and BF16Codec; they differ only in the format.
    _name: str
    _dtype: torch.dtype
    _unit_roundoff: float  # 2 ** -(mantissa bits + 1)
    _half_min_subnormal: float  # largest rounding error below the normal range

    def __init__(self, loss_scale: float | None = None) -> None:
        self._loss_scale = _check_loss_scale(loss_scale)
        self._max = float(torch.finfo(self._dtype).max)
        scale = self._loss_scale
        if scale is None or scale == 1.0:
            rel, abs_, max_abs = self._unit_roundoff, self._half_min_subnormal, self._max
        else:
            # Scaling and unscaling in float32 add at most three float32
            # roundings (2 ** -24 each) to the relative error.
            rel = self._unit_roundoff + 2.0**-21
            abs_ = 2.0 * self._half_min_subnormal / scale
            # Above 2**127, a value rounded up on the wire could decode past
            # float32's largest value (a scale below 1 widens the range).
            max_abs = min(self._max / scale, 2.0**127)
        self.info = CodecInfo(
            name=self._name,
            bits_per_element=float(torch.finfo(self._dtype).bits),
            summable=True,
            rel_error_bound=rel,
            abs_error_bound=abs_,
            error_block=1,
            max_abs_input=max_abs,
        )

    @property
    def loss_scale(self) -> float | None:
        r"""
        loss_scale() -> float | None

        The factor applied before encoding and removed after decoding.
        """
        return self._loss_scale

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The wire dtype.
        """
        return self._dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        encode(input_tensor: Tensor, ctx: Any | None = None) -> Tensor

        Scales (if a loss scale is set), clamps to the format's finite range
        and rounds to nearest even.

        Args:
            input_tensor (Tensor): floating-point values, any shape.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: wire tensor of :attr:`quantized_dtype` and the input's
            shape (1-D in, 1-D out). Keeping the shape matters to TorchRec,
            whose reduce-scatter reads the wire's second dimension.

        Raises:
            TypeError: if ``input_tensor`` is not a floating-point tensor.
        """
        flat = flatten_input(input_tensor, self._name)
        return _clamped_cast(flat, self._dtype, self._max, self._loss_scale).view(
            input_tensor.shape
        )

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        r"""
        decode(input_grad: Tensor, ctx: Any | None = None) -> Tensor

        Widens the wire to float32 and divides by the loss scale.

        Args:
            input_grad (Tensor): wire tensor of :attr:`quantized_dtype`.
            ctx (Any, optional): ignored. Default: ``None``.

        Returns:
            Tensor: float32 tensor of the wire's shape (TorchRec's backward
            all-gather expects the gradient's shape back).

        Raises:
            ValueError: if ``input_grad`` does not have :attr:`quantized_dtype`.
        """
        wire = check_wire(input_grad, self._dtype, 1, self._name)
        out = wire.float()
        if self._loss_scale is not None:
            out.div_(self._loss_scale)
        return out.view(input_grad.shape)

    def decode_into(
        self, input_grad: torch.Tensor, out: torch.Tensor, ctx: Any | None = None
    ) -> None:
        r"""
        decode_into(input_grad: Tensor, out: Tensor, ctx: Any | None = None) -> None

        Writes what :meth:`decode` returns into ``out``, in row-major order: a
        widening copy straight into ``out``, then the division by the loss
        scale in place, in float32 as :meth:`decode` does it.

        Args:
            input_grad (Tensor): wire tensor of :attr:`quantized_dtype`.
            out (Tensor): float32, as many elements as ``input_grad``, any
                shape and strides.
            ctx (Any, optional): ignored. Default: ``None``.

        Raises:
            ValueError: if ``input_grad`` does not have :attr:`quantized_dtype`,
                or ``out`` is not a float32 tensor of that many elements.
        """
        wire = check_wire(input_grad, self._dtype, 1, self._name)
        check_out(out, wire.numel(), self._name)
        if out.device != wire.device:
            # decode's division runs on the wire's device; keep its result.
            copy_into(out, self.decode(wire, ctx))
            return
        out.copy_(wire.view(out.shape))
        if self._loss_scale is not None:
            out.div_(self._loss_scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self._loss_scale!r})"


class FP16Codec(_HalfCodec):
    r"""
    The ``fp16`` codec: float32 travels as IEEE float16, clamped to its range.

    Wire: one ``torch.float16`` per input element, equal byte for byte to
    fbgemm-gpu's ``SparseType.FP16`` codec. Summable.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`):
    :math:`|\hat{x} - x| \le 2^{-11}|x| + 2^{-25}`
    for :math:`|x| \le 65504` (round to nearest even; the absolute part covers
    float16's subnormals). With a loss scale :math:`s`, both parts are
    widened for the float32 scaling: :math:`(2^{-11} + 2^{-21})|x| + 2^{-24}/s`
    for :math:`|x| \le \min(65504 / s, 2^{127})`.

    Non-finite input: NaN stays NaN. Finite values beyond the range and
    :math:`\pm\infty` **saturate** to :math:`\pm 65504` (as in fbgemm), so an
    overflow is not visible after decoding.

    Args:
        loss_scale (float, optional): multiply by this before encoding and
            divide after decoding, to move small values (gradients) out of
            float16's subnormal range. Must be a normal float32 value
            (:math:`2^{-126}` to :math:`3.4 \cdot 10^{38}`).
            Default: ``None`` (no scaling).

    Raises:
        TypeError: if ``loss_scale`` is not a real number.
        ValueError: if ``loss_scale`` is not a positive normal float32 value.

    Examples::

        >>> import torch
        >>> codec = FP16Codec()
        >>> wire = codec.encode(torch.tensor([1.0, -2.5, 1e6, float("nan")]))
        >>> wire.dtype
        torch.float16
        >>> codec.decode(wire).tolist()
        [1.0, -2.5, 65504.0, nan]
        >>> FP16Codec(loss_scale=1024.0).decode(FP16Codec(loss_scale=1024.0).encode(torch.tensor([1e-6]))).item() != 0
        True
    """

    _name = "fp16"
    _dtype = torch.float16
    _unit_roundoff = 2.0**-11
    _half_min_subnormal = 2.0**-25


class BF16Codec(_HalfCodec):
    r"""
    The ``bf16`` codec: float32 travels as bfloat16, clamped to its range.

    Wire: one ``torch.bfloat16`` per input element, equal byte for byte to
    fbgemm-gpu's ``SparseType.BF16`` codec. Summable.

    Error bound (``info``, a :class:`~qcomm.CodecInfo`):
    :math:`|\hat{x} - x| \le 2^{-8}|x| + 2^{-134}`
    for :math:`|x| \le 3.3895 \cdot 10^{38}` (bfloat16's largest finite
    value). With a loss scale :math:`s`:
    :math:`(2^{-8} + 2^{-21})|x| + 2^{-133}/s` for
    :math:`|x| \le \min(\max / s, 2^{127})`.

    Non-finite input: NaN stays NaN. :math:`\pm\infty`, and the few finite
    float32 values above bfloat16's largest, **saturate** to
    :math:`\pm 3.3895 \cdot 10^{38}` (as in fbgemm).

    Args:
        loss_scale (float, optional): multiply by this before encoding and
            divide after decoding. Must be a normal float32 value
            (:math:`2^{-126}` to :math:`3.4 \cdot 10^{38}`).
            Default: ``None`` (no scaling).

    Raises:
        TypeError: if ``loss_scale`` is not a real number.
        ValueError: if ``loss_scale`` is not a positive normal float32 value.

    Examples::

        >>> import torch
        >>> codec = BF16Codec()
        >>> wire = codec.encode(torch.tensor([1.0, 3.0, 257.0]))
        >>> wire.dtype
        torch.bfloat16
        >>> codec.decode(wire).tolist()
        [1.0, 3.0, 256.0]
        >>> codec.calc_quantized_size(10)
        10
    """

    _name = "bf16"
    _dtype = torch.bfloat16
    _unit_roundoff = 2.0**-8
    _half_min_subnormal = 2.0**-134
