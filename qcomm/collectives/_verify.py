r"""
Rank agreement: before a collective's first communication the ranks compare
what each was asked to do, so that ranks that disagree raise a
:class:`~qcomm.CodecError` naming the rank and the argument instead of
exchanging garbage or waiting for each other forever.

Every rank all-gathers (as an all-to-all of copies) one int64 tensor of a size fixed by the world size: a
header (protocol, collective, whether its own argument checks failed, length
of its description, its ``QCOMM_VERIFY`` mode), one hash per argument that must be the same on all
ranks (split lists known to all, trailing shape, each codec's class, repr,
options, :class:`~qcomm.CodecInfo`, wire dtype and sizes), and this rank's
per-destination send and receive counts, which must mirror the other ranks'.
Only when something differs do the ranks all-gather their readable
descriptions (UTF-8 text, never pickle) to say who differs and how. Both
steps are collectives of the call's own group, so they run under its
timeout: a missing rank makes them raise, not hang.

A rank whose own argument checks fail still takes part (when verification is
due), flagged as failed: it raises its own error and the others raise a
:class:`~qcomm.CodecError` naming it, instead of waiting for it.

When verification runs is set by the environment variable ``QCOMM_VERIFY``:
unset or empty, the first call of each collective on each process group; ``1``
every call; ``0`` never. Every rank must make the same calls in the same
order for this to line up, which the collectives require anyway, and have the
same ``QCOMM_VERIFY`` (ranks that differ between unset and ``1`` are told so;
a rank with ``0`` among others that verify cannot be, and they fall out of
step until the group's timeout).
"""

from __future__ import annotations

import json
import os
import weakref
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._describe import SEP, describe_codec, hash64
from qcomm.types import CodecError, CommOp

ENV = "QCOMM_VERIFY"
# Bumped whenever the layout below changes, so that ranks running different
# qcomm versions are told so instead of misreading each other.
_PROTOCOL = 2
_HEADER = 5
_MODES = ("first", "always")
_FIELDS = 5
_CALLS = {
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL: "all_to_all_pooled",
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER: "reduce_scatter_pooled",
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL: "all_to_all_sequence",
}
_OPS = list(_CALLS)
# Longest text of one field or error message sent in a description.
_MAX_TEXT = 1000

_verified: weakref.WeakKeyDictionary[dist.ProcessGroup, set[CommOp]] = weakref.WeakKeyDictionary()


def mode() -> str:
    r"""
    mode() -> str

    When rank agreement is checked, from ``QCOMM_VERIFY``.

    Returns:
        str: ``"first"`` (unset or empty: the first call of each collective on
        each group), ``"always"`` (``1``) or ``"never"`` (``0``).

    Raises:
        ValueError: if ``QCOMM_VERIFY`` holds anything else.
    """
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "0", "1"):
        return {"": "first", "0": "never", "1": "always"}[raw]
    raise ValueError(
        f"{ENV}: expected '1' (check that ranks agree on every call), '0' (never) or "
        f"unset (the first call of each collective on each process group), got {raw!r}"
    )


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return str([int(v) for v in value])
    if isinstance(value, str):
        return value
    return describe_codec(value)


def _exchange_device(group: dist.ProcessGroup, input: Any) -> torch.device | None:
    backend = str(dist.get_backend(group)).lower()
    nccl_only = "nccl" in backend and "gloo" not in backend
    usable = isinstance(input, torch.Tensor) and input.device.type != "meta"
    if usable and not (nccl_only and input.device.type != "cuda"):
        return input.device
    if nccl_only:
        # No usable tensor to tell where this rank's GPU is: its current one.
        return (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
    return torch.device("cpu")


def _differences(texts: list[str]) -> list[str]:
    # A codec's description is long; show what tells the versions apart: its
    # repr when that differs, else its identity and the parts that differ.
    split = [text.split(SEP) for text in texts]
    if len({len(parts) for parts in split}) > 1:
        return texts
    differ = [i for i in range(len(split[0])) if len({parts[i] for parts in split}) > 1]
    out = []
    for parts in split:
        if len(parts) == 1:
            out.append(parts[0])
            continue
        ident = next((p for p in parts if p.startswith("repr=")), parts[0])
        picked = [parts[i] for i in differ]
        if any(p.startswith(("repr=", "class=")) for p in picked):
            picked = [p for p in picked if p.startswith(("repr=", "class="))]
        else:
            picked = [ident, *picked]
        out.append(" ".join(picked))
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


class Agreement:
    r"""
    The rank-agreement check of one collective call, used as a context
    manager around the call's argument checks.

    Inside the ``with`` block the collective records, through :meth:`same`,
    the arguments that must be identical on every rank and, through
    :meth:`mirror`, its send and receive counts. On leaving the block, when
    verification is due, the ranks compare them (see the module docstring);
    if the block raised, this rank tells the others that it failed and its
    own exception goes on.

    Args:
        op (CommOp): the collective.
        group (ProcessGroup): the call's group.
        rank (int): this rank in ``group``.
        world (int): the size of ``group``.
        input (Any): the call's input, whose device the exchange uses.

    Raises:
        ValueError: if ``QCOMM_VERIFY`` holds an unknown value.
    """

    def __init__(
        self, op: CommOp, group: dist.ProcessGroup, rank: int, world: int, input: Any
    ) -> None:
        self.op = op
        self.group = group
        self.rank = rank
        self.world = world
        self.input = input
        # A rank with an invalid QCOMM_VERIFY still meets its peers where
        # they verify by default, to tell them (see __exit__).
        self.bad_mode: ValueError | None = None
        try:
            how = self.mode = mode()
        except ValueError as err:
            how, self.mode, self.bad_mode = "first", "first", err
        self.due = world > 1 and (
            how == "always" or (how == "first" and op not in _verified.get(group, ()))
        )
        self.fields: dict[str, Any] = {}
        self.sends: list[int] | None = None
        self.recvs: list[int] | None = None

    def same(self, name: str, value: Any) -> None:
        r"""
        same(name: str, value: Any) -> None

        Records an argument that must be the same on every rank.

        Args:
            name (str): the argument's name, for messages.
            value (Any): a list of ints, a string, or a codec.
        """
        self.fields[name] = value

    def mirror(self, sends: list[int], recvs: list[int]) -> None:
        r"""
        mirror(sends: list[int], recvs: list[int]) -> None

        Records what this rank sends to and receives from each rank: what
        rank :math:`k` sends to rank :math:`r` must be what :math:`r`
        receives from :math:`k`.

        Args:
            sends (list[int]): rows for each rank (``input_splits``).
            recvs (list[int]): rows from each rank (``output_splits``).
        """
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
        self._settle(exc)

    def _settle(self, exc: BaseException | None) -> None:
        if not self.due:
            return
        if exc is None:
            self._exchange(None)
            _verified.setdefault(self.group, set()).add(self.op)
        elif isinstance(exc, Exception):
            try:
                self._exchange(exc)
            except Exception:
                # Telling the others failed (e.g. the group itself is
                # broken): this rank's own error is the one to see.
                pass

    def _exchange(self, failed: BaseException | None) -> None:
        device = _exchange_device(self.group, self.input)
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
            _OPS.index(self.op),
            int(failed is not None),
            len(blob),
            _MODES.index(self.mode),
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
        # Every rank sends its row to every rank: on gloo a small all-to-all
        # takes half the time of its all-gather.
        out = mine.new_empty(self.world * mine.numel())
        dist.all_to_all_single(out, mine.repeat(self.world), group=self.group)
        return out.view(self.world, -1)

    def _compare(self, table: list[list[int]]) -> str | list[int] | None:
        # Returns a finished message, the indices of hashed fields that
        # differ (to be explained from the descriptions), or None.
        call = _CALLS[self.op]
        if len({row[0] for row in table}) > 1:
            versions = "; ".join(f"rank {r}: {row[0]}" for r, row in enumerate(table))
            return f"{call}: the ranks run qcomm versions with different verification ({versions})"
        if len({row[1] for row in table}) > 1:
            calls = ", ".join(f"rank {r} {_CALLS[_OPS[row[1]]]}" for r, row in enumerate(table))
            return f"{call}: the ranks call different collectives at the same time: {calls}"
        if len({row[4] for row in table}) > 1:
            # Ranks that verify on different calls fall out of step; say so
            # while they still meet (every call, as none is marked verified).
            modes = "; ".join(
                f"rank {r}: {ENV}={'1' if _MODES[row[4]] == 'always' else 'unset'}"
                for r, row in enumerate(table)
            )
            return f"{call}: the ranks run with different {ENV} ({modes}); set it alike on all"
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
        wrong = [
            f"rank {k} sends {sends[k][r]} rows to rank {r} (its input_splits[{r}]) but rank {r} "
            f"expects {recvs[r][k]} from rank {k} (its output_splits[{k}])"
            for k in range(self.world)
            for r in range(self.world)
            if sends[k][r] != recvs[r][k]
        ]
        if not wrong:
            return None
        more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        return (
            f"{_CALLS[self.op]}: the ranks' split lists do not match: {'; '.join(wrong[:3])}{more}"
        )

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
        call = _CALLS[self.op]
        errors = [(r, d["error"]) for r, d in enumerate(descriptions) if "error" in d]
        if errors:
            said = "; ".join(f"rank {r}: {text}" for r, text in errors)
            return (
                f"{call}: {_ranks([r for r, _ in errors])} rejected the arguments of this call, "
                f"so it was started on no rank ({said})"
            )
        names = list(descriptions[self.rank])
        parts = []
        for i in differ:
            name = names[i] if i < len(names) else f"field {i}"
            groups: dict[str, list[int]] = {}
            for r, d in enumerate(descriptions):
                groups.setdefault(d.get(name, "<missing>"), []).append(r)
            # The largest group (the lowest rank among equals) is the norm;
            # the others are the ranks that differ.
            ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
            shown = _differences([text for text, _ in ordered])
            held = "; ".join(
                f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {text}"
                for text, (_, ranks) in reversed(list(zip(shown, ordered)))
            )
            parts.append(f"{_ranks(odd)} differ{'s' if len(odd) == 1 else ''} on {name}: {held}")
        return f"{call}: the ranks disagree: " + " | ".join(parts)
