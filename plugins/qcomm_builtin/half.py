r"""
The 16-bit float codecs ``fp16`` and ``bf16``: a cast clamped to the format's
finite range, optionally with a loss scale; summable. The bytes equal those of
fbgemm-gpu's codec of ``SparseType.FP16`` / ``SparseType.BF16``.
"""

from __future__ import annotations

import math
import numbers

import torch

from qcomm import CodecInfo, ElementwiseCodec
from qcomm.collectives._buffers import empty
from qcomm.types import dtype_bits
from qcomm_builtin._native import error_norms, round_trip_error

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
            bits_per_element=float(dtype_bits(self._dtype)),
            summable=True,
            rel_error_bound=rel,
            abs_error_bound=abs_,
            max_abs_input=max_abs,
        )

    @property
    def loss_scale(self) -> float | None:
        """The factor applied before encoding and removed after decoding."""
        return self._loss_scale

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype."""
        return self._dtype

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        # fbgemm computes (scale * x).clamp(-max, max).to(dtype). Casting first
        # and clamping the 16-bit result gives the same bytes: what rounds past
        # the largest finite value becomes +-inf, which the clamp turns back into
        # it, like values clamped before the cast; NaN stays NaN either way. It
        # saves a float32 temporary and two of fbgemm's three passes over it.
        # The cast writes a buffer backed by huge pages (faulting a large
        # one in 4 KiB pages costs more than the cast); copy_ rounds as .to does.
        scaled = flat if self._loss_scale is None else flat * self._loss_scale
        out = empty(tuple(flat.shape), self._dtype, flat.device).copy_(scaled)
        return out.clamp_(-self._max, self._max)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        out = empty(tuple(wire.shape), torch.float32, wire.device).copy_(wire)
        return out if self._loss_scale is None else out.div_(self._loss_scale)

    def dequantize_into(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        # Widen straight into `out`, then divide in place, in float32 as
        # dequantize does; across devices, dequantize's result is copied.
        if out.device != wire.device:
            super().dequantize_into(wire, out)
            return
        out.copy_(wire.view(out.shape))
        if self._loss_scale is not None:
            out.div_(self._loss_scale)

    def round_trip_error(self, input_tensor: torch.Tensor) -> tuple[float, float] | None:
        r"""
        round_trip_error(input_tensor: Tensor) -> tuple[float, float] | None

        The relative RMS and largest errors of ``decode(encode(input_tensor))``,
        from the C kernels (see :doc:`codecs`), in one pass without a loss
        scale; ``None`` off the CPU or without them.
        """
        if self._loss_scale is None:  # the whole round trip in one kernel call
            return round_trip_error(self._name, input_tensor, 1, False)
        if input_tensor.device.type != "cpu" or input_tensor.dtype != torch.float32:
            return None
        return error_norms(input_tensor, self.dequantize(self.quantize(input_tensor)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self._loss_scale!r})"


class FP16Codec(_HalfCodec):
    r"""
    The ``fp16`` codec: float32 travels as IEEE float16.

    Error bound: :math:`|\hat{x} - x| \le 2^{-11}|x| + 2^{-25}` for
    :math:`|x| \le 65504`; with a loss scale :math:`s`,
    :math:`(2^{-11} + 2^{-21})|x| + 2^{-24}/s` for
    :math:`|x| \le \min(65504 / s, 2^{127})`. NaN stays NaN; larger values and
    :math:`\pm\infty` **saturate** to :math:`\pm 65504`, as in fbgemm.

    Args:
        loss_scale (float, optional): multiply by this before encoding and divide
            after decoding (to lift small gradients out of the subnormals); a
            normal float32 value. Default: ``None``.

    Examples::

        >>> codec = FP16Codec()
        >>> codec.decode(codec.encode(torch.tensor([1.0, -2.5, 1e6, float("nan")]))).tolist()
        [1.0, -2.5, 65504.0, nan]
    """

    _name = "fp16"
    _dtype = torch.float16
    _unit_roundoff = 2.0**-11
    _half_min_subnormal = 2.0**-25


class BF16Codec(_HalfCodec):
    r"""
    The ``bf16`` codec: float32 travels as bfloat16.

    Error bound: :math:`|\hat{x} - x| \le 2^{-8}|x| + 2^{-134}` for
    :math:`|x| \le 3.3895 \cdot 10^{38}`; with a loss scale :math:`s`,
    :math:`(2^{-8} + 2^{-21})|x| + 2^{-133}/s` for
    :math:`|x| \le \min(\max / s, 2^{127})`. NaN stays NaN; :math:`\pm\infty`
    **saturates**, as in fbgemm.

    Args:
        loss_scale (float, optional): as for :class:`FP16Codec`. Default: ``None``.

    Examples::

        >>> codec = BF16Codec()
        >>> codec.decode(codec.encode(torch.tensor([1.0, 3.0, 257.0]))).tolist()
        [1.0, 3.0, 256.0]
    """

    _name = "bf16"
    _dtype = torch.bfloat16
    _unit_roundoff = 2.0**-8
    _half_min_subnormal = 2.0**-134
