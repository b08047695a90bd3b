r"""
Lazy access to fbgemm-gpu's operators, which are optional: importing them
costs a second and may fail (an ABI mismatch with torch), so codecs ask on
first use and fall back to torch code. ``QCOMM_DISABLE_FBGEMM=1`` forces the
fallback, e.g. to compare both paths.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["DISABLE_ENV", "fbgemm_ops"]

DISABLE_ENV = "QCOMM_DISABLE_FBGEMM"


@functools.cache
def _load() -> Any | None:
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)

        return torch.ops.fbgemm
    except Exception:  # a broken install is as good as none: use the fallback
        return None


def fbgemm_ops() -> Any | None:
    r"""
    fbgemm_ops() -> Any | None

    ``torch.ops.fbgemm`` with fbgemm-gpu's operators loaded, or ``None`` when it
    is missing, fails to import, or is disabled.

    Examples::

        >>> ops = fbgemm_ops()
        >>> ops is None or hasattr(ops, "FloatToFused8BitRowwiseQuantized")
        True
    """
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _load()
