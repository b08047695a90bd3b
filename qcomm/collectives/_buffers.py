r"""
Receive buffers kept for reuse between calls, on CPU.

A collective receives into a buffer that it usually decodes or copies out of
at once. On CPU every fresh allocation of a few MiB or more is a new memory
mapping whose pages fault in on first touch, which costs as much as moving the
data over loopback; reusing the buffers of earlier calls avoids that. CUDA
has PyTorch's caching allocator, so only CPU buffers are kept. At most
:data:`KEEP` buffers are kept, the oldest dropped first.
"""

from __future__ import annotations

import threading

import torch

KEEP = 4
# Below this, malloc's own free lists serve the allocation without faults.
MIN_BYTES = 1 << 20

_free: list[torch.Tensor] = []
_lock = threading.Lock()


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    r"""
    take(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor

    A 1-D buffer of ``numel`` elements: a kept one that fits, else a new one.

    Args:
        numel (int): elements needed.
        dtype (torch.dtype): their dtype.
        device (torch.device): their device.

    Returns:
        Tensor: uninitialised, contiguous, owned by the caller until
        :func:`give` hands it back.
    """
    if device.type == "cpu" and numel * dtype.itemsize >= MIN_BYTES:
        with _lock:
            # Best fit, and never more than twice the need, so that one huge
            # buffer does not serve (and pin) every small call.
            fits = [
                i
                for i, b in enumerate(_free)
                if b.dtype == dtype and b.device == device and numel <= b.numel() <= 2 * numel
            ]
            if fits:
                # By index: list.remove would compare tensors element-wise.
                best = _free.pop(min(fits, key=lambda i: _free[i].numel()))
                return best[:numel]
    return torch.empty(numel, dtype=dtype, device=device)


def give(buffer: torch.Tensor, keep: torch.Tensor) -> None:
    r"""
    give(buffer: Tensor, keep: Tensor) -> None

    Hands ``buffer`` back for reuse, unless it shares memory with ``keep``.

    Args:
        buffer (Tensor): a buffer the caller no longer uses (from :func:`take`,
            or any tensor the caller allocated).
        keep (Tensor): what lives on: the caller's result or its user's input,
            which may be (a view of) ``buffer``.
    """
    base = buffer if buffer._base is None else buffer._base
    if base.device.type != "cpu" or base.numel() * base.element_size() < MIN_BYTES:
        return
    if keep.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
        return
    with _lock:
        _free.append(base)
        del _free[:-KEEP]
