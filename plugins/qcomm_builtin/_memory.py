r"""
Large CPU buffers that fault in huge pages: a fresh 64 MiB tensor is faulted
in page by page on its first write, and with 4 KiB pages that costs more than
a cast or a decoding that writes it. Where Linux keeps transparent huge pages
for those who ask ("madvise" mode), asking cuts the faults 512-fold.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["empty"]

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # Linux's value


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    r"""
    empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor

    ``torch.empty``, with the kernel advised to back a CPU buffer of 8 MiB or
    more with huge pages. Advice only: where it is refused or unknown,
    nothing changes.

    Examples::

        >>> empty((3,), torch.float32, torch.device("cpu")).shape
        torch.Size([3])
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    size = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and size >= 4 * _HUGE_PAGE else None
    if madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + size) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, stop - start, _MADV_HUGEPAGE)
    return out
