r"""
Child processes (``qcomm check``'s workers, ``qcomm bench``'s ranks) that end
with the command, however it ends: SIGTERM and SIGHUP raised like Ctrl-C
(:func:`stop_on_signals`), the shell's exit status of a stopped command
(:func:`exit_status`), and children that end with their parent
(:func:`end_with_parent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["PARENT_ENV", "Stopped", "describe", "end_with_parent", "exit_status", "stop_on_signals"]

#: the pid of the command that spawned a bench rank, for :func:`end_with_parent`
PARENT_ENV = "QCOMM_PARENT_PID"

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Stopped(KeyboardInterrupt):
    r"""
    SIGTERM or SIGHUP, raised like Ctrl-C's ``KeyboardInterrupt`` so that the
    same cleanup runs.

    Args:
        signum (int): the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def exit_status(err: KeyboardInterrupt) -> int:
    r"""
    exit_status(err: KeyboardInterrupt) -> int

    The shell's status of a command ended by ``err``: 128 plus the signal's number.

    Args:
        err (KeyboardInterrupt): Ctrl-C's, or a :class:`Stopped`.
    """
    return 128 + int(err.signum if isinstance(err, Stopped) else signal.SIGINT)


def describe(err: KeyboardInterrupt) -> str:
    r"""
    describe(err: KeyboardInterrupt) -> str

    ``"interrupted"`` for Ctrl-C, ``"stopped by SIGTERM"`` for a signal.

    Args:
        err (KeyboardInterrupt): Ctrl-C's, or a :class:`Stopped`.
    """
    if isinstance(err, Stopped):
        return f"stopped by {signal.Signals(err.signum).name}"
    return "interrupted"


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    # A second signal must not cut the cleanup short: the children's death
    # signal covers the case where the command is killed outright.
    for other in _STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    r"""
    stop_on_signals() -> ContextManager[None]

    Turns SIGTERM and SIGHUP into :class:`Stopped` for the block (in the main
    thread only; a signal ignored on purpose, as under ``nohup``, stays ignored).
    """
    old: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _STOP_SIGNALS:
            # A signal ignored on purpose (nohup) stays ignored.
            if signal.getsignal(signum) is not signal.SIG_IGN:
                old[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def _death_signal() -> bool:
    """Asks Linux to SIGKILL this process when its parent ends; whether it agreed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def end_with_parent(parent: int) -> None:
    r"""
    end_with_parent(parent: int) -> None

    Makes this process end when ``parent``, the process that started it, does.

    Args:
        parent (int): the parent's pid.
    """
    # On Linux the kernel kills it at once, even inside native code that never
    # returns to Python; elsewhere a thread polls the parent twice a second.
    if _death_signal():
        if os.getppid() != parent:  # gone before the death signal was set
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
