r"""
Lazy access to fbgemm-gpu's operators.

fbgemm-gpu is optional: importing it costs about a second and it may be
missing or fail to load (ABI mismatch with torch). Codecs ask for it on their
first call and fall back to their own torch code when it is absent. Setting
the environment variable ``QCOMM_DISABLE_FBGEMM=1`` forces that fallback,
e.g. to compare both paths or to rule fbgemm out while debugging.
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

    The ``torch.ops.fbgemm`` namespace with fbgemm-gpu's operators loaded, or
    ``None`` when fbgemm-gpu is missing, fails to import, or is disabled by
    ``QCOMM_DISABLE_FBGEMM``.

    Returns:
        Any | None: the operator namespace, or ``None``.

    Examples::

        >>> ops = fbgemm_ops()
        >>> ops is None or hasattr(ops, "FloatToFused8BitRowwiseQuantized")
        True
    """
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _load()
