r"""
Lazy access to the optional C kernels (``qcomm_builtin._kernels``), built
where a C compiler works; without them the codecs run their torch code, with
the same bits. ``QCOMM_DISABLE_KERNELS=1`` forces the torch code.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

__all__ = ["DISABLE_ENV", "error_norms", "kernel_input", "kernels", "lines_of", "round_trip_error"]

DISABLE_ENV = "QCOMM_DISABLE_KERNELS"


@functools.cache
def _load() -> ModuleType | None:
    try:
        from qcomm_builtin import _kernels  # type: ignore[attr-defined]

        return _kernels
    except ImportError:  # not built (no compiler) or not loadable
        return None


def kernels() -> ModuleType | None:
    r"""
    kernels() -> ModuleType | None

    The ``qcomm_builtin._kernels`` module, or ``None`` when it is not built,
    fails to load, or is disabled.

    Examples::

        >>> k = kernels()
        >>> k is None or hasattr(k, "int8_encode")
        True
    """
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _load()


def kernel_input(t: torch.Tensor, dtype: torch.dtype, unit: int = 1) -> torch.Tensor | None:
    r"""
    kernel_input(t: Tensor, dtype: torch.dtype, unit: int = 1) -> Tensor | None

    ``t`` as the contiguous 1-D CPU tensor a kernel reads (a copy of a strided
    view), or ``None`` where the torch code must take it: another device or
    dtype, or a length not a multiple of ``unit``. A kernel reads the memory at
    ``data_ptr()`` as packed elements of ``dtype``; anything else would make
    it read outside ``t``.
    """
    if t.device.type != "cpu" or t.dtype != dtype or t.numel() % unit:
        return None
    return t.reshape(-1).contiguous()


def lines_of(out: torch.Tensor, numel: int, block: int) -> tuple[int, int] | None:
    r"""
    lines_of(out: Tensor, numel: int, block: int) -> tuple[int, int] | None

    ``(width, stride)`` when a kernel can write ``numel`` float32 values into
    ``out`` row-major as lines of ``width`` floats ``stride`` apart, each whole
    blocks; else ``None``: ``out`` is not a float32 CPU tensor of exactly
    ``numel`` elements (the torch code then raises as it does), or not laid
    out so.
    """
    if out.device.type != "cpu" or out.requires_grad or out.dtype != torch.float32:
        return None
    if numel == 0 or out.numel() != numel:
        return None
    if out.is_contiguous():
        return out.numel(), out.numel()
    if out.dim() < 2 or out.shape[-1] % block or out.stride(-1) != 1:
        return None
    width = out.shape[-1]
    try:
        lines = out.view(-1, width)
    except RuntimeError:  # the leading dimensions do not merge into one
        return None
    if lines.shape[0] > 1 and lines.stride(0) < width:
        return None  # lines overlap: leave it to torch, which refuses
    return width, max(lines.stride(0), width)


def round_trip_error(
    codec: str, x: torch.Tensor, block: int, flag: bool, table: torch.Tensor | None = None
) -> tuple[float, float] | None:
    r"""
    round_trip_error(codec: str, x: Tensor, block: int, flag: bool, table: Tensor | None = None) -> tuple[float, float] | None

    The relative RMS and largest errors of ``x`` encoded and decoded by the
    kernels of ``codec`` (``"int8"``, ``"fp8"`` or ``"mx4"``; ``flag`` and
    ``table`` as their decoder and encoder take them; or ``"fp16"`` or
    ``"bf16"`` without a loss scale, ``block`` 1), in one call; ``None``
    where the kernels are missing, ``x`` is not a float32 CPU tensor, or a
    value is not finite (qcomm then encodes and decodes itself). ``x``: 1-D,
    or 2-D rows of whole blocks, read where they lie (rows may be apart).
    """
    k = kernels() if x.numel() and x.dim() in (1, 2) else None
    if k is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % block == 0 and x.stride(0) >= x.shape[1]:
        runs, length, stride = x.shape[0], x.shape[1], x.stride(0)
    else:  # one run: a copy where the elements are not packed
        x = x.reshape(-1).contiguous()
        runs, length, stride = 1, x.numel(), x.numel()
    address = table.data_ptr() if table is not None else 0
    result: tuple[float, float] | None = k.round_trip_error(
        codec, x.data_ptr(), runs, length, stride, block, flag, address
    )
    return result


def error_norms(x: torch.Tensor, decoded: torch.Tensor) -> tuple[float, float] | None:
    r"""
    error_norms(x: Tensor, decoded: Tensor) -> tuple[float, float] | None

    The relative RMS and largest errors of ``decoded`` against ``x`` (float32
    CPU tensors of one length), or ``None`` where the kernels are missing or a
    value is not finite.
    """
    k = kernels() if x.numel() and x.numel() == decoded.numel() else None
    src = kernel_input(x, torch.float32) if k is not None else None
    out = kernel_input(decoded, torch.float32) if src is not None else None
    if k is None or src is None or out is None:
        return None
    result: tuple[float, float] | None = k.error_norms(src.data_ptr(), out.data_ptr(), src.numel())
    return result
