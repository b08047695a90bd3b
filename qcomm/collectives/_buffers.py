"""
Memory of the collectives on CPU, reused from call to call.

On CPU a fresh allocation of a few MiB or more is a new mapping whose pages
fault in (zeroed by the kernel) on first touch, which costs as much as
moving the data over a 10 Gbit/s link. So receive buffers are kept
(:func:`take`, :func:`give`), and outputs and gradients are made from kept
memory that comes back when the user frees them (:func:`lease`). CUDA has
PyTorch's caching allocator: nothing is kept there.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import math
import sys
import threading
import weakref
from collections.abc import Callable

import torch

# Buffers kept per pool. Calls of several sizes take turns in a step (a
# forward and a backward pass, each sharding's collectives): with 4 kept, two
# 64 MiB calls alternating on an emulated 1 Gbit/s link evicted each other's
# buffers, and the fresh ones' first-touch faults (with huge pages, the
# kernel's compaction) stalled 2 calls in 5 by 0.2-0.6 s; with 8 none did.
KEEP = 8
# Below this, malloc's own free lists serve the allocation without faults.
MIN_BYTES = 1 << 20

_free: list[torch.Tensor] = []
_lock = threading.Lock()


# Smaller receive and send buffers (from FRESH_BYTES up) are kept too, apart:
# in a virtual machine a page fault costs microseconds, and even a fresh
# buffer of some 64 KiB can fault in every call (measured: tens of
# microseconds per 64 KiB call).
_free_small: list[torch.Tensor] = []
KEEP_SMALL = 8
# Below this, a fresh buffer costs a third of a kept one (keeping takes a
# lock and a search; malloc serves these from its free lists, measured at
# 2 us against 7 us per 8 KiB call on loopback): a small call's wires and
# receives are never kept.
FRESH_BYTES = 1 << 16


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D uninitialised buffer of ``numel`` elements, kept or new, until :func:`give`."""
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and nbytes >= FRESH_BYTES:
        with _lock:
            best = _pick(_free if nbytes >= MIN_BYTES else _free_small, nbytes)
        if best is not None:
            return best[:nbytes].view(dtype)
    return empty((numel,), dtype, device)


def give(buffer: torch.Tensor) -> None:
    """Hands a buffer from :func:`take` (or a view of it) back; the caller keeps no view of it."""
    base = buffer if buffer._base is None else buffer._base
    nbytes = base.numel() * base.element_size()
    if base.device.type != "cpu" or nbytes < FRESH_BYTES:
        return
    with _lock:
        if nbytes >= MIN_BYTES:
            _free.append(base.view(torch.uint8))
            del _free[:-KEEP]
        else:
            _free_small.append(base.view(torch.uint8))
            del _free_small[:-KEEP_SMALL]


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
    """
    A new tensor, on CPU asked to live on transparent huge pages ("madvise"
    mode), which cuts its first-touch page faults 512-fold; advice only.
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    size = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and size >= 4 * _HUGE_PAGE else None
    if madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + size) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, stop - start, _MADV_HUGEPAGE)
    return out


# Outputs out with the user, by lease number, and memory back from them.
_leases: dict[int, torch.Tensor] = {}
_idle: list[torch.Tensor] = []
_numbers = itertools.count()


def _pick(pool: list[torch.Tensor], nbytes: int) -> torch.Tensor | None:
    # Best fit, never more than twice the need, so that one huge block does
    # not serve (and pin) every small call.
    fits = [i for i, b in enumerate(pool) if nbytes <= b.numel() <= 2 * nbytes]
    return pool.pop(min(fits, key=lambda i: pool[i].numel())) if fits else None


# Leases whose tensor died while the lock was held: the garbage collector
# may run a finalizer inside lease() itself, on the thread holding the lock,
# so a finalizer never waits for it (deque appends need no lock).
_back: collections.deque[int] = collections.deque()


def _returned(number: int) -> None:
    _back.append(number)
    if _lock.acquire(blocking=False):
        try:
            _settle()
        finally:
            _lock.release()


def _settle() -> None:
    """Takes the memory of returned leases back (the caller holds the lock)."""
    while _back:
        _idle.append(_leases.pop(_back.popleft()))
    del _idle[:-KEEP]


def lease(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """
    A new uninitialised tensor for an output or gradient, on CPU made from kept memory.

    The tensor owns its storage (it is not a view, and cannot be resized, like a
    tensor from :func:`torch.frombuffer`); the storage holds a small object
    whose death hands the memory back, however the user holds the tensor.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        _settle()
        block = _pick(_idle, nbytes)
    if block is None:
        block = empty((nbytes,), torch.uint8, device)
    holder = (ctypes.c_char * nbytes).from_address(block.data_ptr())
    number = next(_numbers)
    with _lock:
        _leases[number] = block
    weakref.finalize(holder, _returned, number)
    storage = torch.frombuffer(holder, dtype=torch.uint8).untyped_storage()
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)
