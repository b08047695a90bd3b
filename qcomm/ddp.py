r"""
A ``DistributedDataParallel`` communication hook that all-reduces gradient
buckets with qcomm codecs, with optional error feedback. See :doc:`ddp`.
"""

# No "from __future__ import annotations" here: DistributedDataParallel
# compares the hook's annotations with the real types.

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
from qcomm.collectives.all_reduce import Residuals, all_reduce, granule, layout
from qcomm.discovery import load_codec
from qcomm.registry import load_pair
from qcomm.specs import parse_host_spec
from qcomm.types import CodecError, HostCodecs, QuantizedCommCodec, contract_problem

__all__ = ["DDPCommHookState", "all_reduce_hook", "ddp_comm_hook"]

_VERSION = 2
# Names given to saved parameters that no parameter of this process can
# take (see _Entry): far beyond any count of parameters.
_UNNAMED = 1 << 40

# A bucket's layout: elements, dtype, world size, rank, its parameters'
# shapes in order, and where this rank's block starts and stops.
_Layout = tuple[int, str, int, int, tuple[tuple[int, ...], ...], int, int]


def _load(value: Any, name: str) -> tuple[Any, str | None]:
    """The codec (``None`` for none) and its spec, if given as one."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return load_codec(value), value.strip()
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


def _freeze(value: Any) -> Any:
    """Lists (from a saved state) as tuples, so that layouts compare."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


class _Entry:
    """The residuals of one bucket of one module, and whose they are."""

    # ``names`` has one name per parameter of the bucket, in order: its number
    # in this state (n >= 0, see DDPCommHookState._number); restored and not
    # yet matched to a parameter, -1 - n with n its number in the state that
    # saved it; None once its residuals have moved to another bucket (they are
    # zero here then). No names: parameters that do not tile the bucket.

    def __init__(
        self, index: int, layout: _Layout, names: list[int | None], residuals: Residuals
    ) -> None:
        self.index = index
        self.layout = layout
        self.names = names
        self.residuals = residuals
        self.offsets = list(itertools.accumulate((math.prod(s) for s in layout[4]), initial=0))
        #: whether it came from load_state_dict (see DDPCommHookState._regroup)
        self.restored = False

    def take(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Parameter ``i``'s scatter and gather residuals (``None``: zero), taken out of here."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        start, stop = self.layout[5], self.layout[6]
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
        {'version': 2, 'error_feedback': True, 'residuals': {}}
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
            # What a one-codec reader of the state (granule, repr) sees.
            spec, gather = by_host.other_host.forward, by_host.other_host.backward
        if isinstance(spec, str) and "/" in spec:
            if gather is not None:
                raise ValueError(
                    f"gather: the spec {spec!r} already names the all-gather's codec "
                    f"after '/'; give one or the other"
                )
            spec, gather = spec.split("/", 1)
            if not spec.strip() or not gather.strip():
                raise CodecError(f"expected 'reduce/gather' codec specs, got {spec}/{gather}")
        self.reduce_codec, reduce_spec = _load(spec, "spec")
        if gather is None:
            gather = reduce_spec if reduce_spec is not None else self.reduce_codec
        self.gather_codec, gather_spec = _load(gather, "gather")
        self._specs = (reduce_spec, gather_spec)
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
        # Which entry, and which of its parameters, holds a name's residuals.
        self._held: dict[int, tuple[_Entry, int]] = {}
        # Parameters numbered in the order this state first sees them.
        self._numbers = cast(MutableMapping[torch.Tensor, int], WeakIdKeyDictionary())
        self._live: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._next = 0
        self._unnamed = itertools.count(_UNNAMED)

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
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        params = list(bucket.parameters())
        shapes = tuple(tuple(p.shape) for p in params)
        numel = buffer.numel()
        start, stop = self._own(numel, world, rank)
        key: _Layout = (numel, str(buffer.dtype), world, rank, shapes, start, stop)
        names: list[int | None] = [self._number(p) for p in params]
        if sum(math.prod(s) for s in shapes) != numel:
            names = []  # they do not tile the bucket: not followed one by one
        held = self._held.get(names[0]) if names and names[0] is not None else None
        if held is not None and held[0].names == names and held[0].layout == key:
            return held[0].residuals
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
        names = [self._number(p) for p in params]
        offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))
        if offsets[-1] != bucket.buffer().numel():
            return None
        entries: list[_Entry] = []
        for n in names:
            # Restored residuals, bound to it already or under its number.
            found = self._held.get(n) or self._held.get(-1 - n)
            if found is None or not found[0].restored:
                return None
            if all(found[0] is not e for e in entries):
                entries.append(found[0])
        if len(entries) == 1 and entries[0].names == names:
            return None  # the bucket's own: reduced as it is
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        at = {n: j for j, n in enumerate(names)}
        parts = []
        for entry in entries:
            taken = [None if n is None else at.get(n if n >= 0 else -1 - n) for n in entry.names]
            if not taken or any(j is None for j in taken):
                return None
            js = cast(list[int], taken)
            shapes = tuple(tuple(params[j].shape) for j in js)
            numel = sum(params[j].numel() for j in js)
            dtype = str(bucket.buffer().dtype)
            if entry.layout != (numel, dtype, world, rank, shapes, *self._own(numel, world, rank)):
                return None
            parts.append((entry, js))
        if sum(len(js) for _, js in parts) != len(params):
            return None
        for entry, js in parts:
            self._rename(entry, [names[j] for j in js])
        return [(entry.residuals, js) for entry, js in parts]

    def _own(self, numel: int, world: int, rank: int) -> tuple[int, int]:
        """Where this rank's block of a bucket starts and stops, as :func:`all_reduce` cuts it."""
        codecs = [c for c in (self.reduce_codec, self.gather_codec) if c is not None]
        if self.by_host is not None:
            codecs += [self.by_host.same_host.forward, self.by_host.same_host.backward]
        bounds = layout(numel, world, granule(*codecs))
        return bounds[rank], bounds[rank + 1]

    def _number(self, param: torch.Tensor) -> int:
        number = self._numbers.get(param)
        if number is None:
            number = self._numbers[param] = self._next
            self._live[number] = param
            self._next += 1
        return number

    def _unbound(self, entry: _Entry) -> bool:
        """Whether no live parameter of this state owns any of the entry's residuals."""
        return all(n is None or n < 0 or n not in self._live for n in entry.names)

    def _carry(
        self, index: int, key: _Layout, names: list[int | None], device: torch.device
    ) -> Residuals:
        """A new entry for the bucket, with what the entries holding its parameters hold."""
        shapes = key[4]
        sources = [None if n is None else self._held.get(n) for n in names]
        if not any(sources):
            # Restored: under the numbers of the state that saved them, which
            # numbered parameters in the order DDP's first buckets hold them,
            # as this state does.
            sources = [None if n is None else self._held.get(-1 - n) for n in names]
            if not (
                names
                and all(s and s[0].layout[4][s[1]] == shapes[j] for j, s in enumerate(sources))
            ):
                claimed = self._claim(index, key)
                if claimed is not None and claimed.layout == key:
                    self._rename(claimed, names)
                    return claimed.residuals
                if claimed is not None:
                    sources = [(claimed, i) for i in range(len(names))]
        else:
            sources = [
                s or (None if n is None else self._held.get(-1 - n)) for n, s in zip(names, sources)
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
                self._held[n] = (entry, i)
        return residuals

    def _claim(self, index: int, key: _Layout) -> _Entry | None:
        """An entry of the bucket's index and shapes whose parameters are gone or restored."""
        for entry in self._entries:
            if entry.index == index and entry.layout[:5] == key[:5] and self._unbound(entry):
                return entry
        return None

    def _rename(self, entry: _Entry, names: list[int | None]) -> None:
        for n in entry.names:
            if n is not None:
                self._held.pop(n, None)
        entry.names = list(names)
        for i, n in enumerate(names):
            if n is not None:
                self._held[n] = (entry, i)

    def _drop(self, entry: _Entry, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        name = entry.names[i]
        if name is not None:
            self._held.pop(name, None)
        return entry.take(i)

    def _move(
        self, key: _Layout, sources: Sequence[tuple[_Entry, int] | None], device: torch.device
    ) -> tuple[Residuals, bool]:
        """Residuals laid out as ``key``, from each parameter's source; whether one did not fit."""
        numel, _, world, rank, shapes, start, stop = key
        scatter = torch.zeros(numel, device=device)
        gather = torch.zeros(stop - start, device=device)
        lost = False
        offsets = list(itertools.accumulate((math.prod(s) for s in shapes), initial=0))
        for j, source in enumerate(sources):
            if source is None:
                continue
            entry, i = source
            s, g = self._drop(entry, i)
            if entry.layout[2:4] != (world, rank) or entry.layout[4][i] != shapes[j]:
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
            ``index``, ``layout``, ``params`` (which parameters, by their
            number in the order the state first saw them), ``scatter`` and
            ``gather``.
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
                "layout": _thaw(e.layout),
                "params": [
                    None if n is None or -1 - n >= _UNNAMED else (n if n >= 0 else -1 - n)
                    for n in e.names
                ],
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
        :doc:`ddp`).

        Args:
            state_dict (Mapping[str, Any]): from :meth:`state_dict`, else ``ValueError``.
        """
        version = state_dict.get("version") if isinstance(state_dict, Mapping) else None
        if version not in (1, _VERSION):
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
                    entry.names[i] = -1 - next(self._unnamed)
                else:
                    self._held[n] = (entry, i)
            self._entries.append(entry)

    def _loaded(self, key: Any, entry: Any, version: int) -> _Entry:
        """One saved entry, checked; its names not yet bound (see :class:`_Entry`)."""
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
        layout = _freeze(entry.get("layout"))
        index = entry.get("index", key) if version > 1 else key
        names = entry.get("params") if version > 1 else None
        if (
            not isinstance(layout, tuple)
            or len(layout) != (7 if version > 1 else 5)
            or not all(isinstance(v, int) for v in (*layout[:1], *layout[2:4], *layout[5:]))
            or not isinstance(layout[4], tuple)
            or not all(isinstance(s, tuple) for s in layout[4])
            or sum(math.prod(s) for s in layout[4]) != layout[0]
            or scatter.numel() != layout[0]
        ):
            raise ValueError(f"{where}['layout']: expected the layout state_dict() saved")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}['index']: expected an int, got {index!r:.80}")
        if names is None:
            names = [None] * len(layout[4])
        if not isinstance(names, (list, tuple)) or len(names) not in (0, len(layout[4])):
            raise ValueError(f"{where}['params']: expected one number per shape of its layout")
        if not all(n is None or (isinstance(n, int) and 0 <= n < _UNNAMED) for n in names):
            raise ValueError(f"{where}['params']: expected numbers or None, got {names!r:.80}")
        if version == 1:
            # Where this rank's block lay was not saved: as the codecs cut it
            # now, if the all-gather's residual is as long.
            start, stop = self._own(layout[0], layout[2], layout[3])
            layout = (*layout, start, stop)
            if gather.numel() != stop - start:
                gather = torch.zeros(stop - start)
                self.resets += 1
        elif gather.numel() != layout[6] - layout[5]:
            raise ValueError(f"{where}['gather']: expected {layout[6] - layout[5]} elements")
        saved = [None if n is None else -1 - n for n in names]
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
        names = [s if s is not None else repr(c) for s, c in zip(self._specs, codecs)]
        return (
            f"DDPCommHookState(reduce={names[0]!r}, gather={names[1]!r}, "
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
