r"""
What each call's codec did: the errors every rank measured, the bytes it
saved, and where an :class:`~qcomm.AdaptiveCodec` switched (see
:doc:`adaptive`). Every codec object keeps the record of its own calls;
:func:`error_history` reads those of a registry, a pair, a codec or a hook's
state.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["HISTORY_LENGTH", "CallLog", "CallRecord", "error_history", "log_of"]

#: Calls each codec keeps (the oldest go first).
HISTORY_LENGTH = 10_000

_order = itertools.count()


class CallRecord(NamedTuple):
    r"""
    One call of one codec, as this rank saw it once the call finished.

    Args:
        collective (str): the collective and pass, e.g. ``"all_to_all_pooled forward"``.
        number (int): the call's number on its group (alike on every rank).
        codec (str): the name of the codec the call used.
        errors (tuple[float, ...]): by rank, the relative RMS error of what
            that rank encoded (NaN: it encoded nothing, or did not measure).
        max_errors (tuple[float, ...]): by rank, the largest error relative
            to the largest value.
        wire_bytes (int): bytes this rank sent its peers, encoded.
        data_bytes (int): the same data's bytes unencoded.
        candidates (tuple[float, ...]): an adaptive codec's candidates'
            largest errors over the ranks, measured on the same sample; else ``()``.
        switched_to (str, optional): the candidate the next call uses, where
            this call changed it. Default: ``None``.
        order (int): the record's place among all records of this process.
    """

    collective: str
    number: int
    codec: str
    errors: tuple[float, ...]
    max_errors: tuple[float, ...]
    wire_bytes: int
    data_bytes: int
    candidates: tuple[float, ...] = ()
    switched_to: str | None = None
    order: int = 0

    @property
    def worst(self) -> float:
        r"""
        worst() -> float

        The largest relative RMS error over the ranks (NaN where none measured).
        """
        measured = [e for e in self.errors if not math.isnan(e)]
        return max(measured) if measured else math.nan


class CallLog:
    r"""
    The records of one codec's calls, at most :data:`HISTORY_LENGTH`, oldest
    first; safe to use from several threads.

    Examples::

        >>> log = CallLog()
        >>> log.records()
        []
    """

    def __init__(self) -> None:
        self._records: deque[CallRecord] = deque(maxlen=HISTORY_LENGTH)
        self._lock = threading.Lock()

    def add(self, record: CallRecord) -> None:
        r"""
        add(record: CallRecord) -> None

        Keeps ``record``, numbered in the order of this process's records.

        Args:
            record (CallRecord): one call.
        """
        with self._lock:
            self._records.append(record._replace(order=next(_order)))

    def records(self) -> list[CallRecord]:
        r"""
        records() -> list[CallRecord]

        The records kept.

        Returns:
            list[CallRecord]: oldest first.
        """
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        r"""
        clear() -> None

        Forgets every record.
        """
        with self._lock:
            self._records.clear()


# The log of every plain codec (an adaptive codec keeps its own), by object.
_logs: weakref.WeakKeyDictionary[Any, CallLog] = weakref.WeakKeyDictionary()
_logs_lock = threading.Lock()


def log_of(codec: Any) -> CallLog | None:
    r"""
    log_of(codec: Any) -> CallLog | None

    The log of ``codec``'s calls, made on first use.

    Args:
        codec (Any): a codec (an adaptive codec's own log is its ``log``).

    Returns:
        CallLog | None: its log, or ``None`` where it cannot be weakly referenced.
    """
    own = getattr(codec, "log", None)
    if isinstance(own, CallLog):
        return own
    with _logs_lock:
        try:
            log = _logs.get(codec)
            if log is None:
                log = _logs[codec] = CallLog()
        except TypeError:
            return None
    return log


def error_history(source: Any) -> list[CallRecord]:
    r"""
    error_history(source: Any) -> list[CallRecord]

    The records of every call made with the codecs of ``source``, in the
    order they finished on this rank.

    Args:
        source (Any): a registry (as :func:`~qcomm.build_registry` makes), a
            :class:`~qcomm.QuantizedCommCodecs` or :class:`~qcomm.HostCodecs`,
            a codec, a :class:`~qcomm.DDPCommHookState` or a
            :class:`~qcomm.FSDPCommState`.

    Returns:
        list[CallRecord]: oldest first.

    Examples::

        >>> import qcomm
        >>> qcomm.error_history(qcomm.build_registry(forward="int8"))
        []
    """
    seen: set[int] = set()
    records: list[CallRecord] = []
    for codec in _codecs(source, 0):
        if id(codec) in seen:
            continue
        seen.add(id(codec))
        with _logs_lock:
            try:
                log = getattr(codec, "log", None) or _logs.get(codec)
            except TypeError:
                log = None
        if isinstance(log, CallLog):
            records += log.records()
    return sorted(records, key=lambda r: r.order)


# Where a hook's state or a pair keeps its codecs.
_HOLDERS = (
    "forward",
    "backward",
    "same_host",
    "other_host",
    "reduce_codec",
    "gather_codec",
    "by_host",
    "gradients",
    "weights",
)


def _codecs(source: Any, depth: int) -> list[Any]:
    """Every codec object reachable from ``source`` through the holders above."""
    if source is None or depth > 4:
        return []
    if isinstance(source, Mapping):
        return [c for value in source.values() for c in _codecs(value, depth + 1)]
    held = [getattr(source, name, None) for name in _HOLDERS if hasattr(source, name)]
    held = [h for h in held if h is not None and h is not source]
    if not held or hasattr(source, "encode"):
        return [source]
    return [c for h in held for c in _codecs(h, depth + 1)]
