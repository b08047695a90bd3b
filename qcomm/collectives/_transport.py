"""
How wire tensors cross between ranks: bytes, and nothing of what they mean.
Each message has a dtype of its own (peers may use different codecs), and
receives land in one byte buffer, each at an aligned offset, seen in its
dtype.

A call declares every receive before any send, sends as it encodes, then
waits for each receive. :class:`PointToPoint` (gloo on CPU) posts every
receive at once and sends each chunk as its own message; chunks from one peer
match in order, as gloo keeps the order of messages between two ranks with one
tag. :class:`OneAllToAll` (NCCL, any other backend) runs the backend's
all-to-all once per call. Why: docs/collectives.rst, "Pipelined, full duplex".

The setting ``transport`` (:mod:`qcomm.config`, ``QCOMM_TRANSPORT``) forces
one of them (``all_to_all`` runs NCCL's transport over gloo on CPU, which is
how the tests cover it without a GPU); it must be the same on every rank,
and the agreement check says so when it is not.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy
import torch
import torch.distributed as dist

from qcomm import _events, config
from qcomm.collectives import _buffers, _streams
from qcomm.collectives._backends import Backend

CHOICES = config.TRANSPORTS

# Every call on a group gets a number of its own, counted alike on every rank
# (the ranks make the same calls in the same order). On point-to-point it is
# the call's tag: messages of a call that failed half-way can never be taken
# for those of a later call, and a user's own point-to-point messages (tag 0
# by default) never mix with qcomm's. Its control messages travel under a
# second tag, so that they can never be matched with data.
_FIRST_TAG = 1 << 30
_TAGS = 1 << 29
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
# Transports of failed calls whose messages may still be in flight: kept
# alive (their buffers may still be written) until many later failures.
_abandoned: list[Transport] = []
_KEEP_ABANDONED = 32
# Receives start at multiples of this many bytes in the shared buffer: codecs
# view in-band float32 scales, and vector loads like aligned data.
_ALIGN = 64


def choice() -> str | None:
    """The transport the settings force, or ``None`` (``auto``: the backend's own)."""
    forced: str = config._read("transport")[0]
    return None if forced == "auto" else forced


def kind(group: dist.ProcessGroup, backend: Backend) -> str:
    """The transport a call on ``group`` takes with ``backend``: one of :data:`CHOICES`."""
    forced: str
    forced, where = config._read("transport")
    if forced == "point_to_point" and not backend.moves_alone:
        raise ValueError(
            f"{where}=point_to_point: expected gloo with CPU tensors, got backend "
            f"{dist.get_backend(group)} with tensors on {backend.device}"
        )
    if forced != "auto":
        return forced
    return "point_to_point" if backend.moves_alone else "all_to_all"


def next_number(group: dist.ProcessGroup) -> int:
    """The number the next call on ``group`` gets (see ``open_transport``)."""
    return _calls.get(group, 0)


def open_transport(
    group: dist.ProcessGroup,
    rank: int,
    backend: Backend,
    world: int,
    *,
    trailer_bytes: int = 0,
    control_bytes: int = 0,
) -> Transport:
    """
    The transport of one call, on ``backend``'s device, among ``world``
    ranks. ``trailer_bytes``: the
    size of the trailer a send may end with (:meth:`Transport.send`);
    ``control_bytes``: the size of a control message
    (:meth:`Transport.send_control`).
    """
    how = kind(group, backend)
    device = backend.device
    number = next_number(group)
    _calls[group] = number + 1
    transport: Transport
    if how == "point_to_point":
        transport = PointToPoint(group, rank, world, device, _FIRST_TAG + number % _TAGS)
    else:
        transport = OneAllToAll(group, rank, world, device)
    transport.number = number
    transport.trailer_bytes = trailer_bytes
    transport.control_bytes = control_bytes
    _events.emit("transport_opened", type(transport).__name__)
    return transport


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Transport:
    """The wire of one call: receives declared first, then sends, then receives waited for."""

    #: whether a peer's data may travel as several messages (chunks)
    chunked = False
    #: whether posted messages move without this process's help (in the
    #: backend's threads), so that the rest of a call can be done elsewhere
    moves_alone = False
    #: the call's number on its group, alike on every rank
    number = 0
    #: the size of the trailer that may end a message (see :meth:`send`)
    trailer_bytes = 0
    #: the size of a control message (see :meth:`send_control`)
    control_bytes = 0

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device
    ) -> None:
        self.group = group
        self.rank = rank
        self.device = device
        self.world = world
        # Declared receives: (peer, byte offset in the shared buffer, numel,
        # dtype, own tensor).
        self._recvs: list[tuple[int, int, int, torch.dtype, torch.Tensor | None]] = []
        self._end = 0
        self._buffer: torch.Tensor | None = None  # bytes
        self._raw: Any = None  # the shared buffer's bytes, as numpy, once read
        self._joined: list[torch.Tensor] = []  # messages made here (wire and trailer)
        self._sends: list[tuple[int, torch.Tensor]] = []
        self._forgotten: set[int] = set()  # peers out of the call (see forget)
        # Where a transport posts its receives itself (start), each one's
        # 1-D wire, as posted (on the CPU: no stream to record it on).
        self._posted: list[torch.Tensor] = []

    def expect(
        self, peer: int, numel: int, dtype: torch.dtype, into: torch.Tensor | None = None
    ) -> int:
        """
        Declares a receive of ``numel`` elements of ``dtype`` from ``peer``
        (into ``into`` where it can); returns its handle.
        """
        self._recvs.append((peer, self._end, numel, dtype, into))
        self._end += _aligned(numel * dtype.itemsize)
        return len(self._recvs) - 1

    def _shared(self, nbytes: int) -> torch.Tensor:
        self._buffer = _buffers.take(nbytes, torch.uint8, self.device)
        self._raw = None
        return self._buffer

    def _landing(self, handle: int) -> torch.Tensor:
        """Where a receive lands in the shared buffer, seen in its dtype."""
        _, offset, numel, dtype, _ = self._recvs[handle]
        assert self._buffer is not None
        return self._buffer[offset : offset + numel * dtype.itemsize].view(dtype)

    def start(self) -> None:
        """Posts the declared receives, where the backend allows it before any send."""

    def send(
        self, peer: int, wire: torch.Tensor, trailer: bytes | torch.Tensor | None = None
    ) -> None:
        """
        Sends a contiguous 1-D wire to ``peer``, followed by ``trailer``
        (:attr:`trailer_bytes` bytes, padded to whole elements) where given;
        the wire must stay unchanged until :meth:`close`.
        """
        if trailer is not None:
            wire = _joined(wire, trailer)
            self._joined.append(wire)
        self._sends.append((peer, wire))

    def hold(self, buffer: torch.Tensor) -> torch.Tensor:
        """Keeps ``buffer`` (from ``_buffers``, holding wires to send) until :meth:`close` gives it back."""
        self._joined.append(buffer)
        return buffer

    def flush(self) -> None:
        """Called after the last send: a transport that sends everything at once does it here."""

    def _wait_for(self, handle: int) -> None:
        raise NotImplementedError

    def received(self, handle: int) -> torch.Tensor:
        """Waits for a receive; returns its wire: ``into``, or a view of the shared buffer."""
        self._wait_for(handle)
        if self._posted:  # the very tensors the receives were posted with
            return self._posted[handle]
        _, _, numel, dtype, into = self._recvs[handle]
        if into is not None:
            return into.view(-1)
        if self._buffer is None:
            return torch.empty(0, dtype=dtype, device=self.device)
        # Made on the issuing stream, read where the call is waited for.
        _streams.use_here(self._buffer)
        return self._landing(handle)

    def trailer_of(self, handle: int, size: int) -> bytes | torch.Tensor:
        """
        The trailer after the first ``size`` elements of a received wire: its
        bytes where it is on the CPU, else a device tensor of them (read later,
        all at once).
        """
        _, offset, _, dtype, into = self._recvs[handle]
        if into is not None or self._buffer is None:
            raise AssertionError("qcomm: a trailer lands in the shared buffer")
        start = offset + size * dtype.itemsize
        stop = start + self.trailer_bytes
        if self.device.type == "cpu":
            if self._raw is None:
                self._raw = self._buffer.numpy()
            blob: bytes = self._raw[start:stop].tobytes()
            return blob
        return self._buffer[start:stop]

    def close(self) -> None:
        """Waits for every send and gives the receive buffer back for reuse."""
        self._sends.clear()
        self._posted = []  # views of the buffer given back
        for message in self._joined:
            _buffers.give(message)
        self._joined = []
        if self._buffer is not None:
            _buffers.give(self._buffer)
            self._buffer = None

    def abandon(self) -> None:
        """Gives up on a failed call without waiting; its messages keep their memory."""
        _abandoned.append(self)
        del _abandoned[:-_KEEP_ABANDONED]

    def forget(self, peer: int) -> None:
        """Stops waiting for what was sent to ``peer``, which takes no further part in the call."""
        self._forgotten.add(peer)

    def expect_control(self, peer: int) -> Any:
        """
        Posts the receive of a control message (:attr:`control_bytes` bytes)
        from ``peer``; control messages travel apart from the data, before it.
        """
        raise NotImplementedError

    def send_control(self, peer: int, blob: torch.Tensor) -> None:
        """Sends a control message (uint8, :attr:`control_bytes` bytes) to ``peer``."""
        raise NotImplementedError

    def flush_controls(self) -> None:
        """Called after the last control message is sent; a transport that sends them at once does it here."""

    def control(self, handle: Any) -> torch.Tensor:
        """Waits for a control message posted with :meth:`expect_control` (a CPU tensor)."""
        raise NotImplementedError


class PointToPoint(Transport):
    """Each receive and each send its own message, receives posted first (gloo)."""

    chunked = True
    moves_alone = True

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device, tag: int
    ) -> None:
        super().__init__(group, rank, world, device)
        self.tag = tag
        self._recv_work: list[Any] = []
        self._send_work: list[tuple[int, Any]] = []
        self._control_sent: list[torch.Tensor] = []
        self._control_recv: list[tuple[torch.Tensor, Any]] = []

    def expect_control(self, peer: int) -> Any:
        blob = torch.empty(self.control_bytes, dtype=torch.uint8)
        # Kept with the transport: a posted receive's memory and work must
        # outlive it, even when the call is abandoned.
        self._control_recv.append((blob, self.group.recv([blob], peer, self.tag + _TAGS)))
        return len(self._control_recv) - 1

    def send_control(self, peer: int, blob: torch.Tensor) -> None:
        self._control_sent.append(blob)  # kept alive until the send is done
        self._send_work.append((peer, self.group.send([blob], peer, self.tag + _TAGS)))

    def control(self, handle: Any) -> torch.Tensor:
        blob: torch.Tensor
        blob, work = self._control_recv[handle]
        if work is not None:
            work.wait()
            self._control_recv[handle] = (blob, None)
        return blob

    def start(self) -> None:
        landing = [(into is None and numel > 0) for _, _, numel, _, into in self._recvs]
        buffer = self._shared(self._end) if any(landing) else None
        if buffer is not None and self.trailer_bytes:
            # Memory, kept or fresh from malloc, may hold an earlier call's
            # trailer where this call expects one, and gloo takes a message
            # shorter than posted without a word: a peer that sent too
            # little must not leave an old trailer in sight. Trailers end a
            # message; every one is cleared before any receive is posted
            # (one in flight is written to at any time), and within its own
            # message only.
            raw = self._raw = buffer.numpy()  # kept: the trailers are read from it
            for (_, offset, numel, dtype, _), lands in zip(self._recvs, landing):
                if lands:
                    end = offset + numel * dtype.itemsize
                    raw[max(offset, end - self.trailer_bytes) : end] = 0
        recv, tag, work, posted = self.group.recv, self.tag, self._recv_work, self._posted
        for (peer, offset, numel, dtype, into), lands in zip(self._recvs, landing):
            if lands:
                assert buffer is not None
                target = buffer[offset : offset + numel * dtype.itemsize].view(dtype)
                work.append(recv([target], peer, tag))
            elif numel:
                assert into is not None
                target = into.view(-1)
                work.append(recv([target], peer, tag))
            else:
                target = torch.empty(0, dtype=dtype, device=self.device)
                work.append(None)
            posted.append(target)

    def send(
        self, peer: int, wire: torch.Tensor, trailer: bytes | torch.Tensor | None = None
    ) -> None:
        super().send(peer, wire, trailer)
        message = self._sends[-1][1]
        if message.numel():
            self._send_work.append((peer, self.group.send([message], peer, self.tag)))

    def _wait_for(self, handle: int) -> None:
        work = self._recv_work[handle]
        if work is not None:
            work.wait()

    def close(self) -> None:
        try:
            for peer, work in self._send_work:
                if peer not in self._forgotten:
                    work.wait()
        finally:
            if self._forgotten:
                # Messages to or from a peer that left the call may never
                # complete: they keep their memory, like an abandoned call's.
                self.abandon()
            else:
                self._send_work.clear()
                self._control_sent = []
                super().close()


class OneAllToAll(Transport):
    """
    One all-to-all of the backend per call, a peer's messages one after the
    other in its part: every wire (and trailer) is copied once, into its
    place in the send buffer. Control messages travel in one small all-to-all of their own
    before the data.
    """

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device
    ) -> None:
        super().__init__(group, rank, world, device)
        self._work: Any = None
        self._control_out: dict[int, torch.Tensor] = {}
        self._control_in: torch.Tensor | None = None
        self._pieces: list[tuple[int, torch.Tensor, bytes | torch.Tensor | None]] = []

    def send(
        self, peer: int, wire: torch.Tensor, trailer: bytes | torch.Tensor | None = None
    ) -> None:
        # Laid out (copied) once, in flush(): no joined copy first.
        self._pieces.append((peer, wire, trailer))

    def expect(
        self, peer: int, numel: int, dtype: torch.dtype, into: torch.Tensor | None = None
    ) -> int:
        # Every peer's data lands in the shared buffer, laid out by flush().
        return super().expect(peer, numel, dtype)

    def expect_control(self, peer: int) -> Any:
        return peer

    def send_control(self, peer: int, blob: torch.Tensor) -> None:
        self._control_out[peer] = blob

    def flush_controls(self) -> None:
        if self._control_in is not None:
            return
        # Every rank's control messages to every rank at once.
        size = self.control_bytes
        send = torch.zeros(self.world * size, dtype=torch.uint8)
        for peer, blob in self._control_out.items():
            send[peer * size : (peer + 1) * size] = blob
        out = torch.empty_like(send, device=self.device)
        _all_to_all(self.group, out, send.to(self.device), [], []).wait()
        self._control_in = out.cpu()

    def control(self, handle: Any) -> torch.Tensor:
        self.flush_controls()  # the first read sends them, where not yet sent
        assert self._control_in is not None
        size = self.control_bytes
        return self._control_in[handle * size : (handle + 1) * size]

    def flush(self) -> None:
        if self.world == 1:
            return  # no peers: no communication at all
        # A peer's messages travel one after the other in its part of the
        # all-to-all, each aligned as a point-to-point receive would be
        # (codecs view in-band scales); the peer lays its receives out alike,
        # in the order it declared them.
        send_sizes, recv_sizes = [0] * self.world, [0] * self.world
        placed = []
        for peer, wire, trailer in self._pieces:
            numel = wire.numel() + _trailer_elements(trailer, wire.dtype)
            placed.append((send_sizes[peer], peer, wire, trailer))
            send_sizes[peer] += _aligned(numel * wire.element_size())
        landing = []
        for peer, _, numel, dtype, _ in self._recvs:
            landing.append(recv_sizes[peer])
            if peer not in self._forgotten:
                recv_sizes[peer] += _aligned(numel * dtype.itemsize)
        send = _buffers.take(sum(send_sizes), torch.uint8, self.device)
        self._joined.append(send)  # given back once the all-to-all is done
        starts = [sum(send_sizes[:p]) for p in range(self.world)]
        # On the CPU, one numpy view of the buffer takes every wire (numpy's
        # copies cost a fraction of torch's per call, see _write).
        raw = send.numpy() if self.device.type == "cpu" else None
        for at, peer, wire, trailer in placed:
            begin = starts[peer] + at
            if raw is not None and _write_numpy(raw[begin:], wire, trailer):
                continue
            size = wire.numel() * wire.element_size()
            _write(send[begin : begin + size + len(trailer or b"")], wire, trailer)
        self._pieces = []
        # The all-to-all delivers in peer order: lay the receives out so.
        starts = [sum(recv_sizes[:p]) for p in range(self.world)]
        self._recvs = [
            (peer, starts[peer] + at, numel, dtype, None)
            for at, (peer, _, numel, dtype, _) in zip(landing, self._recvs)
        ]
        recv = self._shared(sum(recv_sizes))
        self._work = _all_to_all(self.group, recv, send, recv_sizes, send_sizes)

    def _wait_for(self, handle: int) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def close(self) -> None:
        self._wait_for(0)
        super().close()


def _all_to_all(
    group: dist.ProcessGroup,
    out: torch.Tensor,
    send: torch.Tensor,
    out_sizes: list[int],
    send_sizes: list[int],
) -> Any:
    """
    The backend's all-to-all of two uint8 tensors, started; its work. The
    group's own method: ``dist.all_to_all_single``'s checks and logging
    wrapper cost some 20-40 microseconds a call on gloo, a tenth of a small
    call, and have nothing to check in the buffers made here.
    """
    options = dist.AllToAllOptions()
    options.asyncOp = True
    return group.all_to_all_single(out, send, out_sizes, send_sizes, options)


def _trailer_elements(trailer: bytes | torch.Tensor | None, dtype: torch.dtype) -> int:
    return 0 if trailer is None else -(-len(trailer) // dtype.itemsize)


def _write(out: torch.Tensor, wire: torch.Tensor, trailer: bytes | torch.Tensor | None) -> None:
    """Writes ``wire`` then ``trailer`` into ``out`` (any dtype: its bytes are written)."""
    if out.dtype != torch.uint8:  # a view is a step of its own: only where needed
        out = out.view(torch.uint8)
    if out.device.type == "cpu" and _write_numpy(out.numpy(), wire, trailer):
        return
    size = wire.numel() * wire.element_size()
    out[:size].view(wire.dtype).copy_(wire)
    if trailer is not None:
        tail = out[size : size + len(trailer)]
        if isinstance(trailer, torch.Tensor):  # made on the device: no host synchronisation
            tail.copy_(trailer)
        else:
            tail.copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8), non_blocking=True)


# dtypes numpy has (a wire of another is seen as bytes by torch first)
_NUMPY = {torch.float32, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32}


def _write_numpy(raw: Any, wire: torch.Tensor, trailer: bytes | torch.Tensor | None) -> bool:
    """
    Writes ``wire`` then ``trailer`` into the bytes ``raw`` (numpy) where both
    are on the CPU, ``wire`` dense; whether it could. numpy's copies cost a
    fraction of torch's per call: on small calls this is most of what the
    trailer costs.
    """
    if wire.device.type != "cpu" or wire.stride(-1) != 1 or isinstance(trailer, torch.Tensor):
        return False
    size = wire.numel() * wire.element_size()
    # numpy has no bfloat16: such a wire is seen as bytes by torch first.
    data = (
        wire.numpy().view(numpy.uint8) if wire.dtype in _NUMPY else wire.view(torch.uint8).numpy()
    )
    raw[:size] = data
    if trailer is not None:
        raw[size : size + len(trailer)] = numpy.frombuffer(trailer, dtype=numpy.uint8)
    return True


def _joined(wire: torch.Tensor, trailer: bytes | torch.Tensor) -> torch.Tensor:
    """
    ``wire`` followed by ``trailer``, as bytes (the size of whole elements of
    ``wire``'s dtype), in a buffer from ``_buffers`` (give it back).
    """
    size = (wire.numel() + _trailer_elements(trailer, wire.dtype)) * wire.element_size()
    out = _buffers.take(size, torch.uint8, wire.device)
    _write(out, wire, trailer)
    return out
