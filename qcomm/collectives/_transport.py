"""
How wire tensors cross between ranks: the one place that knows backends.

A call declares every receive before any send, sends as it encodes, then
waits for each receive. :class:`PointToPoint` (gloo on CPU) posts every
receive at once and sends each chunk as its own message; chunks from one peer
match in order, as gloo keeps the order of messages between two ranks with one
tag. :class:`OneAllToAll` (NCCL, any other backend) runs the backend's
all-to-all once per call. Why: docs/collectives.rst, "Pipelined, full duplex".
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives import _buffers, _header
from qcomm.collectives._agreement import ENV

# Every call on a group gets a tag of its own, counted alike on every rank
# (the ranks make the same calls in the same order): messages of a call that
# failed half-way can never be taken for those of a later call, and a user's
# own point-to-point messages (tag 0 by default) never mix with qcomm's. Its
# headers and trailers travel under a second tag, so that they can never be
# matched with data.
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


def open_transport(group: dist.ProcessGroup, rank: int, device: torch.device) -> Transport:
    """The transport of one call: point-to-point on gloo with CPU tensors, else one all-to-all."""
    if device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower():
        count = _calls.get(group, 0)
        _calls[group] = count + 1
        transport = PointToPoint(group, rank, device, _FIRST_TAG + count % _TAGS)
        # Headers cost two gloo messages per pair and call, which on small
        # calls is far more than 5% (see the collectives docs): they are sent
        # where every call is checked, QCOMM_VERIFY=1 (alike on all ranks).
        transport.checked = os.environ.get(ENV, "").strip() == "1"
        return transport
    return OneAllToAll(group, rank, device)


def _aligned(numel: int, dtype: torch.dtype) -> int:
    unit = max(1, _ALIGN // dtype.itemsize)
    return -(-numel // unit) * unit


class Transport:
    """The wire of one call: receives declared first, then sends, then receives waited for."""

    #: whether a peer's data may travel as several messages (chunks)
    chunked = False
    #: whether the call exchanges headers and trailers (see ``_header``)
    checked = False

    def __init__(self, group: dist.ProcessGroup, rank: int, device: torch.device) -> None:
        self.group = group
        self.rank = rank
        self.device = device
        # Declared receives: (peer, offset in the shared buffer, numel, own tensor).
        self._recvs: list[tuple[int, int, int, torch.Tensor | None]] = []
        self._end = 0
        self._dtype = torch.uint8
        self._buffer: torch.Tensor | None = None
        self._sends: list[tuple[int, torch.Tensor]] = []
        #: whether this rank's headers have gone out (then a failure is told
        #: in its trailers, not by :meth:`fail`)
        self.announced = False

    def expect(
        self, peer: int, numel: int, dtype: torch.dtype, into: torch.Tensor | None = None
    ) -> int:
        """Declares a receive from ``peer`` (into ``into`` where it can); returns its handle."""
        self._dtype = dtype
        self._recvs.append((peer, self._end, numel, into))
        self._end += _aligned(numel, dtype)
        return len(self._recvs) - 1

    def _shared(self, total: int) -> torch.Tensor:
        self._buffer = _buffers.take(total, self._dtype, self.device)
        return self._buffer

    def start(self) -> None:
        """Posts the declared receives, where the backend allows it before any send."""

    def send(self, peer: int, wire: torch.Tensor) -> None:
        """Sends a contiguous 1-D wire to ``peer``; it must stay unchanged until :meth:`close`."""
        self._dtype = wire.dtype
        self._sends.append((peer, wire))

    def flush(self) -> None:
        """Called after the last send: a transport that sends everything at once does it here."""

    def _wait_for(self, handle: int) -> None:
        raise NotImplementedError

    def received(self, handle: int) -> torch.Tensor:
        """Waits for a receive; returns its wire: ``into``, or a view of the shared buffer."""
        self._wait_for(handle)
        _, offset, numel, into = self._recvs[handle]
        if into is not None:
            return into.view(-1)
        if self._buffer is None:
            return torch.empty(0, dtype=self._dtype, device=self.device)
        return self._buffer[offset : offset + numel]

    def close(self) -> None:
        """Waits for every send and gives the receive buffer back for reuse."""
        self._sends.clear()
        if self._buffer is not None:
            _buffers.give(self._buffer)
            self._buffer = None

    def abandon(self) -> None:
        """Gives up on a failed call without waiting; its messages keep their memory."""
        _abandoned.append(self)
        del _abandoned[:-_KEEP_ABANDONED]

    def forget(self, peer: int) -> None:
        """Stops waiting for what was sent to ``peer``, which takes no further part in the call."""

    def expect_control(self, peer: int) -> Any:
        """Posts the receive of a header or trailer from ``peer`` (only where :attr:`checked`)."""
        raise NotImplementedError

    def send_control(self, peer: int, blob: torch.Tensor) -> None:
        """Sends a header or trailer to ``peer`` (only where :attr:`checked`)."""
        raise NotImplementedError

    def control(self, handle: Any) -> torch.Tensor:
        """Waits for a header or trailer posted with :meth:`expect_control`."""
        raise NotImplementedError

    def fail(self, call: str, error: BaseException, peers: list[int]) -> None:
        """Tells ``peers`` (where it can) that this rank cannot take part, and abandons the call."""
        if self.checked and not self.announced:
            blob = _header.fail(call, error).pack()
            for peer in peers:
                self.send_control(peer, blob)
        self.abandon()


class PointToPoint(Transport):
    """Each receive and each send its own message, receives posted first (gloo)."""

    chunked = True
    checked = True

    def __init__(self, group: dist.ProcessGroup, rank: int, device: torch.device, tag: int) -> None:
        super().__init__(group, rank, device)
        self.tag = tag
        self._recv_work: list[Any] = []
        self._send_work: list[tuple[int, Any]] = []
        self._control_sent: list[torch.Tensor] = []
        self._control_recv: list[tuple[torch.Tensor, Any]] = []
        self._forgotten: set[int] = set()

    def expect_control(self, peer: int) -> Any:
        blob = torch.empty(_header.SIZE, dtype=torch.uint8)
        # Kept with the transport: a posted receive's memory and work must
        # outlive it, even when the call is abandoned.
        self._control_recv.append((blob, self.group.recv([blob], peer, self.tag + _TAGS)))
        return len(self._control_recv) - 1

    def send_control(self, peer: int, blob: torch.Tensor) -> None:
        self._control_sent.append(blob)  # kept alive until the send is done
        self._send_work.append((peer, self.group.send([blob], peer, self.tag + _TAGS)))

    def forget(self, peer: int) -> None:
        self._forgotten.add(peer)

    def control(self, handle: Any) -> torch.Tensor:
        blob: torch.Tensor
        blob, work = self._control_recv[handle]
        if work is not None:
            work.wait()
            self._control_recv[handle] = (blob, None)
        return blob

    def start(self) -> None:
        shared = any(into is None and numel for _, _, numel, into in self._recvs)
        buffer = self._shared(self._end) if shared else None
        for peer, offset, numel, into in self._recvs:
            if not numel:
                self._recv_work.append(None)
                continue
            target = into.view(-1) if into is not None else buffer[offset : offset + numel]  # type: ignore[index]
            self._recv_work.append(self.group.recv([target], peer, self.tag))

    def send(self, peer: int, wire: torch.Tensor) -> None:
        super().send(peer, wire)
        if wire.numel():
            self._send_work.append((peer, self.group.send([wire], peer, self.tag)))

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
    """One all-to-all of the backend per call, at most one send and one receive per peer."""

    def __init__(self, group: dist.ProcessGroup, rank: int, device: torch.device) -> None:
        super().__init__(group, rank, device)
        self._work: Any = None

    def flush(self) -> None:
        world = dist.get_world_size(self.group)
        send_sizes, recv_sizes = [0] * world, [0] * world
        by_peer: dict[int, torch.Tensor] = {}
        for peer, wire in self._sends:
            if peer in by_peer:
                raise AssertionError("qcomm: one all-to-all carries one send per peer")
            by_peer[peer] = wire
            send_sizes[peer] = _aligned(wire.numel(), self._dtype)
        for peer, _, numel, _ in self._recvs:
            recv_sizes[peer] = _aligned(numel, self._dtype)
        send = torch.empty(sum(send_sizes), dtype=self._dtype, device=self.device)
        start = 0
        for peer in range(world):
            if peer in by_peer:
                send[start : start + by_peer[peer].numel()].copy_(by_peer[peer])
            start += send_sizes[peer]
        # The all-to-all delivers in peer order: lay the receives out so.
        starts = [sum(recv_sizes[:peer]) for peer in range(world)]
        self._recvs = [(peer, starts[peer], numel, None) for peer, _, numel, _ in self._recvs]
        recv = self._shared(sum(recv_sizes))
        self._send_buffer = send
        self._work = dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=self.group, async_op=True
        )

    def _wait_for(self, handle: int) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def close(self) -> None:
        self._wait_for(0)
        super().close()
