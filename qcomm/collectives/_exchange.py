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

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from qcomm.collectives import _background, _buffers
from qcomm.collectives._call import Call
from qcomm.collectives._coding import Coding, PeerCodings, collective_of
from qcomm.collectives._header import Flow
from qcomm.collectives._measure import Finished, Meter, measuring, slots_of
from qcomm.collectives._protocol import Flows, Protocol
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
# Data that travels as it is (the no-op codec) has no encoding to hide: its
# chunks only let the receiver store one while the next arrives, and on an
# emulated 1 Gbit/s link (64 MiB per rank, 2 ranks) 4 chunks per peer took
# 1.05-1.06x the bare exchange in every run where 8 took 1.05-1.17x.
_MAX_IDENTITY_CHUNKS = 4
# A call waited for later is finished on the background thread only where
# it receives at least this many elements: handing it over costs two thread
# switches (tens of microseconds, a 4 ms scheduler tick on a busy machine),
# more than receiving and decoding a small call leave for wait() to do.
# Measured on loopback (docs/collectives.rst, "The per-call floor").
_HAND_OFF = 1 << 18


def chunk_elements(length: int, chunk_bytes: int | None, identity: bool = False) -> int:
    """
    Elements per chunk: ``chunk_bytes // 4`` (float32 bytes on all ranks), or
    automatic (fewer for data that travels as it is, ``identity``).
    """
    if chunk_bytes is not None:
        return max(1, chunk_bytes // 4)
    if length <= _SMALL:
        return max(1, length)
    return max(_SMALL, -(-length // (_MAX_IDENTITY_CHUNKS if identity else _MAX_CHUNKS)))


def offsets(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid end to end, and the total."""
    return list(itertools.accumulate(sizes, initial=0))


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
        if self.padded == 0 or (start == 0 and stop == self.length):
            # No columns (one empty chunk holds every row), or every row.
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
        copy_block(target, source, lo, hi)

    return copy


def copy_block(target: torch.Tensor, source: torch.Tensor, lo: int, hi: int) -> None:
    """Copies rows ``lo:hi`` of ``source`` into ``target`` (a part of the own block)."""
    if lo == 0 and hi == source.shape[0]:  # whole: one step, not two slices and a copy
        target.copy_(source)
    else:
        target[lo:hi].copy_(source[lo:hi])


class Piece(NamedTuple):
    """
    One message's data: wire-layout elements ``[start, stop)`` of ``region``,
    ``size`` elements on the wire. ``region`` ``None``: a message with no
    data, which carries a status only (every pair of ranks exchanges one).
    """

    region: Region | None
    start: int
    stop: int
    size: int


class Send(NamedTuple):
    """A piece sent to the peers ``to``, which share one coding."""

    to: list[int]
    piece: Piece


class Receive(NamedTuple):
    """A piece received from ``peer``."""

    peer: int
    piece: Piece


class Posted(NamedTuple):
    """A receive posted on the transport: where it lands, and whether it is the peer's last."""

    peer: int
    handle: Any
    piece: Piece
    last: bool


class Plan(NamedTuple):
    """
    The messages of an exchange, in sending and receiving order, and the
    index of the last one to and from each peer (the one with a status).
    ``flows``: what travels each way, by peer, where known from the shape
    alone (every coding a no-op's), else ``None`` (see :func:`_flows`);
    ``early``: the sends that are not the last to one of their peers;
    ``received``: the elements received (padding included).
    """

    sends: list[Send]
    receives: list[Receive]
    peers: list[int]
    last_out: dict[int, int]
    last_in: dict[int, int]
    flows: dict[int, Flows] | None = None
    early: frozenset[int] = frozenset()
    received: int = 0


#: ``encoded(piece, x, wire, ctx)``: the caller's hook that hears of every
#: chunk an exchange encodes (``x``: the codec's input, ``wire``: its output).
Encoded = Callable[[Piece, torch.Tensor, torch.Tensor, Any], None]

_NOTHING = Piece(None, 0, 0, 0)


class _Shape(NamedTuple):
    """
    A plan without its tensors: each message's ``(peers or peer, region
    index, start, stop)`` (index -1: a status alone), the rest of :class:`Plan`.
    Shared by the plans made from it, which read it only.
    """

    sends: list[tuple[list[int], int, int, int]]
    receives: list[tuple[int, int, int, int]]
    peers: list[int]
    last_out: dict[int, int]
    last_in: dict[int, int]
    flows: dict[int, Flows] | None
    early: frozenset[int]
    received: int


# Plans kept by shape (the regions' kinds and sizes, their codings'
# alignment, the transport): a call of a shape seen before binds its regions
# to the kept cuts instead of cutting every region and laying the plan out
# again, which on a small call is a tenth of its Python. The oldest goes
# beyond _KEEP_SHAPES.
_shapes: dict[tuple[Any, ...], _Shape] = {}
_shapes_lock = threading.Lock()
_KEEP_SHAPES = 64


def plan(
    sends: Sequence[tuple[list[int], Region]],
    recvs: Sequence[tuple[int, Region]],
    codings: PeerCodings,
    transport: Transport,
    chunk_bytes: int | None,
) -> Plan:
    """The chunks of every region sent and received (see :func:`start_exchange`)."""
    chunked, by = transport.chunked, codings.by_rank
    how = {id(c): (c.alignment(chunked), c.identity) for c in codings.distinct}
    key = (
        transport.rank,
        transport.world,
        chunked,
        chunk_bytes,
        tuple([(*to, -1, type(r), r.length, r.padded, how[id(by[to[0]])]) for to, r in sends]),
        tuple([(p, type(r), r.length, r.padded, how[id(by[p])]) for p, r in recvs]),
    )
    shape = _shapes.get(key)
    if shape is None:
        shape = _shape(sends, recvs, codings, transport, chunk_bytes)
        with _shapes_lock:  # calls may come from several threads (DDP's hook)
            if len(_shapes) >= _KEEP_SHAPES:
                del _shapes[next(iter(_shapes))]
            _shapes[key] = shape
    out = [Send(to, _piece(sends, i, a, b, by[to[0]])) for to, i, a, b in shape.sends]
    receives = [Receive(p, _piece(recvs, i, a, b, by[p])) for p, i, a, b in shape.receives]
    return Plan(out, receives, *shape[2:])


def _piece(
    given: Sequence[tuple[Any, Region]], index: int, start: int, stop: int, coding: Coding
) -> Piece:
    """
    The piece ``[start, stop)`` of the region of ``given[index]`` (a send's
    or a receive's; -1: a status alone), its wire size by ``coding``.
    """
    if index < 0:
        return _NOTHING
    if coding.identity:  # the wire is the data
        return Piece(given[index][1], start, stop, stop - start)
    size = quantized_sizes(coding.codec, coding.ctx, [stop - start])[0]
    return Piece(given[index][1], start, stop, size)


def _shape(
    sends: Sequence[tuple[list[int], Region]],
    recvs: Sequence[tuple[int, Region]],
    codings: PeerCodings,
    transport: Transport,
    chunk_bytes: int | None,
) -> _Shape:
    """The :class:`_Shape` of an exchange (see :func:`plan`)."""

    def cuts(coding: Coding, region: Region) -> list[tuple[int, int]]:
        align = coding.alignment(transport.chunked)
        if align is None:
            return [(0, region.length)]
        step = chunk_elements(region.length, chunk_bytes, coding.identity)
        return region.chunks(align, step)

    receives = [
        (peer, n, a, b)
        for n, (peer, into) in enumerate(recvs)
        for a, b in cuts(codings[peer], into)
    ]
    out: list[tuple[list[int], int, int, int]] = []
    for n, (to, region) in enumerate(sends):
        coding = codings[to[0]]
        if any(codings[p] is not coding for p in to):
            raise AssertionError("qcomm: a region sent to several peers goes with one coding")
        out += [(list(to), n, a, b) for a, b in cuts(coding, region)]
    peers = [p for p in range(transport.world) if p != transport.rank]
    # Every pair exchanges at least its statuses, so that every rank hears
    # from every peer whether its call went well.
    out += [([p], -1, 0, 0) for p in peers if not any(p in s[0] for s in out)]
    receives += [(p, -1, 0, 0) for p in peers if not any(p == r[0] for r in receives)]
    last_out = {p: i for i, s in enumerate(out) for p in s[0]}
    last_in = {r[0]: n for n, r in enumerate(receives)}
    early = frozenset(i for i, s in enumerate(out) if any(last_out[p] != i for p in s[0]))
    received = sum(b - a for _, i, a, b in receives if i >= 0)
    flows = None
    if all(c.identity for c in codings.distinct):
        # A no-op coding's wire is its data: the flows follow from the cuts.
        flows = _flows_of(
            peers,
            [(to, b - a, b - a) for to, i, a, b in out if i >= 0],
            [(p, b - a, b - a) for p, i, a, b in receives if i >= 0],
        )
    return _Shape(out, receives, peers, last_out, last_in, flows, early, received)


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
    encoded: Encoded | None = None,
    before: Callable[[int | None], None] | None = None,
    sent: Callable[[], None] | None = None,
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
    this returns, and where the transport moves its messages on its own and
    the call receives at least ``_HAND_OFF`` elements, the receiving and
    decoding start now on the background thread (``_background``).
    ``encoded`` (see
    :data:`Encoded`), where given, hears of every chunk this call encodes,
    with its :class:`Piece`, for the caller's own record of it; ``sent()``,
    where given, runs once every message is sent. ``before(peer)``,
    where given, runs before the first message of each peer is waited for
    (in the order of ``recvs``), and ``before(None)`` after the last. The
    checks between the ranks are :class:`~._protocol.Protocol`'s. A
    disagreement or failure raises :class:`~qcomm.CodecError` on every rank.
    """
    transport = call.transport
    steps = plan(sends, recvs, codings, transport, chunk_bytes)
    finish = _Receiver(steps, codings, transport, add, before)
    lender = None
    if background and transport.moves_alone and steps.early:
        lender = _Lender(steps, codings)
    # A call that encodes has slots for its errors in its statuses; it
    # measures them where asked (see _measure.measuring).
    slots = [slots_of(side) for side in codings.sides]
    on = measuring(codings.sides) if any(slots) else []
    meter = Meter(codings, steps.sends, dtype, slots, on) if any(on) else None
    flows = steps.flows if steps.flows is not None else _flows(steps)
    protocol = Protocol(call, codings, dtype, flows, sum(slots))
    if lender is not None and lender.copies:
        stage = _buffers.take(lender.copies, lender.dtype, transport.device)
        lender.stage = transport.hold(stage)
    protocol.announce()
    # Receives are posted at once, as this rank expects them (its headers
    # say so); a peer sends its data only once it has read them.
    finish.post(protocol)
    transport.start()
    try:
        agreed, disagreement = protocol.agree()
        failure = _send(
            steps, agreed, disagreement, codings, transport, protocol, lender, encoded, meter
        )
        errors = _errors(meter) if failure is None and meter is not None else None
        protocol.release(failure is None, errors)
        transport.flush()
    except BaseException:
        transport.abandon()
        raise
    if failure is not None:
        transport.abandon()
        raise failure
    if sent is not None:
        sent()
    if background and local is not None:
        # The caller may refill its input once the call returns: the own
        # block is copied now, its messages already on their way.
        local(0, 1)
        local = None
    finish.keep(agreed, local)
    done: Callable[[], None] = finish
    if background and transport.moves_alone and steps.received >= _HAND_OFF:
        done = _background.later(finish)
    if meter is None:
        return done
    return Finished(done, meter, protocol, call, collective_of(call.name))


def _errors(meter: Meter | None) -> list[float] | torch.Tensor | None:
    """The errors ``meter`` measured (NaN where measuring itself failed: the call goes on)."""
    if meter is None:
        return None
    try:
        return meter.errors()
    except Exception:  # noqa: BLE001 - a figure is missing, never the data
        return None


class _Lender:
    """
    A call waited for later leaves its caller free to change its tensors
    once it returns, but the point-to-point transport reads a wire while
    gloo sends it: a chunk sent before the last that is the caller's memory
    (no-op coding) goes as a copy, all of them in one kept buffer,
    :attr:`stage`. (A peer's last chunk is copied anyway, joined with its
    status.)
    """

    def __init__(self, steps: Plan, codings: PeerCodings) -> None:
        lent = [
            s
            for i, s in enumerate(steps.sends)
            if i in steps.early and s.piece.region is not None and codings[s.to[0]].identity
        ]
        #: elements to copy, and their dtype (a no-op coding's wire is the data)
        self.copies = sum(s.piece.size for s in lent)
        self.dtype = codings[lent[0].to[0]].wire_dtype if lent else torch.float32
        self.stage: torch.Tensor | None = None
        self._staged = 0

    def lend(self, wire: torch.Tensor, region: Region | None) -> torch.Tensor:
        """``wire``, or a copy of it where it is the memory of ``region``."""
        if not _reads(wire, region):
            return wire
        stage, staged = self.stage, self._staged
        if stage is None or staged + wire.numel() > stage.numel() or wire.dtype != stage.dtype:
            return wire.clone()  # a codec that hands its input back
        self._staged += wire.numel()
        return stage[staged : staged + wire.numel()].copy_(wire)


def _send(
    steps: Plan,
    agreed: set[int],
    failure: Exception | None,
    codings: PeerCodings,
    transport: Transport,
    protocol: Protocol,
    lender: _Lender | None,
    encoded: Encoded | None,
    meter: Meter | None,
) -> Exception | None:
    """Encodes and sends every piece to the agreeing peers; the call's failure, if any."""
    by = codings.by_rank
    for i, (to, piece) in enumerate(steps.sends):
        targets = [p for p in to if p in agreed]
        if not targets:
            continue
        coding = by[to[0]]
        if failure is None:
            try:
                wire = _encode(coding, piece, transport.device, encoded, meter)
            except Exception as err:
                failure = err
        if failure is not None:
            # The peers have posted receives of this size: fill them.
            wire = torch.zeros(piece.size, dtype=coding.wire_dtype, device=transport.device)
        if lender is not None and i in steps.early and any(steps.last_out[p] != i for p in targets):
            wire = lender.lend(wire, piece.region)
        for peer in targets:
            if steps.last_out[peer] == i:
                protocol.hold(peer, wire)
            else:
                transport.send(peer, wire)
    return failure


def _encode(
    coding: Coding,
    piece: Piece,
    device: torch.device,
    encoded: Encoded | None,
    meter: Meter | None,
) -> torch.Tensor:
    """The wire of one piece."""
    region = piece.region
    if region is None:
        return torch.zeros(0, dtype=coding.wire_dtype, device=device)
    chunk = region.read(piece.start, piece.stop)
    if coding.identity:
        return chunk
    x = encodable(chunk, coding.codec)
    wire = checked_encode(coding.codec, coding.ctx, x, piece.size, coding.wire_dtype)
    if encoded is not None:
        encoded(piece, x, wire, coding.ctx)
    if meter is not None:
        meter.take(coding, piece, x)
    return wire


class _Receiver:
    """
    The receiving end of an exchange: posts every receive (:meth:`post`),
    then, called, receives, decodes (or adds), reads the statuses and closes.
    """

    def __init__(
        self,
        steps: Plan,
        codings: PeerCodings,
        transport: Transport,
        add: bool,
        before: Callable[[int | None], None] | None,
    ) -> None:
        self._steps = steps
        self._codings = codings
        self._transport = transport
        self._add = add
        self._before = before
        self._local: Callable[[int, int], None] | None = None
        self._posted: list[Posted] = []
        # Where each message lands: straight into its region where it is
        # data of a no-op coding, not added and not a peer's last (which
        # carries a status too, and lands in the shared buffer).
        self._into: list[torch.Tensor | None] = []
        for n, (peer, piece) in enumerate(steps.receives):
            into = None
            if piece.region is not None and codings.by_rank[peer].identity and not add:
                if steps.last_in[peer] != n:
                    into = piece.region.target(piece.start, piece.stop)
            self._into.append(into if into is not None and into.is_contiguous() else None)

    def post(self, protocol: Protocol) -> None:
        """Posts every receive on the transport, telling ``protocol`` where the statuses land."""
        self._protocol = protocol
        by = self._codings.by_rank
        for n, (peer, piece) in enumerate(self._steps.receives):
            wire_dtype = by[peer].wire_dtype
            last = self._steps.last_in[peer] == n
            extra = protocol.status_elements(wire_dtype) if last else 0
            handle = self._transport.expect(peer, piece.size + extra, wire_dtype, self._into[n])
            if last:
                protocol.last_posted(peer, handle, piece.size)
            self._posted.append(Posted(peer, handle, piece, last))

    def keep(self, agreed: set[int], local: Callable[[int, int], None] | None) -> None:
        """Keeps the receives from ``agreed`` peers only; ``local``: see :func:`start_exchange`."""
        self._posted = [item for item in self._posted if item.peer in agreed]
        self._local = local

    def __call__(self) -> None:
        transport, protocol, pending = self._transport, self._protocol, self._posted
        local, before = self._local, self._before
        parts = max(1, len(pending))
        try:
            for n, (peer, handle, piece, last) in enumerate(pending):
                if local is not None:
                    local(n, parts)
                if before is not None and (n == 0 or pending[n - 1].peer != peer):
                    before(peer)
                wire = transport.received(handle)
                if last:
                    wire = protocol.last_received(peer, wire)
                if piece.region is None:
                    continue
                try:
                    _decode(self._codings.by_rank[peer], wire, piece, self._add)
                except Exception:
                    # A peer that failed sent zeros: say so rather than
                    # what decoding them did.
                    protocol.collect()
                    if why := protocol.verdict():
                        raise CodecError(why) from None
                    raise
            if local is not None and not pending:
                local(0, 1)
            if before is not None:
                before(None)
            if why := protocol.verdict():
                raise CodecError(why)
        except BaseException:
            transport.abandon()
            raise
        transport.close()


def _decode(coding: Coding, wire: torch.Tensor, piece: Piece, add: bool) -> None:
    """Stores (or adds) one received piece into its region."""
    region, start, stop, _ = piece
    assert region is not None
    target = region.target(start, stop)
    if coding.identity:
        if target is None:
            region.write(start, stop, wire, add)
        elif wire.data_ptr() != target.data_ptr():  # else it landed in place
            # No padding: the wire is the target's elements, in order.
            block = wire.view(target.shape)
            target.add_(block) if add else target.copy_(block)
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


def _reads(wire: torch.Tensor, region: Region | None) -> bool:
    """Whether ``wire`` is the memory of ``region`` itself (no-op coding, or a codec that hands its input back)."""
    if region is None or not wire.numel():
        return False
    return bool(wire.untyped_storage().data_ptr() == region.region.untyped_storage().data_ptr())


def _flows(steps: Plan) -> dict[int, Flows]:
    """What this rank sends each peer and expects from it: elements and chunk wire sizes."""
    return _flows_of(
        steps.peers,
        [(to, p.stop - p.start, p.size) for to, p in steps.sends if p.region is not None],
        [(peer, p.stop - p.start, p.size) for peer, p in steps.receives if p.region is not None],
    )


def _flows_of(
    peers: list[int],
    sends: list[tuple[list[int], int, int]],
    receives: list[tuple[int, int, int]],
) -> dict[int, Flows]:
    """
    :func:`_flows` from the data messages alone: each send's ``(peers,
    elements, wire size)`` and each receive's ``(peer, elements, wire size)``.
    """
    sent: dict[int, list[tuple[int, int]]] = {p: [] for p in peers}
    expected: dict[int, list[tuple[int, int]]] = {p: [] for p in peers}
    for to, elements, size in sends:
        for p in to:
            sent[p].append((elements, size))
    for peer, elements, size in receives:
        expected[peer].append((elements, size))
    return {p: Flows(_flow(sent[p]), _flow(expected[p])) for p in peers}


def _flow(messages: list[tuple[int, int]]) -> Flow:
    return Flow(sum(n for n, _ in messages), tuple(size for _, size in messages))
