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

__all__ = ["DISABLE_ENV", "kernels", "lines_of"]

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


def lines_of(out: torch.Tensor, block: int) -> tuple[int, int] | None:
    r"""
    lines_of(out: Tensor, block: int) -> tuple[int, int] | None

    ``(width, stride)`` when a kernel can write ``out`` row-major as lines of
    ``width`` floats ``stride`` apart, each whole blocks; else ``None``.
    """
    if out.device.type != "cpu" or out.requires_grad:
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
