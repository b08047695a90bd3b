r"""
Lazy access to fbgemm-gpu's operators, which are optional: importing them
costs a second and may fail (an ABI mismatch with torch), so codecs ask on
first use and fall back to torch code. ``QCOMM_DISABLE_FBGEMM=1`` forces the
fallback, e.g. to compare both paths. The CPU-only build (``fbgemm-gpu-cpu``)
registers the same operators without CUDA kernels: :func:`cuda_op` tells them
apart.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["DISABLE_ENV", "cuda_op", "fbgemm_ops"]

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


@functools.cache
def _has_cuda_kernel(name: str) -> bool:
    # A lookup in the dispatcher's table, on the host: no device work.
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{name}", "CUDA")
    except RuntimeError:  # an fbgemm-gpu too old or too new to have the operator
        return False


def cuda_op(name: str, tensor: torch.Tensor) -> Any | None:
    r"""
    cuda_op(name: str, tensor: Tensor) -> Any | None

    fbgemm-gpu's operator ``torch.ops.fbgemm.<name>`` when ``tensor`` is on a
    CUDA device and the operator has a CUDA kernel there (the ``fbgemm-gpu``
    build, not ``fbgemm-gpu-cpu``); else ``None``, as :func:`fbgemm_ops` would be.

    Args:
        name (str): the operator's name, e.g. ``"Fused8BitRowwiseQuantizedToFloat"``.
        tensor (Tensor): the tensor the operator would run on.

    Examples::

        >>> cuda_op("Fused8BitRowwiseQuantizedToFloat", torch.zeros(1, 12, dtype=torch.uint8))
    """
    if tensor.device.type != "cuda":
        return None
    ops = fbgemm_ops()
    if ops is None or not _has_cuda_kernel(name):
        return None
    return getattr(ops, name)
