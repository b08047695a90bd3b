"""
The background side of qcomm's DDP hook: one thread per process group that
all-reduces the buckets handed to it in the order DDP hands them over, so
that the hook returns at once and the backward pass goes on computing while
buckets travel (docs/ddp.rst, "Overlap").

The worker talks on a process group of its own, made once from the DDP
group's ranks: the training thread keeps calling collectives on DDP's group
during the backward pass (TorchRec's embedding all-to-alls), and calls from
two threads on one group would reach the peers in an order no rank controls.
On CUDA the worker runs on a side stream that first waits for the gradients
(an event recorded on the hook's stream); the bucket's future then holds
events on that stream, so DDP's wait orders its own stream after them.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Worker", "worker_for"]

Work = Callable[[dist.ProcessGroup], torch.Tensor]

_workers: weakref.WeakKeyDictionary[dist.ProcessGroup, Worker] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Worker:
    """A thread that runs submitted work on ``group`` in submission order."""

    def __init__(self, group: dist.ProcessGroup, name: str) -> None:
        self.group = group
        #: work items finished (reduced or failed), for tests and diagnostics
        self.done = 0
        self._queue: queue.SimpleQueue[tuple[Work, torch.futures.Future[Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[torch.device, Any] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Work, device: torch.device) -> torch.futures.Future[torch.Tensor]:
        """Queues ``work``; the future completes with its result or its error."""
        future: torch.futures.Future[torch.Tensor]
        ready = None
        if device.type == "cuda":
            future = torch.futures.Future(devices=[device])
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(device))
        else:
            future = torch.futures.Future()
        self._queue.put((work, future, (device, ready)))
        return future

    def stop(self) -> None:
        """Ends the thread once the work queued before is done."""
        self._queue.put(None)

    def close(self, timeout: float) -> None:
        """Stops the thread, waits for it up to ``timeout`` seconds, and lets go of the group."""
        self.stop()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.group = None  # type: ignore[assignment]

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, future, (device, ready) = item
            try:
                if ready is None:
                    result = work(self.group)
                else:
                    stream = self._stream(device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        result = work(self.group)
                        result.record_stream(stream)
                        # Inside the side stream: the future records its
                        # events here, and whoever waits on it waits for them.
                        future.set_result(result)
                if ready is None:
                    future.set_result(result)
            except BaseException as err:  # noqa: BLE001 - it belongs to the future's waiter
                future.set_exception(err)
            finally:
                self.done += 1

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


def _timeout(group: dist.ProcessGroup) -> timedelta | None:
    # The DDP group's own timeout, so that a silent peer is given up on as
    # soon as it would be there (the default is far longer).
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend, or no options to read
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def worker_for(group: dist.ProcessGroup | None) -> Worker:
    """The worker of ``group`` (``None``: the default group), started on first use."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    with _lock:
        worker = _workers.get(group)
        if worker is None:
            # Every member reaches its first hook call, so each makes the
            # group here; local synchronisation needs only the members.
            own = dist.new_group(
                ranks=dist.get_process_group_ranks(group),
                backend=dist.get_backend(group),
                timeout=_timeout(group),
                use_local_synchronization=True,
            )
            worker = Worker(own, f"qcomm-ddp-{dist.get_rank(group)}")
            if not _workers:
                atexit.register(_close_all)
            _workers[group] = worker
            weakref.finalize(group, worker.stop).atexit = False
    return worker


def _close_all() -> None:
    # At exit, while the interpreter still runs: a worker thread left to die
    # with it would drop its process group during the interpreter's teardown,
    # and gloo aborts the process there.
    for worker in list(_workers.values()):
        worker.close(timeout=5.0)
