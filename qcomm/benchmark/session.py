r"""
One rank's part of a ``qcomm bench`` run (:class:`Session`: its device and
process groups), the run's exit codes, and the environment through which a
launcher or :func:`~qcomm.benchmark.launch.spawn_local` starts a rank.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time
from typing import Any

import torch
import torch.distributed as dist

from qcomm.benchmark.options import BenchConfig
from qcomm.config import VARIABLES, launch_env

__all__ = [
    "CONFIG_ENV",
    "EXIT_CODEC_FAILED",
    "EXIT_ERROR",
    "HEARTBEAT_ENV",
    "LINK_CONTROL_ENV",
    "RANKS_PER_HOST_ENV",
    "Session",
    "launcher_env",
]

#: exit status of a rank whose run could not complete (it crashed or hung)
EXIT_ERROR = 2
#: exit status of a run that completed, but where a qcomm codec failed somewhere
EXIT_CODEC_FAILED = 3

#: the run's :class:`~qcomm.benchmark.options.BenchConfig` as JSON, for spawned ranks
CONFIG_ENV = "QCOMM_BENCH_CONFIG"
#: the file a spawned rank writes its current step to, for the watchdog
HEARTBEAT_ENV = "QCOMM_BENCH_HEARTBEAT"
#: the file rank 0 writes to ask the local launcher to lift or restore the
#: emulated link's rate limit; the launcher removes it once done
LINK_CONTROL_ENV = "QCOMM_BENCH_LINK_CONTROL"

#: how many ranks share a host (ranks numbered host by host), which qcomm's
#: collectives read on every call with codecs by host (:class:`~qcomm.HostCodecs`)
RANKS_PER_HOST_ENV = VARIABLES["ranks_per_host"]

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def launcher_env() -> bool:
    r"""
    launcher_env() -> bool

    Whether a launcher such as ``torchrun`` started this process as one rank
    (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` all set).
    """
    return all(launch_env(name) for name in _LAUNCHER_VARS)


class Session:
    r"""
    This rank's device and process groups.

    Collectives are measured on :attr:`work`; the ranks agree on what
    happened over :attr:`control`, a gloo group with a longer timeout, so
    that a rank that gave up on a collective can still tell the others.

    Args:
        config (BenchConfig): the run's settings (its ``timeout``).
        local (bool): spawned by :func:`~qcomm.benchmark.launch.spawn_local`:
            always gloo on the CPU.
    """

    def __init__(self, config: BenchConfig, local: bool) -> None:
        #: spawned by spawn_local (the link is loopback or emulated), not a launcher
        self.local = local
        self.rank = int(launch_env("RANK") or 0)
        self.world_size = int(launch_env("WORLD_SIZE") or 1)
        if not local and torch.cuda.is_available():
            self.backend = "nccl"
            self.device = torch.device("cuda", int(launch_env("LOCAL_RANK") or 0))
            torch.cuda.set_device(self.device)
        else:
            self.backend = "gloo"
            self.device = torch.device("cpu")
        self._timeout = datetime.timedelta(seconds=config.timeout)
        self._heartbeat = launch_env(HEARTBEAT_ENV)
        self._link_control = launch_env(LINK_CONTROL_ENV)
        #: whether this run's link is emulated, so that :meth:`set_shaping` works
        self.link_control = self._link_control is not None
        long_timeout = 3 * self._timeout
        dist.init_process_group(
            self.backend, rank=self.rank, world_size=self.world_size, timeout=long_timeout
        )
        #: gloo group for the ranks' bookkeeping, with a long timeout
        self.control: Any = dist.new_group(backend="gloo", timeout=long_timeout)
        #: group the measured collectives run on; renewed after a failure
        self.work: Any = None
        self.renew_work()

    def gather(self, obj: Any) -> list[Any]:
        r"""
        gather(obj: Any) -> list[Any]

        Every rank's ``obj``, in rank order, on every rank (over :attr:`control`).

        Args:
            obj (Any): picklable.
        """
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def renew_work(self) -> None:
        r"""
        renew_work() -> None

        Replaces :attr:`work`, whose ranks may be out of step after a failed
        collective, by a fresh group; every rank must call it.
        """
        self.work = dist.new_group(backend=self.backend, timeout=self._timeout)
        # NCCL connects on a group's first collective: do it here, not in the
        # warm-up call that sizes the first measurement.
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.work)

    def beat(self, step: str) -> None:
        r"""
        beat(step: str) -> None

        Tells the local launcher's watchdog that this rank is alive.

        Args:
            step (str): where the rank is.
        """
        if self._heartbeat:
            pathlib.Path(self._heartbeat).write_text(step)

    def set_shaping(self, on: bool) -> None:
        r"""
        set_shaping(on: bool) -> None

        Lifts or restores the emulated link's rate limit; every rank must
        call it. Rank 0 asks the launcher and waits for it (``RuntimeError``
        if it does not answer within the timeout).

        Args:
            on (bool): ``False`` lifts the limit.
        """
        if self._link_control is None:
            raise RuntimeError("set_shaping: this run has no emulated link")
        if self.rank == 0:
            request = pathlib.Path(self._link_control)
            ready = request.with_suffix(".new")
            ready.write_text("on" if on else "off")
            os.replace(ready, request)  # the launcher never reads half a request
            deadline = time.monotonic() + self._timeout.total_seconds()
            while request.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the launcher did not change the link's shaping")
                time.sleep(0.05)
        self.gather(None)

    def close(self) -> None:
        r"""
        close() -> None

        Tears the process groups down.
        """
        dist.destroy_process_group()
