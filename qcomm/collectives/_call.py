"""
The start of every collective call and of its backward: the group, this
rank, what the group's backend does with the input's device, the call's
transport and its agreement check, all opened before anything can fail so
that the ranks count their calls alike. The call is the context of the rest:
a failure before its headers go out is told to the peers (where the call
sends headers, else by the agreement check), which raise naming this rank
instead of waiting for it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._agreement import Agreement, read_mode
from qcomm.collectives._args import resolve_group
from qcomm.collectives._backends import Backend, backend_of
from qcomm.collectives._hosts import ByHost, per_peer
from qcomm.collectives._protocol import FRAMING, tell_failure
from qcomm.collectives._transport import Transport, open_transport


class Call:
    """
    One collective call (or backward pass) on this rank: its group, its
    transport, and what its peers have been told. Whether the call exchanges
    headers (``checked``) is decided here, alike on every rank; the transport
    only moves the bytes.
    """

    def __init__(
        self, name: str, group: dist.ProcessGroup, rank: int, world: int, device: torch.device
    ) -> None:
        self.name = name
        self.group = group
        self.rank = rank
        self.world = world
        #: what the group's backend does with the call's tensors, asked once
        self.backend: Backend = backend_of(group, device)
        #: the setting ``verify`` (``"first"`` and its error where invalid), read once
        self.verify = read_mode()
        #: whether the call exchanges headers before its data (``QCOMM_VERIFY=1``)
        self.checked = self.verify[0] == "always"
        #: whether this rank's headers have gone out on the current transport
        #: (then a failure is told in-band, with the data)
        self.announced = False
        self._transports = [open_transport(group, rank, self.backend, world, **FRAMING)]
        self._exchanges = 0
        self._agreement: Agreement | None = None

    def __enter__(self) -> Call:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The exception goes on; the peers hear of it first.
        if isinstance(exc, Exception):
            self.fail(exc)

    @property
    def transport(self) -> Transport:
        """The transport of the call's current exchange (see :meth:`next_exchange`)."""
        if len(self._transports) < self._exchanges:
            # The first use of an exchange's own transport, right after
            # next_exchange named it.
            self._transports.append(
                open_transport(self.group, self.rank, self.backend, self.world, **FRAMING)
            )
        return self._transports[-1]

    @property
    def number(self) -> int:
        """The call's number on its group, alike on every rank."""
        return self.transport.number

    @property
    def agreement(self) -> Agreement:
        """The agreement check of a call begun with its collective's name (see :class:`Agreement`)."""
        if self._agreement is None:
            raise AssertionError(f"qcomm: {self.name} was begun without its collective's name")
        return self._agreement

    def by_peer(self, codec: Any) -> list[Any]:
        """
        The codec of every rank of the group, as this rank pairs with it (see
        :func:`~._hosts.per_peer`); asked after the agreement check, which the
        ranks pass together (learning host names is an exchange).
        """
        if not isinstance(codec, ByHost):
            return [codec] * self.world
        return per_peer(codec, self.group, self.rank, self.backend.device)

    def next_exchange(self, name: str) -> None:
        """
        Names the call's next exchange; every exchange after the first has a
        transport of its own, which becomes the call's (a call made of
        several exchanges: the all-reduce).
        """
        if self._exchanges:
            self.announced = False
        self._exchanges += 1
        self.name = name

    def fail(self, error: BaseException) -> None:
        """
        Tells the peers that this rank's call failed, where they would
        otherwise wait for its header, and gives up on the call's transports.
        """
        told = self._agreement is not None and self._agreement.told
        if self.checked and not self.announced and not told:
            tell_failure(self.transport, self.name, self.rank, self.world, error)
        self.abandon()

    def abandon(self) -> None:
        """Gives up on every transport of the call, without waiting."""
        for transport in self._transports:
            transport.abandon()


def _device(input: Any) -> torch.device:
    """Where the call's wire lives: the input's device, or the CPU if it has none."""
    if isinstance(input, torch.Tensor) and input.device.type != "meta":
        return input.device
    return torch.device("cpu")


def begin(name: str, group: Any, input: Any, collective: str | None = None) -> Call:
    """
    Opens a call (``collective``: where the peers may check agreement on it),
    to be used as a context: an exception in its ``with`` block is told to
    every peer, then goes on.
    """
    device = _device(input)
    try:
        pg, rank, world = resolve_group(group)
    except TypeError as err:
        _tell_default_group(name, err, collective)
        raise
    call = Call(name, pg, rank, world, device)
    if collective is not None:
        call._agreement = Agreement(collective, pg, rank, world, input, call.verify)
    return call


def _tell_default_group(name: str, error: BaseException, collective: str | None) -> None:
    """Tells the default group's ranks that this rank's call has no valid group."""
    if not dist.is_initialized():
        return
    pg, rank, world = resolve_group(None)
    call = Call(name, pg, rank, world, torch.device("cpu"))
    if collective is not None:
        # Where the peers check agreement on this call, meet them there.
        call._agreement = Agreement(collective, pg, rank, world, None, call.verify)
        try:
            with call.agreement:
                raise error
        except BaseException:
            pass
    call.fail(error)
