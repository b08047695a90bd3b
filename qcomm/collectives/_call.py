r"""
The start of every collective call (and of its backward): the group, this
rank, and the call's transport, opened before anything can fail so that the
ranks count their calls alike. Whatever fails before the call's headers go
out is told to the peers where the transport sends headers (see
``_header``); they raise a :class:`~qcomm.CodecError` naming this rank
instead of waiting for it. (Where it does not, the first-call agreement
check, ``_verify``, tells them.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._args import resolve_group
from qcomm.collectives._transport import Transport, open_transport
from qcomm.collectives._verify import Agreement
from qcomm.types import CommOp


@dataclass
class Call:
    r"""
    One collective call on this rank.

    Args:
        name (str): the collective and pass, e.g. ``"all_to_all_pooled forward"``.
        group (ProcessGroup): the call's group.
        rank (int): this rank in ``group``.
        world (int): the size of ``group``.
        transport (Transport): the call's transport.
    """

    name: str
    group: dist.ProcessGroup
    rank: int
    world: int
    transport: Transport


def _device(input: Any) -> torch.device:
    """Where the call's wire lives: the input's device, or the CPU if it has none."""
    if isinstance(input, torch.Tensor) and input.device.type != "meta":
        return input.device
    return torch.device("cpu")


@contextmanager
def begin(name: str, group: Any, input: Any, op: CommOp | None = None) -> Iterator[Call]:
    r"""
    begin(name: str, group: Any, input: Any, op: CommOp | None = None) -> Iterator[Call]

    Opens a call; an exception raised inside the ``with`` block before the
    call's headers went out is told to every peer, then goes on.

    Args:
        name (str): the collective and pass.
        group (Any): what the caller gave as the group.
        input (Any): the call's input (its device picks the transport).
        op (CommOp, optional): the collective, for a forward pass: with an
            invalid ``group`` this rank still meets the default group's
            rank-agreement check. Default: ``None``.

    Returns:
        Iterator[Call]: the call, as a context manager.

    Raises:
        TypeError: if ``group`` is not a process group (the ranks of the
            default group are told, since they may be waiting on it).
        ValueError: if no process group is initialised or this process is
            not in ``group``.
    """
    try:
        pg, rank, world = resolve_group(group)
    except TypeError as err:
        _tell_default_group(name, err, op)
        raise
    call = Call(name, pg, rank, world, open_transport(pg, rank, _device(input)))
    try:
        yield call
    except Exception as err:
        peers = [p for p in range(world) if p != rank]
        call.transport.fail(name, err, peers)
        raise


def _tell_default_group(name: str, error: BaseException, op: CommOp | None) -> None:
    """Tells the default group's ranks that this rank's call has no group."""
    if not dist.is_initialized():
        return
    pg, rank, world = resolve_group(None)
    transport = open_transport(pg, rank, torch.device("cpu"))
    if op is not None:
        # Where the peers check agreement on this call, meet them there.
        try:
            with Agreement(op, pg, rank, world, None):
                raise error
        except BaseException:
            pass
    transport.fail(name, error, [p for p in range(world) if p != rank])
