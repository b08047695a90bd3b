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

Calls never waited for are finished here too (:func:`drop`), and the process
exits only once the thread is idle (:func:`close`, at exit): a thread left
inside a gloo wait while the interpreter finalizes is killed when the wait
returns, and that kill aborts the process ("terminate called without an
active exception").
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from qcomm import _events, config

__all__ = ["close", "drop", "exit_timeout", "later"]

T = TypeVar("T")

_jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()
# Set at exit: the thread is stopped for good and work runs where it is given.
_closed = False


class _Job(Generic[T]):
    def __init__(self, work: Callable[[], T]) -> None:
        self.work: Callable[[], Any] = work
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as err:  # noqa: BLE001 - raised again by join()
            self.error = err
        finally:
            self.work = _nothing  # drops what the call held
            _events.emit("background_completed")
            self.done.set()

    def join(self) -> T:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


def _run() -> None:
    while (job := _jobs.get()) is not None:
        job.run()
        # Nothing of the call (its error included) stays with the thread.
        del job


def _nothing() -> None:
    pass


def later(work: Callable[[], T]) -> Callable[[], T]:
    """
    Starts ``work`` in the background; returns what waits for it (returns
    its result, raises its error).
    """
    global _thread
    job = _Job(work)
    with _lock:
        here = _closed
        # A forked child has the thread object but not the thread.
        if not here and (_thread is None or not _thread.is_alive()):
            thread = threading.Thread(target=_run, name="qcomm-completion", daemon=True)
            try:
                thread.start()
                _thread = thread
            except RuntimeError:
                # Python 3.12 and later start no thread in an exit hook.
                here = True
        if not here:
            _jobs.put(job)
    if here:
        # Exit has begun: the work is done now, where it is given.
        job.run()
    return job.join


def drop(finish: Callable[[], object]) -> None:
    """
    Finishes a call that will never be waited for, in the background: its
    messages complete (its peers wait for them) and its buffers come back;
    its result and its error are dropped. Nothing once exit has begun.
    """
    if _closed:
        return
    _events.emit("background_dropped")
    later(finish)


def exit_timeout() -> float:
    """
    Seconds the process waits at exit for its calls in flight: the settings'
    ``exit_timeout`` (``QCOMM_EXIT_TIMEOUT``, or 10); a variable that is no
    number of seconds is warned of, and 10 is used.
    """
    try:
        seconds: float = config._read("exit_timeout")[0]
    except ValueError as err:
        # Raised at exit it would only be printed, and nothing waited for.
        warnings.warn(
            f"{err}; waiting {config.Settings.exit_timeout:g} s for the calls in flight",
            stacklevel=2,
        )
        return config.Settings.exit_timeout
    return seconds


def close(timeout: float) -> bool:
    """
    Lets the thread finish every call given to it, for up to ``timeout``
    seconds, then stops it; returns whether it stopped. Work given after this
    runs where it is given.
    """
    global _closed
    with _lock:
        _closed = True
        thread = _thread
    if thread is None or not thread.is_alive():
        return True
    _jobs.put(None)
    thread.join(timeout)
    return not thread.is_alive()
