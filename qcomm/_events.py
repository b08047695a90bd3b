"""Named events where tests count what ran (a transport opened, a call finished
in the background, a TorchRec call taken by qcomm's exchange).

Production code calls :func:`emit` at those places; it does nothing unless a
listener is registered (:func:`listen`), so the library keeps no counters
of its own. Events, by name (detail):

- ``transport_opened`` (the transport's class name): a collective's call
  opened its transport;
- ``background_completed``: a job of the background thread finished;
- ``background_dropped``: a call that will never be waited for was handed to
  the background thread;
- ``torchrec_call`` (the name of TorchRec's function): a TorchRec call ran
  on qcomm's exchange;
- ``compiled_call`` (the operator, e.g. ``all_to_all_pooled_start``): an
  operator of a compiled graph ran (:mod:`qcomm.collectives._compiled`).
- ``fsdp_call`` (``reduce_scatter``, ``all_gather`` or ``all_reduce``): a
  module's collective of :func:`~qcomm.fsdp_quantize` finished on qcomm's
  collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["emit", "listen"]

Listener = Callable[[str, str], None]

# A tuple, replaced whole under the lock: emit reads it without one, from any thread.
_listeners: tuple[Listener, ...] = ()
_lock = threading.Lock()


def emit(event: str, detail: str = "") -> None:
    """Tells every listener that ``event`` happened (``detail`` says to what)."""
    for listener in _listeners:
        listener(event, detail)


def listen(listener: Listener) -> Callable[[], None]:
    """Calls ``listener(event, detail)`` for every event emitted, from any thread,
    until the function returned is called."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)

    def stop() -> None:
        global _listeners
        with _lock:
            rest = list(_listeners)
            rest.remove(listener)
            _listeners = tuple(rest)

    return stop
