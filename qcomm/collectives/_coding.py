"""
The codec of each peer of a call, as the exchange uses it: one
:class:`Coding` per codec (its context, wire dtype, chunk alignment,
fingerprint and padded widths), and which peer takes which. Most calls give
every peer the same codec; a :class:`~qcomm.HostCodecs` gives the peers on
this rank's host one and the others another (see :mod:`._hosts`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from qcomm.adaptive import AdaptiveCodec
from qcomm.collectives._describe import fingerprint
from qcomm.collectives._wire import padded_lengths, wire_dtype
from qcomm.types import CodecInfo, NoOpQuantizedCommCodec


def is_identity(codec: Any, dtype: torch.dtype) -> bool:
    """Whether ``codec`` hands data of ``dtype`` over as it is (qcomm's own no-op codec)."""
    # Only qcomm's own no-op codec is known to hand back what it was given:
    # its data moves without encoding, or a copy where it can.
    return type(codec) is NoOpQuantizedCommCodec and codec.quantized_dtype == dtype


# The codec fingerprints that statuses carry, by codec object: computed once
# per object (a codec changed in place after its first call goes unseen here;
# the agreement check and QCOMM_VERIFY=1 compare it in full every time).
_prints: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()


def _status_print(codec: Any, identity: bool) -> tuple[int, str]:
    """The fingerprint and name of ``codec`` for a call's statuses (and headers)."""
    if identity:
        # qcomm's own no-op codec: the dtype (in the status) says it all.
        return 0, "noop"
    try:
        found = _prints.get(codec)
        if found is None:
            found = _prints[codec] = fingerprint(codec)
        return found
    except TypeError:  # not weakly referenceable, or unhashable
        return fingerprint(codec)


class Coding:
    """One codec of a call on data of ``dtype``, with the context of the call."""

    def __init__(self, codec: Any, dtype: torch.dtype) -> None:
        self.codec = codec
        self.dtype = dtype
        self.ctx = codec.create_context()
        #: whether the data moves as it is (no encoding, no decoding)
        self.identity = is_identity(codec, dtype)
        self.wire_dtype = wire_dtype(codec)
        self.decode_into = getattr(codec, "decode_into", None)
        self.print, self.name = _status_print(codec, self.identity)

    def alignment(self, chunked: bool) -> int | None:
        """The chunk alignment in elements, or ``None`` for one chunk per region."""
        info = getattr(self.codec, "info", None)
        if not chunked or not isinstance(info, CodecInfo) or info.stateful:
            return None
        return info.error_block if info.error_block >= 1 else None

    def padded(
        self,
        lengths: list[int],
        index: int,
        device: torch.device,
        probe: torch.Tensor | None = None,
    ) -> list[int]:
        """The codec's padded width of every entry of ``lengths`` (see :func:`padded_lengths`)."""
        if self.identity:
            return list(lengths)  # qcomm's own no-op codec pads nothing
        return padded_lengths(self.codec, self.ctx, lengths, index, device, probe=probe)


# qcomm's no-op codings, made once per codec object and data dtype: they
# read no context (no encoding, no decoding, no padding), and making one
# (a context, the wire dtype, the fingerprint) is a fair share of a small
# call. Each keeps its codec, so that no other object can take its id.
_noop_codings: dict[tuple[int, torch.dtype], Coding] = {}
_KEEP_NOOP_CODINGS = 64


def _coding(codec: Any, dtype: torch.dtype) -> Coding:
    """The :class:`Coding` of ``codec`` for a call on data of ``dtype``."""
    if type(codec) is not NoOpQuantizedCommCodec:
        return Coding(codec, dtype)
    key = (id(codec), dtype)
    kept = _noop_codings.get(key)
    if kept is not None and kept.codec is codec and kept.wire_dtype == codec.quantized_dtype:
        return kept
    made = Coding(codec, dtype)
    if len(_noop_codings) >= _KEEP_NOOP_CODINGS:
        _noop_codings.clear()  # many no-op codec objects: start again
    _noop_codings[key] = made
    return made


class Side(NamedTuple):
    """
    One codec a call was given (a :class:`~qcomm.HostCodecs` gives two, the
    same host's and the other hosts'), in an order alike on every rank: the
    codec, the candidate this call uses (an :class:`~qcomm.AdaptiveCodec`'s,
    else 0), its :class:`Coding` here.
    """

    codec: Any
    used: int
    coding: Coding


class PeerCodings:
    """
    The :class:`Coding` of every rank of a call (this rank's own: the one it
    keeps). An :class:`~qcomm.AdaptiveCodec` takes the candidate it chooses
    for ``collective`` (the call's name).
    """

    def __init__(self, codecs: list[Any], dtype: torch.dtype, collective: str = "") -> None:
        made: dict[int, Coding] = {}
        sides = []
        for c in getattr(codecs, "sides", None) or codecs:
            if id(c) in made:
                continue
            used = c.current(collective) if isinstance(c, AdaptiveCodec) else 0
            made[id(c)] = coding = _coding(
                c.candidates[used] if isinstance(c, AdaptiveCodec) else c, dtype
            )
            sides.append(Side(c, used, coding))
        self.by_rank = [made[id(c)] for c in codecs]
        #: the distinct codings, in the order of their first rank
        self.distinct = list({id(c): c for c in self.by_rank}.values())
        #: the codecs given, in an order alike on every rank
        self.sides = sides

    def __getitem__(self, rank: int) -> Coding:
        return self.by_rank[rank]

    def padded(
        self,
        lengths: list[int],
        index: int,
        device: torch.device,
        probe: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """
        :meth:`Coding.padded` of every rank's coding, by rank: ``[p][i]`` is
        entry ``i`` padded for the data between this rank and ``p``. Asked once
        per codec, not per rank.
        """
        of = {id(c): c.padded(lengths, index, device, probe) for c in self.distinct}
        return [of[id(c)] for c in self.by_rank]

    def groups(self, peers: list[int]) -> list[list[int]]:
        """``peers`` split by coding, each group in the given order."""
        out: dict[int, list[int]] = {}
        for p in peers:
            out.setdefault(id(self.by_rank[p]), []).append(p)
        return list(out.values())


def uniform(codec: Any, world: int, dtype: torch.dtype, collective: str = "") -> PeerCodings:
    """Every rank with ``codec`` (``collective``: see :class:`PeerCodings`)."""
    return PeerCodings([codec] * world, dtype, collective)


def collective_of(name: str) -> str:
    """A call's collective and pass, from its name (a backward's names its forward call)."""
    return name.split(" of call ")[0]
