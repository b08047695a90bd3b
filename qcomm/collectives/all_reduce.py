r"""
The all-reduce of a flat buffer with codecs, which the DDP communication hook
(:func:`~qcomm.ddp_comm_hook`) runs on every gradient bucket: an encoded
reduce-scatter, then an encoded all-gather, on the exchange of the other
collectives. See :doc:`ddp` for the steps, their error bound and error
feedback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._args import check_chunk_bytes, check_codec, check_input, resolve_codecs
from qcomm.collectives._blocks import _every_codec, granule, layout, split_blocks
from qcomm.collectives._buffers import lease
from qcomm.collectives._call import Call, begin
from qcomm.collectives._coding import is_identity, uniform
from qcomm.collectives._exchange import Flat, recv_order, send_order, start_exchange
from qcomm.collectives._hosts import ByHost, host_of_ranks
from qcomm.collectives._wire import checked_decode
from qcomm.types import HostCodecs, NoOpQuantizedCommCodec

__all__ = ["Residuals", "all_reduce", "granule", "layout"]


@dataclasses.dataclass
class Residuals:
    r"""
    What the codecs lost on one buffer, added back on the next call (error
    feedback); :func:`all_reduce` fills empty ones with zeros.

    Args:
        scatter (Tensor, optional): float32, as long as the buffer: what the
            reduce-scatter codec lost of every block this rank sent.
            Default: ``None``.
        gather (Tensor, optional): float32, as long as this rank's block:
            what the all-gather codec lost of its shard. Default: ``None``.
    """

    scatter: torch.Tensor | None = None
    gather: torch.Tensor | None = None


class _Sink:
    """Where the decoded values of one sent region go, and its residual."""

    def __init__(
        self, length: int, padded: int, out: torch.Tensor | None, residual: torch.Tensor | None
    ) -> None:
        self.length = length
        self.padded = padded
        self.out = out
        self.residual = residual


class _Record:
    """
    What one exchange of one call encodes (told by the exchange, chunk by
    chunk), for :meth:`drain` to decode into the sinks. Each call keeps its
    own: a codec object may serve calls on other threads and groups at once.
    """

    def __init__(self, codec: Any, sinks: list[_Sink]) -> None:
        self._codec = codec
        #: where the chunks go, in sending order
        self._sinks = sinks
        self._encoded: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

    def keep(self, x: torch.Tensor, wire: torch.Tensor, ctx: Any) -> None:
        self._encoded.append((x, wire, ctx))

    def _into(self, out: torch.Tensor) -> bool:
        return out.dtype == torch.float32 and getattr(self._codec, "decode_into", None) is not None

    def drain(self) -> None:
        """Decodes every chunk encoded, in order, into the sinks (once the sends are out)."""
        encoded, self._encoded = self._encoded, []
        sinks = self._sinks
        index, offset = 0, 0
        for x, wire, ctx in encoded:
            n = x.numel()
            while index < len(sinks) and offset == sinks[index].padded:
                index, offset = index + 1, 0
            if index == len(sinks) or offset + n > sinks[index].padded:
                raise RuntimeError("qcomm: the exchange encoded chunks it had not declared")
            sink = sinks[index]
            lo, hi = offset, min(offset + n, sink.length)
            offset += n
            if hi <= lo:
                continue
            out = sink.out[lo:hi] if sink.out is not None else None
            if out is not None and sink.residual is None and hi - lo == n and self._into(out):
                checked_decode(self._codec, ctx, wire.reshape(-1), n, into=out)
                continue
            decoded = checked_decode(self._codec, ctx, wire.reshape(-1), n)[: hi - lo]
            if out is not None and out.dtype != decoded.dtype:
                # Rounded as it will be stored (by every rank alike), so that
                # the residual carries the rounding too.
                decoded = decoded.to(out.dtype).to(decoded.dtype)
            if sink.residual is not None:
                # Before the output, which may be where the chunk was read from.
                # A NaN or an infinity is not carried into later calls.
                residual = sink.residual[lo:hi]
                torch.sub(x.reshape(-1)[: hi - lo], decoded, out=residual)
                residual.nan_to_num_(0.0, 0.0, 0.0)
            if out is not None:
                out.copy_(decoded)
        left = sum(s.padded for s in sinks[index + 1 :])
        if left or (sinks and offset != sinks[index].padded):
            raise RuntimeError("qcomm: the exchange encoded fewer chunks than it declared")


def _mark_infinities(x: torch.Tensor) -> None:
    """Turns infinities into NaN, in place and without a host synchronisation."""
    # A codec may saturate an infinity into a finite value (fp16 and bf16 do,
    # as fbgemm's); the built-in codecs all keep NaN. 0 * inf is NaN.
    x.add_(x, alpha=0)


def _check_residuals(residuals: Residuals, numel: int, own: int, device: torch.device) -> None:
    """Fills in empty residuals with zeros and checks the others."""
    for name, size in (("scatter", numel), ("gather", own)):
        value = getattr(residuals, name)
        if value is None:
            setattr(residuals, name, torch.zeros(size, device=device))
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"residuals.{name}: expected a float32 tensor, got {got}")
        if value.numel() != size:
            raise ValueError(
                f"residuals.{name}: expected {size} elements for this buffer and rank, "
                f"got {value.numel()}"
            )
        if value.device != device or not value.is_contiguous() or value.dim() != 1:
            setattr(residuals, name, value.to(device).contiguous().view(-1))


def all_reduce(
    buffer: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    reduce_codec: Any | None = None,
    gather_codec: Any | None = None,
    average: bool = False,
    residuals: Residuals | None = None,
    chunk_bytes: int | None = None,
    by_host: HostCodecs | None = None,
) -> torch.Tensor:
    r"""
    all_reduce(buffer, *, group=None, reduce_codec=None, gather_codec=None, average=False, residuals=None, chunk_bytes=None, by_host=None) -> Tensor

    Sums (or averages) a 1-D buffer over the ranks in place: an encoded
    reduce-scatter, then an encoded all-gather. With ``by_host``, on hosts
    with equal numbers of ranks, it is hierarchical: a reduce-scatter inside
    each host, a reduce-scatter and an all-gather of each rank's block
    between hosts, an all-gather inside each host (see :doc:`topology`).

    Every rank ends with the same values, each off the exact sum by at most
    what the codecs' bounds allow (see :class:`~qcomm.CodecInfo` and
    :doc:`ddp`). An infinity or NaN on any rank leaves that place not finite
    on every rank, with codecs that keep NaN as the built-in ones do. With
    ``residuals``, what each codec lost is added to what this rank sends from
    the same place on the next call (error feedback).

    .. note::
        Every rank of ``group`` must make the same calls, in the same order,
        with buffers of the same length and dtype, the same codecs and the
        same ``average``, ``chunk_bytes`` and use of ``residuals``; the
        first call on each group checks that they do, as the other
        collectives do. The call returns when the buffer holds the result.

    Args:
        buffer (Tensor): 1-D contiguous floating-point tensor; overwritten.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        reduce_codec (QuantizedCommCodec, optional): the reduce-scatter's
            codec. Default: ``None`` (the no-op codec: the buffer's dtype travels).
        gather_codec (QuantizedCommCodec, optional): the all-gather's codec.
            Default: ``None`` (the no-op codec).
        average (bool, optional): divide the sum by the world size.
            Default: ``False``.
        residuals (Residuals, optional): error feedback state of this buffer,
            filled in on first use, emptied when a call fails and left empty
            when both codecs are the no-op codec. Default: ``None`` (no error
            feedback).
        chunk_bytes (int, optional): the exchanges' chunk size, as for the
            collectives. Default: ``None`` (automatic).
        by_host (HostCodecs, optional): codecs by host, instead of
            ``reduce_codec`` and ``gather_codec``: each pair's forward codec
            reduces, its backward codec gathers; error feedback applies
            between hosts only. Default: ``None``.

    Returns:
        Tensor: ``buffer``, holding the result.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if ``buffer`` is not 1-D and contiguous, ``chunk_bytes``
            is not positive, or ``residuals`` does not fit the buffer.
        CodecError: if a codec fails or breaks its contract, on this rank or
            another, or the ranks' calls disagree (checked as for the other
            collectives: see :mod:`qcomm.collectives`).

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> all_reduce(torch.ones(4), average=True).tolist()
        [1.0, 1.0, 1.0, 1.0]
        >>> dist.destroy_process_group()
    """
    with begin("all_reduce", group, buffer, "all_reduce") as call:
        rank, world = call.rank, call.world
        with call.agreement as agree:
            check_input(buffer, "buffer", call.backend, ndim=1)
            if not buffer.is_contiguous():
                raise ValueError("buffer: expected a contiguous tensor")
            if not isinstance(average, bool):
                raise TypeError(
                    f"average: expected a bool, got {type(average).__name__} {average!r}"
                )
            if residuals is not None and not isinstance(residuals, Residuals):
                raise TypeError(
                    f"residuals: expected a Residuals or None, got {type(residuals).__name__}"
                )
            chunk = check_chunk_bytes(chunk_bytes)
            reduce, gather = _codecs(reduce_codec, gather_codec, by_host, buffer.dtype, call)
            every = _every_codec(reduce) + _every_codec(gather)
            bounds = split_blocks(buffer.numel(), world, reduce, gather)
            if all(is_identity(codec, buffer.dtype) for codec in every):
                residuals = None  # nothing is lost, nothing to keep
            if residuals is not None:
                own = bounds[rank + 1] - bounds[rank]
                _check_residuals(residuals, buffer.numel(), own, buffer.device)
            agree.same("buffer", f"{buffer.numel()} elements of {buffer.dtype}")
            agree.same("reduce_codec", reduce)
            agree.same("gather_codec", gather)
            agree.same("average", str(average))
            agree.same("residuals", "error feedback" if residuals is not None else "none")
            agree.same("chunk_bytes", [chunk or 0])
        if world == 1 or buffer.numel() == 0:
            return buffer  # nothing to move: no communication at all
        try:
            steps = _steps(reduce, gather, call)
            work = buffer
            if len(steps) > 2 and buffer.dtype not in (torch.float32, torch.float64):
                # Sums between the steps stay in float32, as in one step.
                work = buffer.float()
            state = _Call(work, call, bounds, residuals, chunk)
            for step in steps:
                if step.gather:
                    state.all_gather(step, world if average and step.divides else 1)
                else:
                    state.reduce_scatter(step)
            if work is not buffer:
                buffer.copy_(work)
        except BaseException:
            call.abandon()
            if residuals is not None:
                residuals.scatter = residuals.gather = None
            raise
    return buffer


def _codecs(
    reduce_codec: Any, gather_codec: Any, by_host: Any, dtype: torch.dtype, call: Call
) -> tuple[Any, Any]:
    """The checked reduce-scatter and all-gather codecs (each a :class:`~._hosts.ByHost` for ``by_host``)."""
    if by_host is not None:
        if not isinstance(by_host, HostCodecs):
            raise TypeError(
                f"by_host: expected a qcomm.HostCodecs or None, got {type(by_host).__name__}"
            )
        if reduce_codec is not None or gather_codec is not None:
            raise ValueError(
                "by_host: gives the codecs by host (forward: the reduce-scatter's, backward: "
                "the all-gather's); leave reduce_codec and gather_codec unset"
            )
        return resolve_codecs(by_host, dtype, call.backend)
    codecs = []
    for name, codec in (("reduce_codec", reduce_codec), ("gather_codec", gather_codec)):
        codec = NoOpQuantizedCommCodec(dtype) if codec is None else codec
        check_codec(codec, name, call.backend)
        codecs.append(codec)
    return codecs[0], codecs[1]


@dataclasses.dataclass
class _Step:
    """One exchange of an all-reduce: a reduce-scatter or an all-gather, among ``peers``."""

    gather: bool
    codec: Any
    peers: list[int]
    where: str = ""
    #: whether error feedback (the residuals) applies to it
    feedback: bool = True
    #: the blocks each peer (and this rank) sums or holds; default: its own
    blocks: dict[int, list[int]] | None = None
    #: whether an all-gather divides the sum first (for an average)
    divides: bool = True

    @property
    def name(self) -> str:
        return f"all_reduce {'all-gather' if self.gather else 'reduce-scatter'}{self.where}"


def _steps(reduce: Any, gather: Any, call: Call) -> list[_Step]:
    """
    The exchanges of the call: a reduce-scatter and an all-gather among all
    ranks, or, by host on hosts of equal size, four (see :doc:`topology`).
    """
    rank, world = call.rank, call.world
    everyone = send_order(rank, world)
    if not isinstance(reduce, ByHost):
        return [_Step(False, reduce, everyone), _Step(True, gather, everyone)]
    hosts = host_of_ranks(call.group, reduce.ranks_per_host, call.backend.device)
    members: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(r)
    sizes = {len(m) for m in members.values()}
    if len(members) == 1:
        return [_Step(False, reduce.same, everyone), _Step(True, gather.same, everyone)]
    if sizes == {1} or len(sizes) > 1:
        # One rank per host, or hosts of unequal sizes: flat, with one codec
        # for every peer (an all-gather must give every rank the same values).
        return [_Step(False, reduce.other, everyone), _Step(True, gather.other, everyone)]
    place = {r: members[hosts[r]].index(r) for r in range(world)}
    # Within the host, each peer sums the blocks of the ranks with its place.
    blocks = {q: [r for r in range(world) if place[r] == place[q]] for q in members[hosts[rank]]}
    in_host = [q for q in everyone if hosts[q] == hosts[rank]]
    across = [p for p in everyone if place[p] == place[rank]]
    return [
        _Step(False, reduce.same, in_host, " in host", feedback=False, blocks=blocks),
        _Step(False, reduce.other, across, " between hosts"),
        _Step(True, gather.other, across, " between hosts"),
        _Step(True, gather.same, in_host, " in host", False, blocks, divides=False),
    ]


class _Call:
    """
    The exchanges of one all-reduce on this rank, over the buffer's blocks
    (block ``r``: what rank ``r`` sums last). Each step exchanges with some
    peers only; ``blocks[p]`` are the blocks peer ``p`` sums in that step
    (default: its own).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        call: Call,
        bounds: list[int],
        residuals: Residuals | None,
        chunk_bytes: int | None,
    ) -> None:
        self.buffer = buffer
        self.call = call
        self.group = call.group
        self.rank = call.rank
        self.world = call.world
        self.bounds = bounds
        self.lengths = [bounds[r + 1] - bounds[r] for r in range(self.world)]
        self.residuals = residuals
        self.chunk_bytes = chunk_bytes
        #: the blocks this rank has summed (where a sum is not in place)
        self.sums: dict[int, torch.Tensor] = {}

    def block(self, r: int) -> torch.Tensor:
        return self.buffer[self.bounds[r] : self.bounds[r + 1]]

    def _of(self, blocks: dict[int, list[int]] | None, r: int) -> list[int]:
        return [b for b in (blocks[r] if blocks else [r]) if self.lengths[b]]

    def reduce_scatter(self, step: _Step) -> None:
        """Sends each peer its blocks, adds theirs of this rank's blocks (in float32 at least)."""
        rank, buf = self.rank, self.buffer
        codec, peers, blocks = step.codec, step.peers, step.blocks
        residuals = self.residuals if step.feedback else None
        identity = is_identity(codec, buf.dtype)
        coding = uniform(codec, self.world, buf.dtype)
        padded = coding[rank].padded(self.lengths, rank, buf.device)
        sent = [(p, b) for p in peers for b in self._of(blocks, p)]
        # What goes out of each block: the block itself, or with residuals,
        # block + residual, in float32 at least (in bfloat16 the sum would
        # round away most of the residual, and the loss be carried nowhere).
        out = {b: self.block(b) for _, b in sent}
        record = None
        if residuals is not None and not identity:
            assert residuals.scatter is not None
            sinks = []
            for _, b in sent:
                residual = residuals.scatter[self.bounds[b] : self.bounds[b + 1]]
                if buf.dtype.itemsize < 4:
                    out[b] = torch.add(out[b], residual)  # promoted to float32
                else:
                    out[b].add_(residual)
                sinks.append(_Sink(self.lengths[b], padded[b], None, residual))
            record = _Record(codec, sinks)
        if not identity:
            for x in out.values():
                _mark_infinities(x)
        # The sum runs in float32 at least: in place, in the blocks this rank
        # keeps (it sends them nowhere), or beside them for a narrower dtype.
        dtype = torch.promote_types(torch.float32, buf.dtype)
        kept = self._of(blocks, rank)
        sums = {b: self.sums.get(b, self.block(b)) for b in kept}
        if dtype != buf.dtype:
            sums = {b: lease((self.lengths[b],), dtype, buf.device) for b in kept}
        senders = [s for s in recv_order(rank, self.world) if s in peers]
        sends = [([p], Flat(out[b], padded[b])) for p, b in sent]
        recvs = [(s, Flat(sums[b], padded[b])) for s in senders for b in kept]
        finish = self._exchange(step, sends, recvs, coding, record, add=True)
        for b, total in sums.items():
            if total is not self.block(b):
                total.copy_(self.block(b))
        finish()
        self.sums = {b: t for b, t in sums.items() if t is not self.block(b)}

    def _exchange(
        self,
        step: _Step,
        sends: list[Any],
        recvs: list[Any],
        coding: Any,
        record: _Record | None,
        add: bool = False,
    ) -> Callable[[], None]:
        """Starts one of the call's exchanges, decodes what it encoded into the sinks
        (once the sends are out), and returns the function that finishes it."""
        self.call.next_exchange(step.name)
        finish = start_exchange(
            sends,
            recvs,
            coding,
            self.call,
            self.buffer.dtype,
            self.chunk_bytes,
            add=add,
            encoded=record.keep if record is not None else None,
        )
        if record is not None:
            record.drain()
        return finish

    def all_gather(self, step: _Step, divide: int) -> None:
        """Sends this rank's blocks (divided by ``divide``) to each peer and decodes theirs."""
        rank, buf = self.rank, self.buffer
        codec, peers, blocks = step.codec, step.peers, step.blocks
        identity = is_identity(codec, buf.dtype)
        # The owner takes the values its peers decode, once its chunks
        # (perhaps read from its blocks) are encoded and sent.
        coding = uniform(codec, self.world, buf.dtype)
        padded = coding[rank].padded(self.lengths, rank, buf.device)
        residual = self.residuals.gather if self.residuals is not None and step.feedback else None
        shards = []
        sinks = []
        for b in self._of(blocks, rank):
            mine = self.block(b)
            shard = self.sums.pop(b, mine)
            if divide > 1:
                shard.div_(divide)
            if identity:
                if shard is not mine:
                    mine.copy_(shard)
                shard = mine
            else:
                if shard.dtype != torch.float32:
                    shard = shard.float()
                if residual is not None:
                    shard.add_(residual)
                _mark_infinities(shard)
            shards.append((b, shard))
            sinks.append(_Sink(len(mine), padded[b], mine, residual if not identity else None))
        record = None if identity else _Record(codec, sinks)
        sends = [(peers, Flat(shard, padded[b])) for b, shard in shards] if peers else []
        senders = [s for s in recv_order(rank, self.world) if s in peers]
        recvs = [(s, Flat(self.block(b), padded[b])) for s in senders for b in self._of(blocks, s)]
        self._exchange(step, sends, recvs, coding, record)()
