r"""
Lazy access to the optional C kernels (``qcomm_builtin._kernels``), and the
output checks and layouts of ``decode_into``.

The kernels are built with the package where a C compiler works; where they
are missing the codecs run their torch code, which gives the same bits.
Setting the environment variable ``QCOMM_DISABLE_KERNELS=1`` forces the torch
code, e.g. to compare both paths or to rule the kernels out while debugging.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

__all__ = ["DISABLE_ENV", "check_out", "copy_into", "kernels", "lines_of"]

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

    The ``qcomm_builtin._kernels`` extension module, or ``None`` when it was
    not built, fails to load, or is disabled by ``QCOMM_DISABLE_KERNELS``.

    Returns:
        ModuleType | None: the module, or ``None``.

    Examples::

        >>> k = kernels()
        >>> k is None or hasattr(k, "int8_encode")
        True
    """
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _load()


def check_out(out: object, numel: int, codec: str) -> torch.Tensor:
    r"""
    check_out(out: object, numel: int, codec: str) -> Tensor

    Checks the ``out`` argument of ``decode_into``.

    Args:
        out (object): what the caller passed.
        numel (int): the number of elements ``decode`` would return.
        codec (str): the codec's name, used in the error message.

    Returns:
        Tensor: ``out``.

    Raises:
        ValueError: if ``out`` is not a float32 tensor of ``numel`` elements.
    """
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


def lines_of(out: torch.Tensor, block: int) -> tuple[int, int] | None:
    r"""
    lines_of(out: Tensor, block: int) -> tuple[int, int] | None

    How a kernel can write ``out`` in row-major order directly: as lines of
    ``width`` contiguous floats, ``stride`` floats apart, each line whole
    blocks. ``None`` when it cannot (wrong device, a layout that is not such
    lines, a line width that splits blocks, autograd watching ``out``).

    Args:
        out (Tensor): a float32 tensor, not empty.
        block (int): elements per block.

    Returns:
        tuple[int, int] | None: ``(width, stride)`` in elements, or ``None``.
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


def copy_into(out: torch.Tensor, values: torch.Tensor) -> None:
    r"""
    copy_into(out: Tensor, values: Tensor) -> None

    Copies the 1-D ``values`` into ``out`` in row-major order.

    Args:
        out (Tensor): the destination, any shape and strides.
        values (Tensor): as many elements as ``out``.
    """
    out.copy_(values.view(out.shape))
