r"""
A ``DistributedDataParallel`` communication hook that all-reduces gradient
buckets with qcomm codecs, with optional error feedback. See :doc:`ddp`.
"""

# No "from __future__ import annotations" here: DistributedDataParallel
# compares the hook's annotations with the real types.

import dataclasses
import itertools
import math
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from qcomm._ddp_worker import worker_for
from qcomm.collectives._args import check_chunk_bytes
from qcomm.collectives._blocks import split_blocks
from qcomm.collectives.all_reduce import Residuals, all_reduce
from qcomm.discovery import load_codec
from qcomm.registry import load_pair
from qcomm.specs import parse_host_spec, parse_pair_spec
from qcomm.types import CodecError, HostCodecs, QuantizedCommCodec, contract_problem

__all__ = ["DDPCommHookState", "all_reduce_hook", "ddp_comm_hook"]

# 3: the layout saved as a mapping of its fields (2: a list of them in
# order; 1: the same without where this rank's block lies, and no parameters).
_VERSION = 3


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A bucket's layout, which its residuals follow (and are saved with)."""

    numel: int
    dtype: str
    world: int
    rank: int
    #: its parameters' shapes, in order
    shapes: tuple[tuple[int, ...], ...]
    #: where this rank's block starts and stops
    start: int
    stop: int

    def same_bucket(self, other: "_Layout") -> bool:
        """Whether both are of the same bucket, wherever this rank's block lies in each."""
        return dataclasses.replace(self, start=0, stop=0) == dataclasses.replace(
            other, start=0, stop=0
        )


# The fields of a layout as versions 1 and 2 saved it, a list in this order
# (version 1 without the last two).
_LISTED = ("numel", "dtype", "world", "rank", "shapes", "start", "stop")


@dataclasses.dataclass(frozen=True)
class _Name:
    """
    A parameter's number: in this state (see DDPCommHookState._number), or
    (``saved``) in the state that saved its residuals, not yet matched to a
    parameter of this one; saved residuals that no parameter can take (the
    state recorded none, or twice the same) have no number.
    """

    number: int | None
    saved: bool = False

    def as_saved(self) -> "_Name":
        """The name the saved residuals of this state's parameter go by until matched."""
        return _Name(self.number, saved=True)


def _load(value: Any, name: str) -> tuple[Any, str | None]:
    """The codec (``None`` for none) and its spec, if given as one."""
    if value is None:
        return None, None
    if isinstance(value, str):
        try:
            return load_codec(value), value.strip()
        except CodecError as err:
            raise CodecError(f"{name}: {err}") from err
    problem = contract_problem(value)
    if problem is None:
        return value, None
    if isinstance(value, (type, QuantizedCommCodec)):
        # What the registry says of it (a class passes the protocol check).
        raise CodecError(f"{name}: expected a codec spec string or a codec object, got {problem}")
    raise TypeError(
        f"{name}: expected a codec spec such as 'int8' or 'mx4:group_size=16', a codec "
        f"object or None, got {type(value).__name__}"
    )


def _codecs(spec: Any, gather: Any) -> tuple[Any, Any, tuple[str | None, str | None]]:
    """The reduce-scatter's and the all-gather's codecs (``None``: none), and their specs where given as specs."""
    if isinstance(spec, str) and "/" in spec and gather is not None:
        raise ValueError(
            f"gather: the spec {spec!r} already names the all-gather's codec "
            f"after '/'; give one or the other"
        )
    if spec is None or gather is not None:
        (reduce, reduce_spec), (gather, gather_spec) = _load(spec, "spec"), _load(gather, "gather")
        return reduce, gather, (reduce_spec, gather_spec)
    if isinstance(spec, str):
        specs: tuple[str | None, str | None] = parse_pair_spec(spec, "spec")
    else:
        _load(spec, "spec")  # a codec object, checked as any
        specs = (None, None)
    # A pair or one spec (a new codec each step), or one object for both steps.
    pair = load_pair(spec, "spec")
    return pair.forward, pair.backward, specs


def _freeze(value: Any) -> Any:
    """Lists (from a saved state) as tuples, so that layouts compare."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _saved_layout(value: Any, version: int) -> dict[str, Any] | None:
    """The fields of a layout as ``version`` saved it (of version 1, all but start and stop); ``None`` if it is not one."""
    names = _LISTED if version > 1 else tuple(n for n in _LISTED if n not in ("start", "stop"))
    if version > 2:
        if not isinstance(value, Mapping) or set(value) != set(names):
            return None
        fields = dict(value)
    else:
        if not isinstance(value, (list, tuple)) or len(value) != len(names):
            return None
        fields = dict(zip(names, value))
    shapes = fields["shapes"] = _freeze(fields["shapes"])
    if (
        not all(isinstance(fields[k], int) for k in names if k not in ("dtype", "shapes"))
        or not isinstance(shapes, tuple)
        or not all(isinstance(s, tuple) for s in shapes)
        or sum(math.prod(s) for s in shapes) != fields["numel"]
    ):
        return None
    return fields


class _Entry:
    """The residuals of one bucket of one module, and whose they are."""

    # ``names`` has one name per parameter of the bucket, in order (see
    # _Name); None once its residuals have moved to another bucket (they are
    # zero here then). No names: parameters that do not tile the bucket.

    def __init__(
        self, index: int, layout: _Layout, names: list[_Name | None], residuals: Residuals
    ) -> None:
        self.index = index
        self.layout = layout
        self.names = names
        self.residuals = residuals
        self.offsets = list(itertools.accumulate((math.prod(s) for s in layout.shapes), initial=0))
        #: restored by load_state_dict and not yet met as a bucket of its own
        #: (see DDPCommHookState._regroup)
        self.restored = False

    def take(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Parameter ``i``'s scatter and gather residuals (``None``: zero), taken out of here."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        start, stop = self.layout.start, self.layout.stop
        scatter, gather = self.residuals.scatter, self.residuals.gather
        s = g = None
        if scatter is not None:
            s = scatter[lo:hi].clone()
            scatter[lo:hi] = 0.0
        a, b = max(lo, start), min(hi, stop)
        if gather is not None and a < b:
            g = torch.zeros(hi - lo, device=gather.device)
            g[a - lo : b - lo] = gather[a - start : b - start]
            gather[a - start : b - start] = 0.0
        self.names[i] = None
        return s, g


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where a parameter's residuals are: an entry, and the parameter's position in it."""

    entry: _Entry
    i: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.layout.shapes[self.i]


class DDPCommHookState:
    r"""
    The state of qcomm's DDP hook: its codecs and options and, with error
    feedback, every bucket's residuals (see :doc:`ddp`). It takes the
    arguments of :func:`ddp_comm_hook`, raising as that does. Save it with
    :meth:`state_dict` or pickle it whole: the process group is left out, and
    codecs given as specs travel as their specs.

    Examples::

        >>> state = DDPCommHookState("int8/fp16", error_feedback=True)
        >>> state
        DDPCommHookState(reduce='int8', gather='fp16', error_feedback=True)
        >>> state.state_dict()
        {'version': 3, 'error_feedback': True, 'residuals': {}}
    """

    def __init__(
        self,
        spec: Any = None,
        *,
        gather: Any = None,
        error_feedback: bool = False,
        process_group: Any = None,
        chunk_bytes: Any = None,
    ) -> None:
        #: the codecs by host (a hierarchical all-reduce), or ``None``
        self.by_host: HostCodecs | None = None
        self._host_spec: str | None = None
        if isinstance(spec, HostCodecs) or (
            isinstance(spec, str) and parse_host_spec(spec) is not None
        ):
            if gather is not None:
                raise ValueError(
                    "gather: the spec gives the codecs by host (each pair's forward codec "
                    "reduces, its backward codec gathers); leave gather unset"
                )
            by_host = load_pair(spec, "spec")
            assert isinstance(by_host, HostCodecs)
            self.by_host = by_host
            self._host_spec = spec.strip() if isinstance(spec, str) else None
            # What a one-codec reader of the state (repr) sees.
            spec, gather = by_host.other_host.forward, by_host.other_host.backward
        self.reduce_codec, self.gather_codec, self._specs = _codecs(spec, gather)
        if not isinstance(error_feedback, bool):
            raise TypeError(
                f"error_feedback: expected a bool, got {type(error_feedback).__name__} "
                f"{error_feedback!r}"
            )
        self.error_feedback = error_feedback
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group: expected a torch.distributed.ProcessGroup or None, "
                f"got {type(process_group).__name__}"
            )
        self.process_group = process_group
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        #: how many buckets dropped residuals they could not carry over (other
        #: parameters in a bucket's place, or a restored state that does not fit)
        self.resets = 0
        self._entries: list[_Entry] = []
        # Where each name's residuals are.
        self._held: dict[_Name, _Place] = {}
        # Parameters numbered in the order this state first sees them.
        # Each parameter's name, made once: residuals() names every parameter
        # of every bucket at every step, and compares the names by identity first.
        self._numbers = cast(MutableMapping[torch.Tensor, _Name], WeakIdKeyDictionary())
        self._live: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._next = 0

    def residuals(self, bucket: dist.GradBucket) -> Residuals:
        r"""
        residuals(bucket: torch.distributed.GradBucket) -> Residuals

        The bucket's residuals, for the hook to fill in: its own, else those
        of its parameters carried over from the buckets that held them (DDP
        rebuilt its buckets, the codecs changed, or the state was restored),
        else from zero.

        Args:
            bucket (torch.distributed.GradBucket): the bucket.
        """
        buffer = bucket.buffer()
        params = list(bucket.parameters())
        key = self._layout(buffer.numel(), buffer.dtype, [tuple(p.shape) for p in params])
        names: list[_Name | None] = [self._number(p) for p in params]
        if sum(math.prod(s) for s in key.shapes) != key.numel:
            names = []  # they do not tile the bucket: not followed one by one
        held = self._held.get(names[0]) if names and names[0] is not None else None
        if held is not None and held.entry.names == names and held.entry.layout == key:
            # Its own: a restored bucket met as a bucket of DDP's, which
            # DDP keeps from now on (see _regroup).
            held.entry.restored = False
            return held.entry.residuals
        return self._carry(bucket.index(), key, names, buffer.device)

    def _regroup(self, bucket: dist.GradBucket) -> list[tuple[Residuals, list[int]]] | None:
        """
        Where the bucket holds restored buckets whole (DDP's first buckets of
        a resumed run hold every parameter, the residuals were saved from its
        rebuilt ones): each one's residuals and the bucket's parameters (by
        position) it takes, in its order, for the hook to reduce them as they
        were saved; ``None`` where it does not.
        """
        params = list(bucket.parameters())
        names: list[_Name | None] = []
        entries: list[_Entry] = []
        for p in params:
            name = self._number(p)
            # Restored residuals, bound to it already or under its number.
            found = self._held.get(name) or self._held.get(name.as_saved())
            if found is None or not found.entry.restored:
                # Once its bucket was met as DDP's, the walk stops at the
                # first parameter (residuals() numbers the rest in order).
                return None
            names.append(name)
            if all(found.entry is not e for e in entries):
                entries.append(found.entry)
        if sum(p.numel() for p in params) != bucket.buffer().numel():
            return None
        if len(entries) == 1 and entries[0].names == names:
            return None  # the bucket's own: reduced as it is
        at = {n.number: j for j, n in enumerate(names) if n is not None}
        parts = []
        for entry in entries:
            taken = [None if n is None else at.get(n.number) for n in entry.names]
            if not taken or any(j is None for j in taken):
                return None
            js = cast(list[int], taken)
            numel = sum(params[j].numel() for j in js)
            key = self._layout(numel, bucket.buffer().dtype, [tuple(params[j].shape) for j in js])
            if entry.layout != key:
                return None
            parts.append((entry, js))
        if sum(len(js) for _, js in parts) != len(params):
            return None
        for entry, js in parts:
            self._rename(entry, [names[j] for j in js])
        return [(entry.residuals, js) for entry, js in parts]

    def _layout(
        self,
        numel: int,
        dtype: Any,
        shapes: Sequence[tuple[int, ...]],
        world: int | None = None,
        rank: int | None = None,
    ) -> _Layout:
        """The layout of a bucket of this process group (else of ``world`` and ``rank``), cut as :func:`all_reduce` cuts it."""
        if world is None or rank is None:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            world, rank = dist.get_world_size(group), dist.get_rank(group)
        codecs = (
            (self.by_host,) if self.by_host is not None else (self.reduce_codec, self.gather_codec)
        )
        bounds = split_blocks(numel, world, *codecs)
        return _Layout(
            numel, str(dtype), world, rank, tuple(shapes), bounds[rank], bounds[rank + 1]
        )

    def _number(self, param: torch.Tensor) -> _Name:
        name = self._numbers.get(param)
        if name is None:
            name = self._numbers[param] = _Name(self._next)
            self._live[self._next] = param
            self._next += 1
        return name

    def _unbound(self, entry: _Entry) -> bool:
        """Whether no live parameter of this state owns any of the entry's residuals."""
        return all(n is None or n.saved or n.number not in self._live for n in entry.names)

    def _carry(
        self, index: int, key: _Layout, names: list[_Name | None], device: torch.device
    ) -> Residuals:
        """A new entry for the bucket, with what the entries holding its parameters hold."""
        sources = [None if n is None else self._held.get(n) for n in names]
        if not any(sources):
            # Restored: under the numbers of the state that saved them, which
            # numbered parameters in the order DDP's first buckets hold them,
            # as this state does.
            sources = [None if n is None else self._held.get(n.as_saved()) for n in names]
            if not (
                names
                and all(s is not None and s.shape == key.shapes[j] for j, s in enumerate(sources))
            ):
                claimed = self._claim(index, key)
                if claimed is not None and claimed.layout == key:
                    self._rename(claimed, names)
                    return claimed.residuals
                if claimed is not None:
                    sources = [_Place(claimed, i) for i in range(len(names))]
        else:
            sources = [
                s or (None if n is None else self._held.get(n.as_saved()))
                for n, s in zip(names, sources)
            ]
        residuals = Residuals()
        if any(sources):
            residuals, lost = self._move(key, sources, device)
        else:
            stale = [e for e in self._entries if e.index == index and self._unbound(e)]
            for entry in stale:
                for i in range(len(entry.names)):
                    self._drop(entry, i)
            self._entries = [e for e in self._entries if all(e is not s for s in stale)]
            lost = bool(stale)
        self.resets += int(lost)
        entry = _Entry(index, key, names, residuals)
        # Entries whose parameters all moved elsewhere are done with.
        self._entries = [
            e for e in self._entries if not e.names or any(n is not None for n in e.names)
        ]
        self._entries.append(entry)
        for i, n in enumerate(names):
            if n is not None:
                self._held[n] = _Place(entry, i)
        return residuals

    def _claim(self, index: int, key: _Layout) -> _Entry | None:
        """An entry of the bucket's index and shapes whose parameters are gone or restored."""
        for entry in self._entries:
            if entry.index == index and entry.layout.same_bucket(key) and self._unbound(entry):
                return entry
        return None

    def _rename(self, entry: _Entry, names: list[_Name | None]) -> None:
        for n in entry.names:
            if n is not None:
                self._held.pop(n, None)
        entry.names = list(names)
        for i, n in enumerate(names):
            if n is not None:
                self._held[n] = _Place(entry, i)

    def _drop(self, entry: _Entry, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        name = entry.names[i]
        if name is not None:
            self._held.pop(name, None)
        return entry.take(i)

    def _move(
        self, key: _Layout, sources: Sequence[_Place | None], device: torch.device
    ) -> tuple[Residuals, bool]:
        """Residuals laid out as ``key``, from each parameter's source; whether one did not fit."""
        start, stop, world = key.start, key.stop, key.world
        scatter = torch.zeros(key.numel, device=device)
        gather = torch.zeros(stop - start, device=device)
        lost = False
        offsets = list(itertools.accumulate((math.prod(s) for s in key.shapes), initial=0))
        for j, source in enumerate(sources):
            if source is None:
                continue
            s, g = self._drop(source.entry, source.i)
            was = source.entry.layout
            if (was.world, was.rank) != (world, key.rank) or source.shape != key.shapes[j]:
                lost = True
                continue
            lo, hi = offsets[j], offsets[j + 1]
            s = torch.zeros(hi - lo, device=device) if s is None else s.to(device)
            # The reduce-scatter's residual counts 1/world in the average, the
            # all-gather's whole: one moves to the other where the place
            # changed owner (exactly, where it did not).
            scatter[lo:hi] = s if g is None else s + g.to(device) * world
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                own = s[a - lo : b - lo] / world
                if g is not None:
                    own += g[a - lo : b - lo].to(device)
                gather[a - start : b - start] = own
                scatter[a:b] = 0.0
        return Residuals(scatter, gather), lost

    def reset(self) -> None:
        r"""
        reset() -> None

        Drops every bucket's residuals.
        """
        self._entries = []
        self._held.clear()

    def state_dict(self) -> dict[str, Any]:
        r"""
        state_dict() -> dict[str, Any]

        Copies of every bucket's residuals with their layout.

        Returns:
            dict[str, Any]: ``version``, ``error_feedback`` and ``residuals``:
            per bucket, keyed by its index (where two modules share the state,
            the buckets of the later one follow the largest index),
            ``index``, ``layout`` (``numel``, ``dtype``, ``world``, ``rank``,
            ``shapes``, and where this rank's block lies: ``start`` and
            ``stop``), ``params`` (which parameters, by their number in the
            order the state first saw them), ``scatter`` and ``gather``.
        """
        entries = [
            e
            for e in self._entries
            if e.residuals.scatter is not None and e.residuals.gather is not None
        ]
        keys: dict[int, int] = {}
        for k, e in enumerate(entries):
            keys.setdefault(e.index, k)
        extra = itertools.count(max(keys, default=-1) + 1)
        first = set(keys.values())
        residuals = {}
        for k, e in enumerate(entries):
            assert e.residuals.scatter is not None and e.residuals.gather is not None
            residuals[e.index if k in first else next(extra)] = {
                "index": e.index,
                "layout": {**dataclasses.asdict(e.layout), "shapes": _thaw(e.layout.shapes)},
                "params": [None if n is None else n.number for n in e.names],
                "scatter": e.residuals.scatter.detach().clone(),
                "gather": e.residuals.gather.detach().clone(),
            }
        return {
            "version": _VERSION,
            "error_feedback": self.error_feedback,
            "residuals": dict(sorted(residuals.items())),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        r"""
        load_state_dict(state_dict: Mapping[str, Any]) -> None

        Restores what :meth:`state_dict` saved, for the hook to carry over to
        the buckets of the same parameters, whatever their layout now (see
        :doc:`ddp`). States saved by earlier versions of qcomm load too.

        Args:
            state_dict (Mapping[str, Any]): from :meth:`state_dict`, else ``ValueError``.
        """
        version = state_dict.get("version") if isinstance(state_dict, Mapping) else None
        if isinstance(version, bool) or version not in (1, 2, _VERSION):
            got = version if isinstance(state_dict, Mapping) else state_dict
            raise ValueError(
                f"state_dict: expected a DDPCommHookState.state_dict() of version {_VERSION}, "
                f"got {got!r:.80}"
            )
        entries = state_dict.get("residuals")
        if not isinstance(entries, Mapping):
            raise ValueError("state_dict['residuals']: expected a mapping of bucket index to entry")
        loaded = [self._loaded(key, entry, version) for key, entry in entries.items()]
        self._entries, self._held = [], {}
        for entry in loaded:
            for i, n in enumerate(entry.names):
                if n is None or n in self._held:
                    entry.names[i] = _Name(None, saved=True)
                else:
                    self._held[n] = _Place(entry, i)
            self._entries.append(entry)

    def _loaded(self, key: Any, entry: Any, version: int) -> _Entry:
        """One saved entry, checked; its names not yet bound (see :class:`_Name`)."""
        where = f"state_dict['residuals'][{key!r}]"
        if isinstance(key, bool) or not isinstance(key, int) or not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an int bucket index and a mapping")
        tensors = []
        for name in ("scatter", "gather"):
            t = entry.get(name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                raise ValueError(f"{where}[{name!r}]: expected a 1-D float32 tensor")
            tensors.append(t.detach().clone())
        scatter, gather = tensors
        fields = _saved_layout(entry.get("layout"), version)
        index = entry.get("index", key) if version > 1 else key
        names = entry.get("params") if version > 1 else None
        if fields is None or scatter.numel() != fields["numel"]:
            raise ValueError(f"{where}['layout']: expected the layout state_dict() saved")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}['index']: expected an int, got {index!r:.80}")
        shapes = fields["shapes"]
        if names is None:
            names = [None] * len(shapes)
        if not isinstance(names, (list, tuple)) or len(names) not in (0, len(shapes)):
            raise ValueError(f"{where}['params']: expected one number per shape of its layout")
        if not all(n is None or (isinstance(n, int) and n >= 0) for n in names):
            raise ValueError(f"{where}['params']: expected numbers or None, got {names!r:.80}")
        if version == 1:
            # Where this rank's block lay was not saved: as the codecs cut it
            # now, if the all-gather's residual is as long.
            layout = self._layout(
                fields["numel"], fields["dtype"], shapes, fields["world"], fields["rank"]
            )
            if gather.numel() != layout.stop - layout.start:
                gather = torch.zeros(layout.stop - layout.start)
                self.resets += 1
        else:
            layout = _Layout(**fields)
            if gather.numel() != layout.stop - layout.start:
                raise ValueError(
                    f"{where}['gather']: expected {layout.stop - layout.start} elements"
                )
        saved: list[_Name | None] = [None if n is None else _Name(n, saved=True) for n in names]
        loaded = _Entry(index, layout, saved, Residuals(scatter, gather))
        loaded.restored = True
        return loaded

    def __getstate__(self) -> dict[str, Any]:
        reduce_spec, gather_spec = self._specs
        reduce: Any = reduce_spec if reduce_spec is not None else self.reduce_codec
        gather: Any = gather_spec if gather_spec is not None else self.gather_codec
        if self.by_host is not None:
            reduce, gather = self._host_spec or self.by_host, None
        return {
            "reduce": reduce,
            "gather": gather,
            "error_feedback": self.error_feedback,
            "chunk_bytes": self.chunk_bytes,
            "resets": self.resets,
            "state": self.state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["reduce"],
            gather=state["gather"],
            error_feedback=state["error_feedback"],
            chunk_bytes=state["chunk_bytes"],
        )
        self.resets = state["resets"]
        self.load_state_dict(state["state"])

    def __repr__(self) -> str:
        if self.by_host is not None:
            given = self._host_spec or self.by_host
            return f"DDPCommHookState(by_host={given!r}, error_feedback={self.error_feedback})"
        codecs = (self.reduce_codec, self.gather_codec)
        reduce, gather = [s if s is not None else repr(c) for s, c in zip(self._specs, codecs)]
        return (
            f"DDPCommHookState(reduce={reduce!r}, gather={gather!r}, "
            f"error_feedback={self.error_feedback})"
        )


def all_reduce_hook(
    state: DDPCommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""
    all_reduce_hook(state: DDPCommHookState, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]

    The DDP communication hook: hands the bucket to its process group's
    background worker, which averages it over the ranks with
    :func:`~qcomm.collectives.all_reduce.all_reduce`, and returns at once, so
    that the backward pass overlaps the communication (see :doc:`ddp`).

    Args:
        state (DDPCommHookState): the codecs and residuals.
        bucket (torch.distributed.GradBucket): DDP's bucket.

    Returns:
        torch.futures.Future[torch.Tensor]: completes with the averaged bucket,
        or with the error of its all-reduce (on every rank).

    Raises:
        TypeError: if ``state`` is not a :class:`DDPCommHookState`. A codec
            that fails or ranks that disagree fail the future instead, with a
            :class:`~qcomm.CodecError`, which DDP raises from the backward pass.
    """
    if not isinstance(state, DDPCommHookState):
        raise TypeError(
            f"state: expected the DDPCommHookState from qcomm.ddp_comm_hook, "
            f"got {type(state).__name__}"
        )
    buffer = bucket.buffer()
    # Restored buckets that this one holds whole are reduced each as it was
    # saved, so that a resumed run goes on bit for bit (see docs/ddp.rst).
    parts = state._regroup(bucket) if state.error_feedback else None
    residuals = state.residuals(bucket) if state.error_feedback and parts is None else None
    sizes = [p.numel() for p in bucket.parameters()] if parts is not None else []
    offsets = list(itertools.accumulate(sizes, initial=0))

    def average(x: torch.Tensor, group: dist.ProcessGroup, residuals: Residuals | None) -> None:
        by_host = state.by_host
        all_reduce(
            x,
            group=group,
            reduce_codec=state.reduce_codec if by_host is None else None,
            gather_codec=state.gather_codec if by_host is None else None,
            by_host=by_host,
            average=True,
            residuals=residuals,
            chunk_bytes=state.chunk_bytes,
        )

    def reduce(group: dist.ProcessGroup) -> torch.Tensor:
        if parts is None:
            average(buffer, group, residuals)
            return buffer
        for part, js in parts:
            pieces = [buffer[offsets[j] : offsets[j + 1]] for j in js]
            staged = torch.cat(pieces)
            average(staged, group, part)
            at = 0
            for piece in pieces:
                piece.copy_(staged[at : at + piece.numel()])
                at += piece.numel()
        return buffer

    group = state.process_group or dist.distributed_c10d._get_default_group()
    if dist.get_world_size(group) == 1:
        # Nothing to wait for: no thread, no group of its own.
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buffer.device])
            if buffer.device.type == "cuda"
            else torch.futures.Future()
        )
        future.set_result(reduce(group))
        return future
    return worker_for(group).submit(reduce, buffer.device)


def ddp_comm_hook(
    spec: Any,
    *,
    gather: Any = None,
    error_feedback: bool = False,
    process_group: Any = None,
    chunk_bytes: Any = None,
) -> tuple[DDPCommHookState, Callable[..., torch.futures.Future[torch.Tensor]]]:
    r"""
    ddp_comm_hook(spec, *, gather=None, error_feedback=False, process_group=None, chunk_bytes=None) -> tuple[DDPCommHookState, Callable]

    A DDP communication hook that averages gradient buckets with an encoded
    reduce-scatter and all-gather; hand both to ``register_comm_hook`` on
    every rank before the first backward pass (see :doc:`ddp`).

    Args:
        spec (str | QuantizedCommCodec | HostCodecs): a spec (``"int8"``), a
            ``"reduce/gather"`` pair, a codec object, ``None`` (no codec), or
            codecs by host (``"same_host=noop+other_host=int8"`` or a
            :class:`~qcomm.HostCodecs`: a hierarchical all-reduce, see
            :doc:`topology`).
        gather (str | QuantizedCommCodec, optional): the all-gather's codec.
            Default: ``None`` (as ``spec``; a new instance of a spec).
        error_feedback (bool, optional): carry what the codecs lose into the
            next step. Default: ``False``.
        process_group (ProcessGroup, optional): DDP's group. Default: ``None``.
        chunk_bytes (int, optional): the chunk size (see :doc:`collectives`).
            Default: ``None`` (automatic).

    Returns:
        tuple[DDPCommHookState, Callable]: the state and :func:`~qcomm.ddp.all_reduce_hook`.

    Raises:
        CodecError: if a spec names no installed codec or its options are wrong,
            or a codec object breaks the codec contract (a codec class, say).
        TypeError: if an argument has the wrong type.
        ValueError: if ``gather`` repeats a pair's, or ``chunk_bytes`` is not positive.

    Examples::

        >>> import qcomm
        >>> state, hook = qcomm.ddp_comm_hook("mx4", error_feedback=True)
        >>> hook.__name__, state.error_feedback
        ('all_reduce_hook', True)
    """
    state = DDPCommHookState(
        spec,
        gather=gather,
        error_feedback=error_feedback,
        process_group=process_group,
        chunk_bytes=chunk_bytes,
    )
    return state, all_reduce_hook
