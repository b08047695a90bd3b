r"""
The header and trailer of a call: what every pair of ranks tells each other
on every call where every call is checked (``QCOMM_VERIFY=1``, gloo), in the
same exchange as the data, so that no call exchanges garbage, aborts on a
size mismatch, or leaves a peer waiting.

Before any data, rank :math:`k` sends every peer :math:`r` a header: whether
it could start the call (else why not), which collective and pass it is in,
a fingerprint of its codec, its data dtype, and for both directions of the
pair the elements, chunks and wire sizes it will send to :math:`r` and
expects from :math:`r`. Each rank posts its data receives only once the
headers agree, so a disagreement raises a :class:`~qcomm.CodecError` on
both ranks of the pair, naming the other, before any data moves. After its
last chunk to a peer, a rank sends a trailer saying whether every chunk was
encoded: a codec that fails half-way still sends chunks of the promised
sizes (zeros) and then a failed trailer, so that its peers raise too; so
does a rank that disagrees with a third one. (Two ranks sending each other
one chunk need no trailer: the chunk is encoded before the header goes out.)

Headers and trailers are :data:`SIZE` bytes: 16 int64 fields and a UTF-8
text (the codec's name, or the error).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from qcomm.collectives._describe import hash64

SIZE = 512
_MAGIC = 0x51434F4D4D484452  # "QCOMMHDR"
# Bumped whenever the layout changes, so that ranks running different qcomm
# versions are told so instead of misreading each other.
_PROTOCOL = 1
_FIELDS = 16
_FORMAT = f"<{_FIELDS}q"
_TEXT = SIZE - struct.calcsize(_FORMAT)
OK, FAILED = 0, 1


@dataclass(frozen=True)
class Flow:
    r"""
    What travels one way between two ranks in a call.

    Args:
        elements (int): data elements (before encoding, padding included).
        sizes (tuple[int, ...]): the wire size of every chunk, in order.
    """

    elements: int = 0
    sizes: tuple[int, ...] = ()

    def fields(self) -> list[int]:
        r"""
        fields() -> list[int]

        The flow as header fields: elements, chunks, wire elements and a
        hash of the chunk sizes.

        Returns:
            list[int]: four ints.
        """
        return [self.elements, len(self.sizes), sum(self.sizes), hash64(repr(self.sizes))]

    def __str__(self) -> str:
        chunks = f"{len(self.sizes)} chunk{'s' if len(self.sizes) != 1 else ''}"
        return f"{self.elements} elements in {chunks} of {sum(self.sizes)} wire elements"


@dataclass(frozen=True)
class Header:
    r"""
    One rank's header (or trailer) to one peer.

    Args:
        status (int): :data:`OK` or :data:`FAILED`.
        call (str): the collective and pass, e.g. ``"all_to_all_pooled forward"``.
        codec (int): the codec's fingerprint.
        dtype (str): the data dtype.
        sends (Flow): what this rank sends to the peer.
        expects (Flow): what this rank expects from the peer.
        text (str): the codec's name, or why this rank failed.
    """

    status: int
    call: str = ""
    codec: int = 0
    dtype: str = ""
    sends: Flow = Flow()
    expects: Flow = Flow()
    text: str = ""

    def pack(self) -> torch.Tensor:
        r"""
        pack() -> Tensor

        The header as :data:`SIZE` bytes.

        Returns:
            Tensor: uint8, 1-D.
        """
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
    r"""
    fail(call: str, error: BaseException) -> Header

    The header (or trailer) of a rank that failed.

    Args:
        call (str): the collective and pass.
        error (BaseException): why.

    Returns:
        Header: a failed header carrying the error's type and message.
    """
    return Header(FAILED, call, text=f"{type(error).__name__}: {error}")


def problems(mine: Header, peer: int, rank: int, blob: torch.Tensor) -> list[str]:
    r"""
    problems(mine: Header, peer: int, rank: int, blob: Tensor) -> list[str]

    What is wrong between this rank's header to ``peer`` and the header
    ``peer`` sent it.

    Args:
        mine (Header): this rank's header to ``peer``.
        peer (int): the other rank.
        rank (int): this rank.
        blob (Tensor): the peer's header as received.

    Returns:
        list[str]: nothing if the two agree, else one sentence per difference.
    """
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
