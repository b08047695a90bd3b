"""
What each pair of ranks tells the other with the data of a call
(docs/collectives.rst, "Mistakes and failures", says what it catches):

- On every call, in-band: the last message to each peer ends with a
  status of :func:`status_bytes` bytes (whether this rank's whole call went
  well, and a hash of the call as this rank sees it: the call's number on
  its group, the collective and pass, the codec's fingerprint, the dtype and
  the sizes; then, where the call encodes, the errors this rank measured of
  what it encoded, two float32 per slot of :mod:`._measure`). A rank that
  fails after the receives were posted still sends what it promised
  (zeros), with a failed status, so that no peer waits and none uses the
  zeros.
- Under ``QCOMM_VERIFY=1``, a header before the data: :data:`SIZE` bytes,
  16 int64 fields then UTF-8 text (the codec's name, or the error). Data
  moves only once the headers agree, so a mismatch raises on both ranks
  before anything is sent.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch

from qcomm.collectives._describe import hash64

SIZE = 512
#: the bytes of a status before its error slots
STATUS_BYTES = 16
#: the bytes of one error slot: a relative RMS error and a relative largest error
SLOT_BYTES = 8
_STATUS_MAGIC = 0x32545351  # "QST2": statuses with error slots
_MAGIC = 0x51434F4D4D484452  # "QCOMMHDR"
# Bumped whenever the layout changes, so that ranks running different qcomm
# versions are told so instead of misreading each other.
_PROTOCOL = 2
_FIELDS = 16
_FORMAT = f"<{_FIELDS}q"
_TEXT = SIZE - struct.calcsize(_FORMAT)
OK, FAILED = 0, 1


@dataclass(frozen=True)
class Flow:
    """What travels one way between two ranks: elements (padding included), chunk wire sizes."""

    elements: int = 0
    sizes: tuple[int, ...] = ()

    def fields(self) -> list[int]:
        """Elements, chunks, wire elements and a hash of the chunk sizes."""
        return [self.elements, len(self.sizes), sum(self.sizes), hash64(repr(self.sizes))]

    def __str__(self) -> str:
        chunks = f"{len(self.sizes)} chunk{'s' if len(self.sizes) != 1 else ''}"
        return f"{self.elements} elements in {chunks} of {sum(self.sizes)} wire elements"


@dataclass(frozen=True)
class Header:
    """One rank's header (or trailer) to one peer; ``text``: the codec's name, or the error."""

    status: int
    call: str = ""
    codec: int = 0
    dtype: str = ""
    sends: Flow = Flow()
    expects: Flow = Flow()
    text: str = ""

    def pack(self) -> torch.Tensor:
        """The header as :data:`SIZE` bytes (uint8, 1-D)."""
        text = self.text.encode("utf-8", "replace")[:_TEXT]
        fields = [
            _MAGIC,
            _PROTOCOL,
            self.status,
            hash64(self.call),
            self.codec,
            hash64(self.dtype),
            *self.sends.fields(),
            *self.expects.fields(),
            len(text),
            0,  # reserved
        ]
        blob = struct.pack(_FORMAT, *fields) + text.ljust(_TEXT, b"\0")
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def fail(call: str, error: BaseException) -> Header:
    """The header (or trailer) of a rank that failed, carrying the error."""
    return Header(FAILED, call, text=f"{type(error).__name__}: {error}")


def problems(mine: Header, peer: int, rank: int, blob: torch.Tensor) -> list[str]:
    """What differs between this rank's header to ``peer`` and the one ``peer`` sent (``blob``)."""
    data = blob.numpy().tobytes()
    fields = struct.unpack_from(_FORMAT, data)
    text = data[struct.calcsize(_FORMAT) :][: max(0, min(fields[14], _TEXT))]
    said = text.decode("utf-8", "replace")
    if fields[0] != _MAGIC or fields[1] != _PROTOCOL:
        return [
            f"rank {peer} runs a qcomm version whose call headers differ (protocol {fields[1]})"
        ]
    if fields[2] != OK:
        return [f"rank {peer} failed: {said}"]
    if fields[3] != hash64(mine.call):
        return [f"rank {peer} is not in {mine.call} (another collective or pass)"]
    out = []
    if fields[4] != mine.codec:
        out.append(
            f"rank {peer} encodes with {said} and rank {rank} with {mine.text} "
            "(codecs differing in class, options or wire; QCOMM_VERIFY=1 shows how)"
        )
    if fields[5] != hash64(mine.dtype):
        out.append(f"rank {peer}'s data dtype differs from rank {rank}'s {mine.dtype}")
    theirs_send, theirs_expect = list(fields[6:10]), list(fields[10:14])
    if theirs_send != mine.expects.fields():
        said_send = _flow(theirs_send, mine.expects)
        out.append(f"rank {peer} sends {said_send} to rank {rank}, which expects {mine.expects}")
    if theirs_expect != mine.sends.fields():
        said_expect = _flow(theirs_expect, mine.sends)
        out.append(f"rank {rank} sends {mine.sends} to rank {peer}, which expects {said_expect}")
    return out


def _flow(fields: list[int], other: Flow) -> str:
    """A peer's flow fields as text, saying so when only the chunk sizes differ."""
    elements, chunks, wire, _ = fields
    text = (
        f"{elements} elements in {chunks} chunk{'s' if chunks != 1 else ''} of {wire} wire elements"
    )
    return text + (" (other chunk sizes)" if fields[:3] == other.fields()[:3] else "")


def identity(call: str, number: int, codec: int, dtype: str, flow: Flow) -> int:
    """The hash a status carries: the call as one side of a pair sees it."""
    # The call's number is mixed in apart (a bijection of it, added modulo
    # 2**64), so that the rest, alike from call to call, is hashed once.
    # The flow goes in as its fields: hashing them is a step of C, hashing
    # the dataclass a call of Python.
    mixed = (_described(call, codec, dtype, flow.elements, flow.sizes) + number * _GOLDEN) & _MASK
    return mixed - (1 << 64) if mixed >> 63 else mixed


_GOLDEN = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes 64-bit numbers
_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def _described(call: str, codec: int, dtype: str, elements: int, sizes: tuple[int, ...]) -> int:
    return hash64(f"{call}|{codec}|{dtype}|{elements}|{sizes}")


def status_bytes(slots: int) -> int:
    """The bytes of a status with ``slots`` error slots."""
    return STATUS_BYTES + SLOT_BYTES * slots


def status(
    ok: bool, identity: int, errors: list[float] | torch.Tensor | None = None
) -> bytes | torch.Tensor:
    """
    A status: bytes, or a uint8 tensor on the device of ``errors`` (float32,
    two per slot) where they are a tensor not on the CPU, read there without a wait.
    """
    head = struct.pack("<IIq", _STATUS_MAGIC, OK if ok else FAILED, identity)
    if errors is None:
        return head
    if isinstance(errors, list):
        return head + struct.pack(f"<{len(errors)}f", *errors)
    if errors.device.type == "cpu":
        return head + errors.numpy().tobytes()
    on_device = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(errors.device)
    return torch.cat([on_device, errors.view(torch.uint8)])


#: ``went_well(identity)``: the first :data:`STATUS_BYTES` of the status of
#: a call that went well and is ``identity``'s (a step of C: every status
#: of every call is compared with one)
went_well = functools.partial(struct.Struct("<IIq").pack, _STATUS_MAGIC, OK)


def status_errors(blob: bytes, slots: int) -> list[float]:
    """The error slots of a status read (two floats each), as sent."""
    return list(struct.unpack_from(f"<{2 * slots}f", blob, STATUS_BYTES)) if slots else []


def status_problem(blob: bytes, expected: int, peer: int) -> str | None:
    """What a peer's status says is wrong (``None``: its call went well and is this rank's)."""
    magic, state, said = struct.unpack_from("<IIq", blob)
    if magic != _STATUS_MAGIC:
        return (
            f"rank {peer} sent fewer elements than this rank expects, or runs a qcomm "
            "version without call statuses"
        )
    if state != OK:
        return f"rank {peer} failed during the call (its own error says why)"
    if said != expected:
        return (
            f"rank {peer} made another call: a different collective or pass, codec, dtype, "
            "sizes or number of earlier calls (QCOMM_VERIFY=1 says which)"
        )
    return None


def failed(blob: torch.Tensor) -> bool:
    """Whether a header says its rank failed before the call started."""
    fields = struct.unpack_from(_FORMAT, blob.numpy().tobytes())
    return bool(fields[0] == _MAGIC and fields[2] != OK)
