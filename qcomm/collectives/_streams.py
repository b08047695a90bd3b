"""
CUDA stream order of a call, as ``torch.distributed``'s async ops keep it: a
call is issued on the caller's current stream; :meth:`~qcomm.Awaitable.wait`
may run on another, which then waits on the call (an event, not the host),
and memory made on the issuing stream but used on the waiting one is
recorded there so that the caching allocator does not hand it out early.
On any other device these are no-ops.
"""

from __future__ import annotations

from typing import Any

import torch

Mark = tuple[Any, Any] | None


def issued(device: torch.device) -> Mark:
    """Marks the end of what the current stream was given for the call (CUDA), else ``None``."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return stream, event


def join(mark: Mark) -> None:
    """Makes the current stream wait for the marked work, where it is another stream."""
    if mark is None:
        return
    stream, event = mark
    current = torch.cuda.current_stream(stream.device)
    if current != stream:
        current.wait_event(event)


def keep(mark: Mark, *tensors: torch.Tensor) -> None:
    """Records ``tensors`` (made on the issuing stream) on the current one, where it is another."""
    if mark is None:
        return
    current = torch.cuda.current_stream(mark[0].device)
    if current != mark[0]:
        for tensor in tensors:
            tensor.record_stream(current)


def use_here(tensor: torch.Tensor) -> None:
    """Records a CUDA ``tensor`` on the current stream (it was made on another, or by NCCL)."""
    if tensor.device.type == "cuda":
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
