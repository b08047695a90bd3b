"""Counting what qcomm did (its events, :mod:`qcomm._events`), in a test or inside a rank.

    with counting("torchrec_call") as calls:
        ...  # TorchRec calls
    assert calls == {"alltoall_pooled": 2}

    before = counted("background_completed").total()
    ...
    assert counted("background_completed").total() == before + 1

:func:`counting` counts the calls of its block; :func:`counted`, those of the
whole process since this module was imported (a test module that imports it
is imported in a spawned rank before the rank runs anything). Both counts are
live: a test may read them while calls run (a call finished in the background
shows at once).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from qcomm import _events

__all__ = ["counted", "counting"]

_lock = threading.Lock()  # events come from the background thread too
_totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def _tally(event: str, detail: str) -> None:
    with _lock:
        _totals[event][detail] += 1


_events.listen(_tally)


def counted(event: str) -> collections.Counter[str]:
    """The times ``event`` was emitted in this process since this module was
    imported, by its detail."""
    with _lock:
        return _totals[event]


@contextlib.contextmanager
def counting(event: str) -> Iterator[collections.Counter[str]]:
    """The times ``event`` is emitted while in the block, by its detail."""
    counts: collections.Counter[str] = collections.Counter()

    def count(name: str, detail: str) -> None:
        if name == event:
            with _lock:
                counts[detail] += 1

    stop = _events.listen(count)
    try:
        yield counts
    finally:
        stop()
