r"""
Rank agreement: before a collective's first communication the ranks compare
what each was asked to do, so that ranks that disagree raise a
:class:`~qcomm.CodecError` naming the rank and the argument instead of
exchanging garbage or waiting for each other forever.

Every rank sends every other one an int64 row of fixed size: a header
(protocol, collective, whether its own argument checks failed, length of its
description, its ``QCOMM_VERIFY`` mode), one hash per argument that must be
alike on all ranks, and its send and receive counts, which must mirror the
others'. Only when something differs do the ranks exchange readable
descriptions (UTF-8 JSON, never pickle) for the message. Both exchanges are
collectives of the call's group, so a missing rank makes them raise under the
group's timeout rather than hang. When the check runs is set by
``QCOMM_VERIFY`` (docs/collectives.rst, "Mistakes and failures").
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from qcomm import config
from qcomm.collectives import _backends, _transport
from qcomm.collectives._describe import describe_codec, hash64
from qcomm.collectives._disagreement import disagreement, unmatched_splits
from qcomm.collectives._hosts import ByHost
from qcomm.types import CodecError

# Bumped whenever the layout below changes, so that ranks running different
# qcomm versions are told so instead of misreading each other.
_PROTOCOL = 3
_HEADER = 6
_MODES = ("first", "always")
_FIELDS = 8
#: Every collective qcomm runs, by name; its index travels in the check, so a
#: new collective is appended.
COLLECTIVES = (
    "all_to_all_pooled",
    "reduce_scatter_pooled",
    "all_to_all_sequence",
    "all_reduce",
    "all_gather_pooled",
)
_TRANSPORTS = (None, *_transport.CHOICES)
# Longest text of one field or error message sent in a description.
_MAX_TEXT = 1000

_verified: weakref.WeakKeyDictionary[dist.ProcessGroup, set[str]] = weakref.WeakKeyDictionary()


def mode() -> str:
    """``"first"``, ``"always"`` or ``"never"``: the settings' ``verify`` (``QCOMM_VERIFY``)."""
    how: str = config._read("verify")[0]
    return how


def read_mode() -> tuple[str, ValueError | None]:
    """
    :func:`mode`, or ``"first"`` and the error where ``QCOMM_VERIFY`` is
    invalid (the check says so); read once per call.
    """
    try:
        return mode(), None
    except ValueError as err:
        return "first", err


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return str([int(v) for v in value])
    if isinstance(value, str):
        return value
    if isinstance(value, ByHost):
        return value.describe(describe_codec)
    return describe_codec(value)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


class Agreement:
    """
    The agreement check of one call: a context manager around the call's
    argument checks, which record what must be alike (:meth:`same`) and the
    split counts (:meth:`mirror`); on exit, when due, the ranks compare them,
    and a rank whose checks raised tells the others before its error goes on.
    """

    def __init__(
        self,
        collective: str,
        group: dist.ProcessGroup,
        rank: int,
        world: int,
        input: Any,
        verify: tuple[str, ValueError | None] | None = None,
    ) -> None:
        if collective not in COLLECTIVES:
            raise AssertionError(f"qcomm: unknown collective {collective!r}")
        self.collective = collective
        #: whether the peers know, from this check, that this rank's call
        #: failed (nothing more needs telling them)
        self.told = False
        self.group = group
        self.rank = rank
        self.world = world
        self.input = input
        # A rank with an invalid QCOMM_VERIFY still meets its peers where
        # they verify by default, to tell them (see __exit__).
        # ``verify``: the call's read_mode(), where it has read it.
        how, self.bad_mode = verify if verify is not None else read_mode()
        self.mode = how
        self.due = world > 1 and (
            how == "always" or (how == "first" and collective not in _verified.get(group, ()))
        )
        self.fields: dict[str, Any] = {}
        #: ``same(name, value)`` records an argument (split list, string or
        #: codec) that must be alike on every rank (the dict's own setter: a
        #: call makes several, and a method of ours would cost a frame each)
        self.same: Callable[[str, Any], None] = self.fields.__setitem__
        self.sends: list[int] | None = None
        self.recvs: list[int] | None = None

    def mirror(self, sends: list[int], recvs: list[int]) -> None:
        """Records the rows sent to and received from each rank (input/output splits)."""
        self.sends, self.recvs = list(sends), list(recvs)

    def __enter__(self) -> Agreement:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None and self.bad_mode is not None:
            exc = self.bad_mode
            self._settle(exc)
            raise exc
        if self.due:
            self._settle(exc)

    def _settle(self, exc: BaseException | None) -> None:
        if not self.due:
            return
        if exc is None:
            try:
                self._exchange(None)
            except CodecError:
                # Every rank read the same table and raises alike: no rank
                # goes on to the call's data, and none needs telling.
                self.told = True
                raise
            _verified.setdefault(self.group, set()).add(self.collective)
        elif isinstance(exc, Exception):
            try:
                self._exchange(exc)
                self.told = True
            except Exception:
                # Telling the others failed (e.g. the group itself is
                # broken): this rank's own error is the one to see.
                pass

    def _exchange(self, failed: BaseException | None) -> None:
        given = self.input
        usable = isinstance(given, torch.Tensor) and given.device.type != "meta"
        device = _backends.small_exchange_device(self.group, given.device if usable else None)
        if device is None:
            return
        if len(self.fields) > _FIELDS:
            raise AssertionError(f"qcomm: at most {_FIELDS} fields can be verified")
        hashes = [0] * _FIELDS
        if failed is None:
            full = {name: _describe(value) for name, value in self.fields.items()}
            # Insertion order: the i-th field is the i-th hash on every rank.
            for i, (name, text) in enumerate(full.items()):
                hashes[i] = hash64(f"{name}={text}")
            texts = {name: _clip(text) for name, text in full.items()}
        else:
            texts = {"error": _clip(f"{type(failed).__name__}: {failed}")}
        blob = json.dumps(texts).encode()
        vectors = [-1] * (2 * self.world)
        if failed is None and self.sends is not None and self.recvs is not None:
            vectors = self.sends + self.recvs
        header = [
            _PROTOCOL,
            COLLECTIVES.index(self.collective),
            int(failed is not None),
            len(blob),
            _MODES.index(self.mode),
            _TRANSPORTS.index(_safe_choice()),
        ]
        mine = torch.tensor(header + hashes + vectors, dtype=torch.int64, device=device)
        table = self._all_gather(mine).tolist()
        message = self._compare(table)
        if message is None:
            return
        if isinstance(message, list):
            descriptions = self._descriptions(blob, [row[3] for row in table], device)
            message = self._explain(message, descriptions)
        if failed is None:
            raise CodecError(message)

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        return _backends.gather_rows(self.group, self.world, mine)

    def _compare(self, table: list[list[int]]) -> str | list[int] | None:
        # Returns a finished message, the indices of hashed fields that
        # differ (to be explained from the descriptions), or None.
        call = self.collective
        if len({row[0] for row in table}) > 1:
            versions = "; ".join(f"rank {r}: {row[0]}" for r, row in enumerate(table))
            return f"{call}: the ranks run qcomm versions with different verification ({versions})"
        if len({row[1] for row in table}) > 1:
            calls = ", ".join(f"rank {r} {COLLECTIVES[row[1]]}" for r, row in enumerate(table))
            return f"{call}: the ranks call different collectives at the same time: {calls}"
        if len({row[4] for row in table}) > 1:
            # Ranks that verify on different calls fall out of step; say so
            # while they still meet (every call, as none is marked verified).
            verify = config.VARIABLES["verify"]
            modes = "; ".join(
                f"rank {r}: {verify}={'1' if _MODES[row[4]] == 'always' else 'unset'}"
                for r, row in enumerate(table)
            )
            return f"{call}: the ranks run with different {verify} ({modes}); set it alike on all"
        if len({row[5] for row in table}) > 1:
            said = "; ".join(
                f"rank {r}: {config.VARIABLES['transport']}={_TRANSPORTS[row[5]] or 'unset'}"
                for r, row in enumerate(table)
            )
            return f"{call}: the ranks force different transports ({said}); set it alike on all"
        if any(row[2] for row in table):
            return []
        differ = [i for i in range(_FIELDS) if len({row[_HEADER + i] for row in table}) > 1]
        if differ:
            return differ
        return self._mirrored(table)

    def _mirrored(self, table: list[list[int]]) -> str | None:
        start = _HEADER + _FIELDS
        if table[0][start] < 0:
            return None
        sends = [row[start : start + self.world] for row in table]
        recvs = [row[start + self.world :] for row in table]
        return unmatched_splits(self.collective, sends, recvs)

    def _descriptions(
        self, blob: bytes, lengths: list[int], device: torch.device
    ) -> list[dict[str, str]]:
        widest = max(lengths)
        mine = torch.zeros(widest, dtype=torch.uint8)
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        rows = self._all_gather(mine.to(device)).cpu()
        out = []
        for r, n in enumerate(lengths):
            try:
                out.append(json.loads(bytes(rows[r, :n].tolist()).decode()))
            except ValueError:
                out.append({"error": "<unreadable description>"})
        return out

    def _explain(self, differ: list[int], descriptions: list[dict[str, str]]) -> str:
        names = list(descriptions[self.rank])
        return disagreement(self.collective, names, differ, descriptions)


def _safe_choice() -> str | None:
    # An invalid QCOMM_TRANSPORT raised when the call opened its transport.
    try:
        return _transport.choice()
    except ValueError:
        return None
