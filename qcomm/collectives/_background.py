"""
The rest of a call, done in the background. Where gloo carries a call (the
point-to-point transport), its messages move in gloo's own threads once the
call is issued; what is left for ``wait()`` is waiting for each message and
decoding it into the output. A collective issued early and waited for late
(TorchRec's pipelines, a model that computes between the two) has that done
here, on one thread for the process, while the caller goes on: ``wait()``
then finds the output decoded, or waits for the rest.

One thread is enough and keeps calls in the order they were issued. It never
waits for anything the caller's thread has still to do: every send of a call
is posted before the call returns, so each message it waits for is on its
way. An error is raised again where the call is waited for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

__all__ = ["completed", "later"]

#: calls completed in the background so far (what tests count)
completed = 0

_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


class _Job:
    def __init__(self, work: Callable[[], None]) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None

    def join(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def _run() -> None:
    global completed
    while True:
        job = _jobs.get()
        try:
            job.work()
        except BaseException as err:  # noqa: BLE001 - raised again by join()
            job.error = err
        finally:
            job.work = _nothing  # drops what the call held
            completed += 1
            job.done.set()
        # Nothing of the call (its error included) stays with the thread.
        del job


def _nothing() -> None:
    pass


def later(work: Callable[[], None]) -> Callable[[], None]:
    """Starts ``work`` in the background; returns what waits for it (and raises its error)."""
    global _thread
    job = _Job(work)
    with _lock:
        # A forked child has the thread object but not the thread.
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="qcomm-completion", daemon=True)
            _thread.start()
    _jobs.put(job)
    return job.join
