"""
The start of every collective call and of its backward: the group, this rank
and the call's transport, opened before anything can fail so that the ranks
count their calls alike. A failure before the call's headers go out is told
to the peers (where the transport sends headers, else by the agreement
check), which raise naming this rank instead of waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._agreement import Agreement, safe_mode
from qcomm.collectives._args import resolve_group
from qcomm.collectives._transport import Transport, open_transport


@dataclass
class Call:
    """One collective call (or backward pass) on this rank."""

    name: str
    group: dist.ProcessGroup
    rank: int
    world: int
    transport: Transport

    def agreement(self, collective: str, input: Any) -> Agreement:
        """The agreement check of this call (see :class:`Agreement`)."""
        return Agreement(collective, self.group, self.rank, self.world, input, self.transport)


def _device(input: Any) -> torch.device:
    """Where the call's wire lives: the input's device, or the CPU if it has none."""
    if isinstance(input, torch.Tensor) and input.device.type != "meta":
        return input.device
    return torch.device("cpu")


@contextmanager
def begin(name: str, group: Any, input: Any, collective: str | None = None) -> Iterator[Call]:
    """
    Opens a call (``collective``: where the peers may check agreement on it);
    an exception in the ``with`` block is told to every peer, then goes on.
    """
    try:
        pg, rank, world = resolve_group(group)
    except TypeError as err:
        _tell_default_group(name, err, collective)
        raise
    # Headers where every call is checked (QCOMM_VERIFY=1, alike on all ranks).
    checked = safe_mode() == "always"
    call = Call(name, pg, rank, world, open_transport(pg, rank, _device(input), checked))
    try:
        yield call
    except Exception as err:
        peers = [p for p in range(world) if p != rank]
        call.transport.fail(name, err, peers)
        raise


def _tell_default_group(name: str, error: BaseException, collective: str | None) -> None:
    """Tells the default group's ranks that this rank's call has no valid group."""
    if not dist.is_initialized():
        return
    pg, rank, world = resolve_group(None)
    transport = open_transport(pg, rank, torch.device("cpu"), safe_mode() == "always")
    if collective is not None:
        # Where the peers check agreement on this call, meet them there.
        try:
            with Agreement(collective, pg, rank, world, None, transport):
                raise error
        except BaseException:
            pass
    transport.fail(name, error, [p for p in range(world) if p != rank])
