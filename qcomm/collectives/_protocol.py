"""
The rank-checking protocol of one exchange: what two ranks tell each other
besides their data, so that a disagreement or a failure raises
:class:`~qcomm.CodecError` on both instead of a wrong result or a wait
forever (docs/collectives.rst, "Mistakes and failures"). Its wire formats
are :mod:`._header`'s; the check of a call's arguments before its first
exchange is :mod:`._agreement`'s. A call takes from here the framing its
transports carry (:data:`FRAMING`) and the notice of a failure before its
headers went out (:func:`tell_failure`); each exchange, its checks
(:class:`Protocol`).

The exchange only moves data; it calls the hooks of :class:`Protocol` in
this order: :meth:`~Protocol.announce` (headers out, before any receive is
posted), :meth:`~Protocol.last_posted` (where a peer's status will land),
:meth:`~Protocol.agree` (the peers whose headers agree), :meth:`~Protocol.hold`
and :meth:`~Protocol.release` (the held last message to each peer, sent with
the status of the whole call), :meth:`~Protocol.last_received` and
:meth:`~Protocol.verdict` (the peers' statuses, read once).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qcomm.collectives import _header
from qcomm.collectives._transport import Transport
from qcomm.types import CodecError

#: What the transport carries for the protocol, in sizes only: each message's
#: last part ends with a status, and checked calls send headers first.
FRAMING = {"trailer_bytes": _header.STATUS_BYTES, "control_bytes": _header.SIZE}


class Flows(NamedTuple):
    """What this rank sends one peer and expects from it."""

    sends: _header.Flow
    expects: _header.Flow


class Protocol:
    """
    The checks of one exchange of a call on this rank: its headers (where the
    call is ``checked``), the identity of the call with each peer, the
    status that ends the last message to each peer, and the statuses read.

    ``codings`` gives each peer's :class:`~._coding.Coding`; ``flows``, by
    peer, what travels each way (every peer but this rank); ``slots``, the
    error slots every status carries (see :mod:`._measure`).
    """

    def __init__(
        self,
        call: Any,
        codings: Any,
        dtype: torch.dtype,
        flows: dict[int, Flows],
        slots: int = 0,
    ) -> None:
        self._call = call
        self._transport: Transport = call.transport
        self._name: str = call.name
        self.checked = bool(call.checked and flows)
        number = self._transport.number
        self._own: dict[int, int] = {}
        self._expected: dict[int, int] = {}
        self._headers: dict[int, _header.Header] = {}
        for p, flow in flows.items():
            coding = codings[p]
            self._own[p] = _header.identity(
                self._name, number, coding.print, str(dtype), flow.sends
            )
            self._expected[p] = _header.identity(
                self._name, number, coding.print, str(dtype), flow.expects
            )
            if self.checked:
                self._headers[p] = _header.Header(
                    _header.OK,
                    self._name,
                    coding.print,
                    str(dtype),
                    flow.sends,
                    flow.expects,
                    coding.name,
                )
        self._handles: dict[int, Any] = {}
        #: each peer's last message, where it lands and its data's size
        self._last: dict[int, tuple[Any, int]] = {}
        self._held: dict[int, torch.Tensor] = {}
        self._statuses: dict[int, bytes | torch.Tensor] = {}
        self._agreed: set[int] = set(flows)
        self.slots = slots
        #: the bytes of every status of this exchange
        self.status_bytes = _header.status_bytes(slots)
        self._transport.trailer_bytes = self.status_bytes
        #: by peer, the error slots its status carried (read by :meth:`verdict`)
        self.errors: dict[int, list[float]] = {}
        self._mine: list[float] | torch.Tensor | None = None

    def status_elements(self, wire_dtype: torch.dtype) -> int:
        """Elements of ``wire_dtype`` that a peer's last message carries beyond its data."""
        return -(-self.status_bytes // wire_dtype.itemsize)

    def announce(self) -> None:
        """Sends this rank's header to every peer and posts theirs (a checked call only)."""
        if not self.checked:
            return
        transport = self._transport
        for p in self._headers:
            self._handles[p] = transport.expect_control(p)
        for p, mine in self._headers.items():
            transport.send_control(p, mine.pack())
        self._call.announced = True

    def last_posted(self, peer: int, handle: Any, size: int) -> None:
        """Says where ``peer``'s last message lands: ``size`` elements of data, then its status."""
        self._last[peer] = (handle, size)

    def agree(self) -> tuple[set[int], CodecError | None]:
        """
        Reads every peer's header: the peers to exchange data with, and what
        differs (the call's failure, told to the agreeing peers in-band).
        Raises at once where a peer failed before the call and the transport
        is one all-to-all, which that peer never joins.
        """
        if not self.checked:
            return self._agreed, None
        transport = self._transport
        blobs = {p: transport.control(handle) for p, handle in self._handles.items()}
        said = {
            p: _header.problems(mine, p, transport.rank, blobs[p])
            for p, mine in self._headers.items()
        }
        for p, problems in said.items():
            if problems:
                # The peer saw the same difference (or failed): nothing more
                # travels between the two, and nothing waits for it.
                transport.forget(p)
        wrong = [text for problems in said.values() for text in problems]
        self._agreed = {p for p, problems in said.items() if not problems}
        failure = CodecError(f"{self._name}: {'; '.join(wrong)}") if wrong else None
        if any(_header.failed(blob) for blob in blobs.values()) and not transport.chunked:
            # A rank that failed before the call never joins the all-to-all:
            # neither does any other (each has its header).
            transport.abandon()
            raise failure or CodecError(f"{self._name}: a peer failed")
        return self._agreed, failure

    def hold(self, peer: int, wire: torch.Tensor) -> None:
        """
        Keeps the last message to ``peer`` until :meth:`release`: a peer never
        hears "ok" from a rank that then fails on another peer's data.
        """
        self._held[peer] = wire

    def release(self, ok: bool, errors: list[float] | torch.Tensor | None = None) -> None:
        """
        Sends every held message, ending with the status of the whole call
        (``ok``) and the errors this rank measured (float32, two per slot).
        """
        self._mine = errors if ok else None
        if self.slots and self._mine is None:
            # Every status has the size its peer posted for, failed or not.
            errors = [float("nan")] * (2 * self.slots)
        for peer, wire in self._held.items():
            self._transport.send(peer, wire, _header.status(ok, self._own[peer], errors))
        self._held.clear()

    def own_errors(self) -> list[float]:
        """The error slots this rank sent (NaN where it did not measure)."""
        mine = self._mine
        if mine is None:
            return [float("nan")] * (2 * self.slots)
        if isinstance(mine, list):
            return mine
        values: list[float] = mine.cpu().tolist()
        return values

    def last_received(self, peer: int, wire: torch.Tensor) -> torch.Tensor:
        """Reads the status of ``peer``'s last message (``wire``, as received); its data."""
        handle, size = self._last[peer]
        self._statuses[peer] = self._transport.trailer_of(handle, size)
        return wire[:size]

    def collect(self) -> None:
        """Receives and reads the status of every agreeing peer not read yet."""
        for peer, (handle, size) in self._last.items():
            if peer in self._agreed and peer not in self._statuses:
                self._transport.received(handle)
                self._statuses[peer] = self._transport.trailer_of(handle, size)

    def verdict(self) -> str | None:
        """
        What the statuses read say is wrong (``None``: every peer's call went
        well and is this rank's). One read of every status: on a GPU, the one
        host synchronisation of the call, where waiting waits anyway.
        """
        statuses = self._statuses
        if not statuses:
            return None
        if not self.slots:
            # The usual answer, found by comparing bytes: every status read
            # here is the one of a call that went well and is this one.
            expected, well = self._expected, _header.went_well
            for peer, blob in statuses.items():
                if type(blob) is not bytes or blob[: _header.STATUS_BYTES] != well(expected[peer]):
                    break
            else:
                return None
        order = sorted(statuses)
        on_device = [s for p in order if isinstance(s := statuses[p], torch.Tensor)]
        # One copy to the host for all that are on a device (one wait for it).
        if on_device:
            host = iter(torch.cat(on_device).cpu().numpy().reshape(len(on_device), -1))
        blobs = b"".join(
            s if isinstance(s, bytes) else next(host).tobytes()
            for s in (statuses[p] for p in order)
        )
        width = self.status_bytes
        if self.slots:
            self.errors = {
                p: _header.status_errors(blobs[i * width :], self.slots)
                for i, p in enumerate(order)
            }
        said = [
            problem
            for i, p in enumerate(order)
            if (problem := _header.status_problem(blobs[i * width :], self._expected[p], p))
        ]
        if not said:
            return None
        return f"{self._name}: {'; '.join(said)}, so this rank's result is void"


def tell_failure(
    transport: Transport, name: str, rank: int, world: int, error: BaseException
) -> None:
    """
    Tells every peer that this rank's call failed, as the header they wait
    for (a checked call whose headers have not gone out).
    """
    blob = _header.fail(name, error).pack()
    for peer in range(world):
        if peer != rank:
            transport.expect_control(peer)
            transport.send_control(peer, blob)
    transport.flush_controls()
