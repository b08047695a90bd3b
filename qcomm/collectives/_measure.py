"""
Each call's error, measured where it is sent (docs/adaptive.rst): while an
exchange encodes, a :class:`Meter` keeps a deterministic sample of what each
codec of the call encodes, spread over every chunk it sends; before the
last messages go, it encodes and decodes the sample again with the codec
(and with each candidate of an :class:`~qcomm.AdaptiveCodec`) and puts the
relative RMS error and the largest error in the status every peer reads.
Once the call is finished, :meth:`Meter.learn` gives every rank's figures
to the codec's record and to the adaptive codec's choice, in the caller's
thread (:class:`Finished`), so that every rank chooses from the same calls.

The sample falls on whole scale blocks (the codec's ``error_block``, and
whole rows of a row-padded region), so that each block is encoded as in the
call itself: the errors are exactly the call's on those blocks.
"""

from __future__ import annotations

import array
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy
import torch

from qcomm import config
from qcomm.adaptive import AdaptiveCodec
from qcomm.collectives._coding import Coding, PeerCodings, Side, is_identity
from qcomm.collectives._wire import encodable
from qcomm.history import CallRecord, log_of
from qcomm.types import CodecError, codec_info

#: Elements sampled per codec and call (spread over its chunks, whole blocks).
SAMPLE = 2048
#: Runs of consecutive blocks a chunk's share of the sample is taken in, at most.
RUNS = 8
# The range of a sample's largest value within which its squares (and
# their sum) stay normal float32 numbers; outside it, float64 (_careful).
_SAFE = (1e-15, 1e15)


def measured(side: Side) -> bool:
    """
    Whether a call measures ``side``: it encodes (adaptive codecs always do),
    and keeps no state across calls (encoding a sample again would change it).
    """
    if isinstance(side.codec, AdaptiveCodec):
        return True
    return not side.coding.identity and not codec_info(side.codec).stateful


def slots_of(side: Side) -> int:
    """The error slots ``side`` takes in every status: one per candidate."""
    if isinstance(side.codec, AdaptiveCodec):
        return len(side.codec.candidates)
    return 1 if measured(side) else 0


def measuring(sides: list[Side]) -> list[bool]:
    """
    Which of ``sides`` a call measures: an adaptive codec (a budget is one)
    always, as its choice needs the figures; a plain one where the setting
    ``measure_errors`` is on. The statuses keep every side's slots either
    way, so that ranks whose settings differ still agree on sizes.
    """
    every: bool | None = None
    out = []
    for side in sides:
        if isinstance(side.codec, AdaptiveCodec):
            out.append(True)
            continue
        if every is None:
            every = config._read("measure_errors")[0] is True
        out.append(every and measured(side))
    return out


class Meter:
    """
    The error measurement of one exchange: ``sends``, the plan's sends (each
    ``(peers, piece)``), tells it how many chunks each codec encodes, to
    spread its sample over them.
    """

    def __init__(
        self,
        codings: PeerCodings,
        sends: list[Any],
        dtype: torch.dtype,
        slots: list[int],
        on: list[bool],
    ) -> None:
        self.sides = codings.sides
        #: by side, its error slots in every status (see slots_of)
        self._slots = slots
        self.slots = sum(slots)
        #: by side, whether it is measured (see measuring)
        self._on = on
        self._index = {id(s.coding): i for i, s in enumerate(self.sides)}
        self._samples: list[list[torch.Tensor]] = [[] for _ in self.sides]
        pieces = [0] * len(self.sides)
        self.wire_bytes = [0] * len(self.sides)
        self.data_bytes = [0] * len(self.sides)
        for to, piece in sends:
            if piece.region is None:
                continue
            i = self._index[id(codings[to[0]])]
            pieces[i] += 1
            itemsize = self.sides[i].coding.wire_dtype.itemsize
            self.wire_bytes[i] += piece.size * itemsize * len(to)
            self.data_bytes[i] += (piece.stop - piece.start) * dtype.itemsize * len(to)
        self._quota = [max(1, SAMPLE // n) if n else 0 for n in pieces]

    def take(self, coding: Coding, piece: Any, x: torch.Tensor) -> None:
        """Keeps this chunk's share of the sample (``x``: what the codec encoded)."""
        i = self._index.get(id(coding))
        if i is None or not self._on[i]:
            return
        granule = _granule(coding, piece.region)
        flat = x if x.is_contiguous() else x.reshape(-1)
        blocks = flat.numel() // granule
        if blocks == 0:
            self._samples[i].append(flat.reshape(-1)[: self._quota[i]])
            return
        k = min(blocks, max(1, self._quota[i] // granule))
        # Runs of consecutive blocks at even spans over the chunk: the same
        # blocks on every call of this shape. One view, read where it lies:
        # a codec's own round_trip_error reads its rows in place, any other
        # measurement copies them once (errors()).
        runs = min(k, RUNS)
        span = blocks // runs
        self._samples[i].append(flat.as_strided((runs, k // runs * granule), (span * granule, 1)))

    def errors(self) -> list[float] | torch.Tensor | None:
        """
        Every slot's relative RMS and largest error (two per slot; NaN: none),
        as float32 values, or a float32 tensor on the sample's device.
        """
        if not self.slots:
            return None
        out: list[list[float] | torch.Tensor] = []
        for i, side in enumerate(self.sides):
            if not self._slots[i]:
                continue
            if not self._on[i]:
                out.append([math.nan, math.nan])
                continue
            parts = self._samples[i]
            sample = parts[0] if len(parts) == 1 else _joined(parts)
            if isinstance(side.codec, AdaptiveCodec):
                out += [_error(c, sample, side.coding.dtype) for c in side.codec.candidates]
            else:
                out.append(_error(side.codec, sample, side.coding.dtype))
        self._samples = [[] for _ in self.sides]
        on_device = [o for o in out if isinstance(o, torch.Tensor)]
        if not on_device:
            # Rounded to the float32 the status carries: this rank's own
            # figures are then exactly those its peers read.
            return array.array("f", itertools.chain.from_iterable(out)).tolist()
        device = on_device[0].device
        return torch.cat(
            [torch.as_tensor(o, dtype=torch.float64, device=device).reshape(-1) for o in out]
        ).to(torch.float32)

    def learn(
        self,
        protocol: Any,
        rank: int,
        world: int,
        collective: str,
        number: int,
        finished: Callable[[], None],
    ) -> CodecError | None:
        """
        Gives every rank's figures, read from the statuses, to each codec's
        record and each adaptive codec's choice; the guard's error to raise, if any.
        """
        nan = [math.nan] * (2 * self.slots)
        # Each rank's slots: theirs.get(rank, nan), in C.
        rows = list(map(protocol.errors.get, range(world), itertools.repeat(nan, world)))
        rows[rank] = protocol.own_errors()
        failure = None
        at = 0
        for i, side in enumerate(self.sides):
            n = self._slots[i]
            if not self._on[i]:
                at += n  # not measured here: nothing to record
                continue
            # By rank, the used candidate's relative RMS error and largest error.
            used = 2 * (at + side.used)
            record = CallRecord(
                collective,
                number,
                codec_info(side.coding.codec).name,
                tuple([row[used] for row in rows]),
                tuple([row[used + 1] for row in rows]),
                self.wire_bytes[i],
                self.data_bytes[i],
            )
            if isinstance(side.codec, AdaptiveCodec):
                # By rank, each candidate's relative RMS error.
                rms = [row[2 * at : 2 * (at + n) : 2] for row in rows]
                error = side.codec.learn(collective, finished, side.used, rms, record)
                failure = failure or error
            elif (log := log_of(side.codec)) is not None:
                log.add(record)
            at += n
        return failure


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """
    The parts of a sample as one tensor, copied once: their runs as rows
    where all are runs of one length (a codec's ``round_trip_error`` takes
    rows), else 1-D; ``None`` where there are none.
    """
    if not parts:
        return None
    if all(p.dim() == 2 for p in parts) and len({p.shape[1] for p in parts}) == 1:
        return torch.cat(parts)
    return torch.cat([p.reshape(-1) for p in parts])


def _granule(coding: Coding, region: Any) -> int:
    """Elements that are encoded alike however the data is cut (whole scale blocks, whole rows)."""
    info = codec_info(coding.codec)
    block = info.error_block if info.error_block >= 1 else 1
    padded = getattr(region, "padded", 0)
    if hasattr(region, "region") and region.region.dim() == 2 and padded:
        return padded * (block // math.gcd(block, padded))
    return block


def _error(
    codec: Any, sample: torch.Tensor | None, dtype: torch.dtype
) -> list[float] | torch.Tensor:
    """
    ``codec``'s relative RMS and largest error on ``sample`` (NaN: nothing,
    or it failed): two floats, or a tensor of them on the sample's device.
    """
    if sample is None or not sample.numel():
        return [math.nan, math.nan]
    if is_identity(codec, dtype):
        return [0.0, 0.0]
    x = encodable(sample, codec)
    stochastic = codec_info(codec).stochastic
    quick = None if stochastic else _quick(codec, x)
    if quick is not None:
        return quick
    x = x.reshape(-1)
    try:
        if stochastic:
            # Its draws must not move the user's random stream: the sample
            # is rounded with draws of its own (an estimate of the call's).
            devices = [sample.device] if sample.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                decoded = _round_trip(codec, x)
        else:
            decoded = _round_trip(codec, x)
    except Exception:  # noqa: BLE001 - the call itself says what is wrong with the codec
        return [math.nan, math.nan]
    if x.device.type == "cpu":
        # numpy's operations cost a fraction of torch's on a sample this small.
        xs = x.numpy() if x.dtype == torch.float32 else x.float().numpy()
        lost = (decoded if decoded.dtype == torch.float32 else decoded.float()).numpy() - xs
        top, top_lost = float(numpy.abs(xs).max()), float(numpy.abs(lost).max())
        if top == 0.0 and math.isfinite(top_lost):  # nothing sent but zeros
            return [_divide(top_lost, top)] * 2
        if _SAFE[0] < top < _SAFE[1] and math.isfinite(top_lost):
            # In float32: no square overflows, and an error too small for its
            # squares to count is far below any budget.
            norm = math.sqrt(numpy.dot(xs, xs).item())
            norm_lost = math.sqrt(numpy.dot(lost, lost).item())
            if math.isfinite(norm + norm_lost):
                return [_divide(norm_lost, norm), _divide(top_lost, top)]
    return _careful(x.float(), decoded)


def _quick(codec: Any, x: torch.Tensor) -> list[float] | None:
    """
    The codec's own figures for ``x`` (its optional ``round_trip_error``, one
    pass in its kernels, see docs/codecs.rst), or ``None``: it has none, or
    leaves ``x`` to the round trip below.
    """
    own = getattr(codec, "round_trip_error", None)
    if own is None:
        return None
    try:
        figures = own(x)
        return None if figures is None else [float(figures[0]), float(figures[1])]
    except Exception:  # noqa: BLE001 - the round trip below measures it anyway
        return None


def _round_trip(codec: Any, x: torch.Tensor) -> torch.Tensor:
    """What the receivers decode of ``x`` (1-D)."""
    ctx = codec.create_context()
    out: torch.Tensor = codec.decode(codec.encode(x, ctx), ctx)
    return out.reshape(-1)[: x.numel()]


def _divide(lost: float, scale: float) -> float:
    """``lost / scale``; 0 where both are 0, inf where only ``scale`` is."""
    return lost / scale if scale > 0 else (math.inf if lost > 0 else 0.0)


def _careful(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """
    :func:`_error` where an input or a decoded value is not finite (and on a
    device, without a host synchronisation): non-finite inputs are left out,
    a non-finite value decoded from a finite one is an infinite error.
    """
    x64 = x.to(torch.float64)
    finite = torch.isfinite(x64)
    x64 = torch.where(finite, x64, 0.0)
    lost = torch.where(finite, decoded.to(torch.float64) - x64, 0.0)
    lost = torch.nan_to_num(lost, nan=math.inf, posinf=math.inf, neginf=math.inf)
    rms = _ratio(lost.square().sum().sqrt(), x64.square().sum().sqrt())
    top = _ratio(lost.abs().max(), x64.abs().max())
    return torch.stack([rms, top])


def _ratio(lost: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``lost / scale``; 0 where both are 0, inf where only ``scale`` is."""
    return torch.where(scale > 0, lost / scale, torch.where(lost > 0, math.inf, 0.0))


class Finished:
    """
    What waits for an exchange and then gives its errors to its codecs
    (:meth:`Meter.learn`): callable any number of times, from any thread,
    and run at most once; a guard's error is raised by every call of it.
    """

    def __init__(
        self,
        done: Callable[[], None],
        meter: Meter,
        protocol: Any,
        call: Any,
        collective: str,
    ) -> None:
        self._done: Callable[[], None] | None = done
        self._meter = meter
        self._protocol = protocol
        self._rank, self._world, self._number = call.rank, call.world, call.number
        self._collective = collective
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        for side in meter.sides:
            if isinstance(side.codec, AdaptiveCodec):
                side.codec.began(collective, self)

    def __call__(self) -> None:
        with self._lock:
            done, self._done = self._done, None
            if done is not None:
                try:
                    done()
                    self._error = self._meter.learn(
                        self._protocol,
                        self._rank,
                        self._world,
                        self._collective,
                        self._number,
                        self,
                    )
                except BaseException as err:
                    self._error = err
                    self._forget()
                    raise
                finally:
                    self._protocol = None
            if self._error is not None:
                raise self._error

    def _forget(self) -> None:
        for side in self._meter.sides:
            if isinstance(side.codec, AdaptiveCodec):
                side.codec.learn_nothing(self._collective, self)
