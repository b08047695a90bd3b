"""
The exchange every collective is made of: regions of this rank's tensor go
to peers encoded, in chunks; regions of the result come from peers, decoded
in place or added (reduce-scatter) in a fixed order, so that results never
depend on timing. How and why it pipelines: docs/collectives.rst,
"Pipelined, full duplex".

A region is a :class:`Rows` (a ``[rows, width]`` view, padded on the wire
to the codec's ``padded_size``) or a :class:`Flat` (a 1-D view, padded at
its end). Chunks fall on whole rows and multiples of the codec's
``error_block`` and are encoded on their own, so a chunked call gives the
same bits as an unchunked one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qcomm.collectives import _background, _buffers, _header
from qcomm.collectives._call import Call
from qcomm.collectives._coding import Coding, PeerCodings
from qcomm.collectives._transport import Transport
from qcomm.collectives._wire import checked_decode, checked_encode, encodable, quantized_sizes
from qcomm.types import CodecError

# Automatic chunking: a region of at most _SMALL elements travels whole;
# larger ones in up to _MAX_CHUNKS chunks of at least _SMALL elements. More
# chunks hide more of the encoding and decoding behind a slow link, but each
# costs a message and codec calls, and where the CPU rather than the link is
# the limit the overlap itself costs (threads and caches compete): measured
# on an emulated 1 and 10 Gbit/s link, 8 chunks kept nearly all the gain of
# 16 on the first and lost less on the second.
_SMALL = 1 << 18  # 1 MiB of float32
_MAX_CHUNKS = 8


def chunk_elements(length: int, chunk_bytes: int | None) -> int:
    """Elements per chunk: ``chunk_bytes // 4`` (float32 bytes on all ranks), or automatic."""
    if chunk_bytes is not None:
        return max(1, chunk_bytes // 4)
    if length <= _SMALL:
        return max(1, length)
    return max(_SMALL, -(-length // _MAX_CHUNKS))


def offsets(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid end to end, and the total."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def send_order(rank: int, world: int) -> list[int]:
    """The peers in sending order: the next rank first, so the ranks do not all start with one."""
    return [(rank + i) % world for i in range(1, world)]


def recv_order(rank: int, world: int) -> list[int]:
    """The peers in the order their data reaches this rank (see :func:`send_order`)."""
    return [(rank - i) % world for i in range(1, world)]


def _boundaries(length: int, granule: int, step: int) -> list[tuple[int, int]]:
    if length == 0:
        return [(0, 0)]
    step = max(granule, step // granule * granule)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


class Rows:
    """A ``[rows, width]`` view (any strides), padded on the wire with zero columns."""

    def __init__(self, region: torch.Tensor, padded: int) -> None:
        self.region = region
        self.padded = padded
        self.length = region.shape[0] * padded

    def chunks(self, align: int, step: int) -> list[tuple[int, int]]:
        """The chunks' ``[start, stop)`` in wire-layout elements, on whole rows."""
        if self.length == 0:
            return [(0, 0)]
        granule = self.padded * (align // math.gcd(align, self.padded))
        return _boundaries(self.length, granule, step)

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        if self.padded == 0:  # no columns: one empty chunk holds every row
            return self.region
        return self.region[start // self.padded : stop // self.padded]

    def read(self, start: int, stop: int) -> torch.Tensor:
        """The chunk as a contiguous 1-D tensor, padding included."""
        rows = self._rows(start, stop)
        pad = self.padded - rows.shape[1]
        return (F.pad(rows, (0, pad)) if pad else rows.contiguous()).view(-1)

    def target(self, start: int, stop: int) -> torch.Tensor | None:
        """Where the chunk's decoded elements go when none is padding; else ``None``."""
        rows = self._rows(start, stop)
        return rows if rows.shape[1] == self.padded else None

    def write(self, start: int, stop: int, values: torch.Tensor, add: bool) -> None:
        """Stores (or adds) the chunk's decoded 1-D values, dropping padding."""
        rows = self._rows(start, stop)
        block = values.view(rows.shape[0], self.padded)[:, : rows.shape[1]]
        rows.add_(block) if add else rows.copy_(block)


class Flat:
    """A 1-D view, padded on the wire with zeros at its end."""

    def __init__(self, region: torch.Tensor, padded: int) -> None:
        self.region = region
        self.padded = padded
        self.length = padded

    def chunks(self, align: int, step: int) -> list[tuple[int, int]]:
        """The chunks' ``[start, stop)`` in wire-layout elements."""
        return _boundaries(self.length, align, step)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """The chunk as a contiguous 1-D tensor, padding included."""
        n = self.region.numel()
        part = self.region[min(start, n) : min(stop, n)]
        if stop <= n:
            return part.contiguous()
        return torch.cat([part, part.new_zeros(stop - max(start, n))])

    def target(self, start: int, stop: int) -> torch.Tensor | None:
        """Where the chunk's decoded elements go when none is padding; else ``None``."""
        return self.region[start:stop] if stop <= self.region.numel() else None

    def write(self, start: int, stop: int, values: torch.Tensor, add: bool) -> None:
        """Stores (or adds) the chunk's decoded values, dropping padding."""
        n = self.region.numel()
        part = self.region[min(start, n) : min(stop, n)]
        block = values[: part.numel()]
        part.add_(block) if add else part.copy_(block)


Region = Rows | Flat


def copy_in_parts(target: torch.Tensor, source: torch.Tensor) -> Callable[[int, int], None]:
    """
    The ``local`` work of :func:`start_exchange` that copies ``source`` into
    ``target`` (this rank's own block, which crosses no link) along dim 0, in
    as many parts as there are messages: copied whole before the first wait,
    it would hold it up (and, on two cores, gloo's sending threads). A call
    waited for later copies it whole before it returns, its sends posted.
    """

    def copy(part: int, parts: int) -> None:
        lo, hi = part * source.shape[0] // parts, (part + 1) * source.shape[0] // parts
        target[lo:hi].copy_(source[lo:hi])

    return copy


def start_exchange(
    sends: Sequence[tuple[list[int], Region]],
    recvs: Sequence[tuple[int, Region]],
    codings: PeerCodings,
    call: Call,
    dtype: torch.dtype,
    chunk_bytes: int | None,
    add: bool = False,
    local: Callable[[int, int], None] | None = None,
    background: bool = False,
    encoded: Callable[[torch.Tensor, torch.Tensor, Any], None] | None = None,
    before: Callable[[int | None], None] | None = None,
) -> Callable[[], None]:
    """
    Sends every region of ``sends`` (to its peers, which share one coding) and
    declares every receive of ``recvs`` (from its peer), each with the peer's
    coding of ``codings``, on ``call``'s transport; returns the function that
    receives, decodes and closes. ``local(i, n)``, where given, is this rank's
    own share of the work in ``n`` parts: the function runs part ``i`` before
    it waits for the ``i``-th message, so that the work fills the waits
    instead of delaying the first send. ``background``: a call waited for
    later, whose caller may change its tensors once it returns: the sends
    and ``local`` (whole, once every message is posted) read them before
    this returns, and where the transport
    moves its messages on its own, the receiving and decoding start now on
    the background thread (``_background``). ``encoded(x, wire, ctx)``, where
    given, hears of every chunk this call encodes, in sending order, for the
    caller's own record of it. ``before(peer)``, where given, runs before the
    first message of each peer is waited for (in the order of ``recvs``), and
    ``before(None)`` after the last. A disagreement or failure raises
    :class:`~qcomm.CodecError` on every rank.
    """
    transport, name = call.transport, call.name

    def cut(region: Region, coding: Coding) -> list[tuple[int, int]]:
        align = coding.alignment(transport.chunked)
        if align is None:
            return [(0, region.length)]
        return region.chunks(align, chunk_elements(region.length, chunk_bytes))

    def size_of(coding: Coding, start: int, stop: int) -> int:
        return quantized_sizes(coding.codec, coding.ctx, [stop - start])[0]

    def pieces(coding: Coding, region: Region) -> list[tuple[Region | None, int, int, int]]:
        return [(region, a, b, size_of(coding, a, b)) for a, b in cut(region, coding)]

    incoming: list[tuple[int, Region | None, int, int, int]] = [
        (peer, *piece) for peer, into in recvs for piece in pieces(codings[peer], into)
    ]
    outgoing: list[tuple[list[int], Region | None, int, int, int]] = []
    for to, sent in sends:
        coding = codings[to[0]]
        if any(codings[p] is not coding for p in to):
            raise AssertionError("qcomm: a region sent to several peers goes with one coding")
        outgoing += [(to, *piece) for piece in pieces(coding, sent)]
    peers = [p for p in range(transport.world) if p != transport.rank]
    # Every pair exchanges at least its statuses, so that every rank hears
    # from every peer whether its call went well.
    outgoing += [([p], None, 0, 0, 0) for p in peers if not any(p in o[0] for o in outgoing)]
    incoming += [(p, None, 0, 0, 0) for p in peers if not any(p == i[0] for i in incoming)]
    last_out = {p: i for i, (to, *_) in enumerate(outgoing) for p in to}
    last_in = {i[0]: n for n, i in enumerate(incoming)}
    flows = _flows(peers, incoming, outgoing)

    def encode(
        coding: Coding, region: Region | None, start: int, stop: int, size: int
    ) -> torch.Tensor:
        if region is None:
            return torch.empty(0, dtype=coding.wire_dtype, device=transport.device)
        chunk = region.read(start, stop)
        if coding.identity:
            return chunk
        codec = coding.codec
        x = encodable(chunk, codec)
        wire = checked_encode(codec, coding.ctx, x, size, coding.wire_dtype)
        if encoded is not None:
            encoded(x, wire, coding.ctx)
        return wire

    # A call waited for later leaves its caller free to change its tensors
    # once it returns, but the point-to-point transport reads a wire while
    # gloo sends it: a chunk sent before the last that is the caller's
    # memory (no-op coding) goes as a copy, all of them in one kept buffer.
    # (A peer's last chunk is copied anyway, joined with its status.)
    lent = background and transport.moves_alone
    copies = 0
    if lent:
        copies = sum(
            size
            for i, (to, region, _, _, size) in enumerate(outgoing)
            if region is not None and codings[to[0]].identity and any(last_out[p] != i for p in to)
        )
    stage = transport.hold(_buffers.take(copies, dtype, transport.device)) if copies else None
    staged = 0

    def lend(wire: torch.Tensor, region: Region | None) -> torch.Tensor:
        nonlocal staged
        if not _reads(wire, region):
            return wire
        if stage is None or staged + wire.numel() > stage.numel() or wire.dtype != dtype:
            return wire.clone()  # a codec that hands its input back
        copy = stage[staged : staged + wire.numel()]
        staged += wire.numel()
        return copy.copy_(wire)

    checked = call.checked and bool(peers)
    headers = _announce(peers, flows, codings, dtype, call) if checked else {}
    # Receives are posted at once, as this rank expects them (its headers
    # say so); a peer sends its data only once it has read them. A peer's
    # last message carries its status too: it lands in the shared buffer.
    pending = []
    for n, (peer, region, start, stop, size) in enumerate(incoming):
        coding = codings[peer]
        last = last_in[peer] == n
        into = None
        if region and coding.identity and not add and not last:
            into = region.target(start, stop)
        if into is not None and not into.is_contiguous():
            into = None
        extra = _header.status_elements(coding.wire_dtype) if last else 0
        handle = transport.expect(peer, size + extra, coding.wire_dtype, into)
        pending.append((peer, handle, region, start, stop, size if last else None))
    transport.start()
    failure: Exception | None = None
    held: dict[int, torch.Tensor] = {}
    try:
        agreed, disagreement, someone_failed = (
            _check(headers, transport, name) if checked else (set(peers), None, False)
        )
        if someone_failed and not transport.chunked:
            # A rank that failed before the call never joins the all-to-all:
            # neither does any other (each has its header).
            transport.abandon()
            raise disagreement or CodecError(f"{name}: a peer failed")
        failure = disagreement
        for i, (to, region, start, stop, size) in enumerate(outgoing):
            targets = [p for p in to if p in agreed]
            if not targets:
                continue
            coding = codings[to[0]]
            if failure is None:
                try:
                    wire = encode(coding, region, start, stop, size)
                except Exception as err:
                    failure = err
            if failure is not None:
                # The peers have posted receives of this size: fill them.
                wire = torch.zeros(size, dtype=coding.wire_dtype, device=transport.device)
            if lent and any(last_out[p] != i for p in targets):
                wire = lend(wire, region)
            for peer in targets:
                if last_out[peer] == i:
                    # Sent once every chunk is encoded, with the status of
                    # the whole call: a peer never hears "ok" from a rank
                    # that then fails on another peer's data.
                    held[peer] = wire
                else:
                    transport.send(peer, wire)
        for peer, wire in held.items():
            own = _identity(name, transport.number, codings[peer], dtype, flows[peer][0])
            transport.send(peer, wire, _header.status(failure is None, own))
        transport.flush()
    except BaseException:
        transport.abandon()
        raise
    if failure is not None:
        transport.abandon()
        raise failure
    if background and local is not None:
        # The caller may refill its input once the call returns: the own
        # block is copied now, its messages already on their way.
        local(0, 1)
        local = None
    pending = [item for item in pending if item[0] in agreed]
    expected = {
        p: _identity(name, transport.number, codings[p], dtype, flows[p][1]) for p in agreed
    }
    statuses: dict[int, bytes | torch.Tensor] = {}

    def status_problems() -> str | None:
        # One read of every status: on a GPU, the one host synchronisation
        # of the call, where wait() waits anyway.
        if not statuses:
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
        width = _header.STATUS_BYTES
        said = [
            problem
            for i, p in enumerate(order)
            if (problem := _header.status_problem(blobs[i * width :], expected[p], p))
        ]
        if not said:
            return None
        return f"{name}: {'; '.join(said)}, so this rank's result is void"

    def finish() -> None:
        parts = max(1, len(pending))
        try:
            for n, (peer, handle, region, start, stop, last_size) in enumerate(pending):
                if local is not None:
                    local(n, parts)
                if before is not None and (n == 0 or pending[n - 1][0] != peer):
                    before(peer)
                wire = transport.received(handle)
                if last_size is not None:
                    statuses[peer] = transport.trailer_of(handle, last_size)
                    wire = wire[:last_size]
                if region is None:
                    continue
                try:
                    _decode(codings[peer], wire, region, start, stop)
                except Exception:
                    # A peer that failed sent zeros: say so rather than
                    # what decoding them did.
                    _receive_statuses()
                    if why := status_problems():
                        raise CodecError(why) from None
                    raise
            if local is not None and not pending:
                local(0, 1)
            if before is not None:
                before(None)
            if why := status_problems():
                raise CodecError(why)
        except BaseException:
            transport.abandon()
            raise
        transport.close()

    def _receive_statuses() -> None:
        for peer, handle, _, _, _, last_size in pending:
            if last_size is not None and peer not in statuses:
                transport.received(handle)
                statuses[peer] = transport.trailer_of(handle, last_size)

    def _decode(coding: Coding, wire: torch.Tensor, region: Region, start: int, stop: int) -> None:
        target = region.target(start, stop)
        if coding.identity:
            if target is None or wire.data_ptr() != target.data_ptr():
                region.write(start, stop, wire, add)
        elif (
            coding.decode_into is not None
            and not add
            and target is not None
            and target.dtype == torch.float32
        ):
            checked_decode(coding.codec, coding.ctx, wire, stop - start, into=target)
        else:
            decoded = checked_decode(coding.codec, coding.ctx, wire, stop - start)
            region.write(start, stop, decoded, add)

    if background and transport.moves_alone:
        return _background.later(finish)
    return finish


def _reads(wire: torch.Tensor, region: Region | None) -> bool:
    """Whether ``wire`` is the memory of ``region`` itself (no-op coding, or a codec that hands its input back)."""
    if region is None or not wire.numel():
        return False
    return bool(wire.untyped_storage().data_ptr() == region.region.untyped_storage().data_ptr())


def _identity(
    name: str, number: int, coding: Coding, dtype: torch.dtype, flow: _header.Flow
) -> int:
    """What a status says of the call between two ranks (see :func:`_header.identity`)."""
    return _header.identity(name, number, coding.print, str(dtype), flow)


def _flows(
    peers: list[int],
    incoming: list[tuple[int, Region | None, int, int, int]],
    outgoing: list[tuple[list[int], Region | None, int, int, int]],
) -> dict[int, tuple[_header.Flow, _header.Flow]]:
    """What this rank sends each peer and expects from it: elements and chunk wire sizes."""
    sends: dict[int, list[Any]] = {p: [0, []] for p in peers}
    expects: dict[int, list[Any]] = {p: [0, []] for p in peers}
    for to, region, start, stop, size in outgoing:
        for p in to:
            if region is not None:
                sends[p][0] += stop - start
                sends[p][1].append(size)
    for p, region, start, stop, size in incoming:
        if region is not None:
            expects[p][0] += stop - start
            expects[p][1].append(size)
    return {
        p: (
            _header.Flow(sends[p][0], tuple(sends[p][1])),
            _header.Flow(expects[p][0], tuple(expects[p][1])),
        )
        for p in peers
    }


def _announce(
    peers: list[int],
    flows: dict[int, tuple[_header.Flow, _header.Flow]],
    codings: PeerCodings,
    dtype: torch.dtype,
    call: Call,
) -> dict[int, tuple[_header.Header, Any]]:
    """Sends this rank's header to every peer (with that peer's coding) and posts theirs."""
    headers = {}
    transport = call.transport
    for p in peers:
        sent, expected = flows[p]
        coding = codings[p]
        mine = _header.Header(
            _header.OK, call.name, coding.print, str(dtype), sent, expected, coding.name
        )
        headers[p] = (mine, transport.expect_control(p))
    for p in peers:
        transport.send_control(p, headers[p][0].pack())
    call.announced = True
    return headers


def _check(
    headers: dict[int, tuple[_header.Header, Any]], transport: Transport, call: str
) -> tuple[set[int], CodecError | None, bool]:
    """Reads every peer's header: the peers that agree, what differs, and whether one failed."""
    blobs = {p: transport.control(handle) for p, (_, handle) in headers.items()}
    said = {
        p: _header.problems(mine, p, transport.rank, blobs[p]) for p, (mine, _) in headers.items()
    }
    for p, problems in said.items():
        if problems:
            # The peer saw the same difference (or failed): nothing more
            # travels between the two, and nothing waits for it.
            transport.forget(p)
    wrong = [text for problems in said.values() for text in problems]
    agreed = {p for p, problems in said.items() if not problems}
    failed = any(_header.failed(blob) for blob in blobs.values())
    return agreed, CodecError(f"{call}: {'; '.join(wrong)}") if wrong else None, failed
