r"""
How the ranks of ``qcomm bench`` agree on whether a step failed: each rank
tries it, the outcomes meet over the control group, and a failure anywhere
is a failure everywhere, reported cause first. A codec that raises is a
failed row, and the run goes on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from qcomm.benchmark.candidates import Candidate
from qcomm.benchmark.session import Session
from qcomm.types import codec_info

__all__ = ["Outcome", "agree_on_loads", "agreed", "agreed_here", "attempt", "failure"]

#: every rank's value, or ``None`` and why the step failed
Outcome = tuple[list[Any] | None, str | None]

_ECHO = re.compile(r"timed out|\brank \d+ failed", re.IGNORECASE)


def failure(gathered: list[tuple[bool, Any]]) -> str | None:
    r"""
    failure(gathered: list[tuple[bool, Any]]) -> str | None

    Why a step failed, from every rank's :func:`attempt`; ``None`` if it did
    not. A rank that fails makes its peers time out in the collective, or
    raise naming it: the cause comes first, its echoes after it.

    Args:
        gathered (list[tuple[bool, Any]]): per rank, whether it succeeded, and
            its value or message.

    Examples::

        >>> failure([(False, "rank 1 failed"), (False, "ValueError: bad")])
        'rank 1: ValueError: bad; rank 0: rank 1 failed'
    """
    messages = [(rank, str(msg)) for rank, (ok, msg) in enumerate(gathered) if not ok]
    if not messages:
        return None
    if len({msg for _, msg in messages}) == 1 and len(messages) == len(gathered):
        return messages[0][1]
    messages.sort(key=lambda item: bool(_ECHO.search(item[1])))
    return "; ".join(f"rank {rank}: {msg}" for rank, msg in messages)


def attempt(fn: Callable[[], Any]) -> tuple[bool, Any]:
    r"""
    attempt(fn: Callable[[], Any]) -> tuple[bool, Any]

    ``(True, fn())``, or ``(False, "Type: message")`` if it raised.

    Args:
        fn (Callable[[], Any]): the step.
    """
    try:
        return True, fn()
    except Exception as err:  # reported as a failed row; the run goes on
        return False, f"{type(err).__name__}: {err}"


def agreed(session: Session, fn: Callable[[], Any]) -> Outcome:
    r"""
    agreed(session: Session, fn: Callable[[], Any]) -> Outcome

    Runs a step on every rank: every rank's value, or why it failed somewhere.

    Args:
        session (Session): this rank's groups.
        fn (Callable[[], Any]): the step; its value crosses the control group.
    """
    gathered = session.gather(attempt(fn))
    problem = failure(gathered)
    return (None, problem) if problem else ([value for _, value in gathered], None)


def agreed_here(session: Session, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    r"""
    agreed_here(session: Session, fn: Callable[[], Any]) -> tuple[Any, str | None]

    Like :func:`agreed`, for a value only this rank needs (a function, say):
    this rank's value, or ``None`` and why the step failed somewhere.

    Args:
        session (Session): this rank's groups.
        fn (Callable[[], Any]): the step.
    """
    ok, value = attempt(fn)
    problem = failure(session.gather((ok, None if ok else value)))
    return (None, problem) if problem else (value, None)


def agree_on_loads(session: Session, candidates: list[Candidate]) -> None:
    r"""
    agree_on_loads(session: Session, candidates: list[Candidate]) -> None

    Leaves out, on every rank, a codec that failed to build on any rank or
    does not run on this run's device, with why.

    Args:
        session (Session): this rank's device and groups.
        candidates (list[Candidate]): the codecs, updated in place.

    Raises:
        RuntimeError: if the ranks loaded different lists of codecs.
    """
    for candidate in candidates:
        for codec in candidate.codecs():  # both pairs of codecs by host
            devices = codec_info(codec).devices
            if session.device.type not in devices:
                name = codec_info(codec).name
                candidate.codec = None
                candidate.error = (
                    f"the codec {name} runs on {', '.join(devices)} (CodecInfo.devices), "
                    f"this run is on {session.device.type}"
                )
                break
    gathered = session.gather([c.error for c in candidates])
    if len({len(errors) for errors in gathered}) != 1:
        raise RuntimeError(f"ranks disagree on the codecs to measure: {gathered}")
    for i, candidate in enumerate(candidates):
        errors = [(rank, errors[i]) for rank, errors in enumerate(gathered) if errors[i]]
        if errors and candidate.codec is not None:
            candidate.codec = None
            candidate.error = "; ".join(f"rank {rank}: {msg}" for rank, msg in errors)
