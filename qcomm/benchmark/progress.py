r"""
What a run of ``qcomm bench`` shows while it goes: a progress bar on rank 0
(tqdm, where installed) and every rank's heartbeat for the watchdog.
"""

from __future__ import annotations

import sys
from typing import Any

from qcomm.benchmark.session import Session

__all__ = ["Progress", "begin"]


class Progress:
    r"""
    A bar of ``total`` steps on stderr; without tqdm, or not ``enabled``, none.

    Args:
        enabled (bool): whether this rank shows it (rank 0).
        total (int): the steps of the run.
    """

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc="qcomm bench", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def step(self, label: str) -> None:
        r"""
        step(label: str) -> None

        Names the step under way.

        Args:
            label (str): its name.
        """
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)

    def done(self) -> None:
        r"""
        done() -> None

        Counts a step done.
        """
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        r"""
        close() -> None

        Ends the bar.
        """
        if self._bar is not None:
            self._bar.close()


def begin(session: Session, progress: Progress, label: str) -> None:
    r"""
    begin(session: Session, progress: Progress, label: str) -> None

    Starts a step: the watchdog's heartbeat and the bar both name it.

    Args:
        session (Session): this rank's session.
        progress (Progress): the bar.
        label (str): the step's name.
    """
    session.beat(label)
    progress.step(label)
