r"""
A ``DistributedDataParallel`` communication hook that all-reduces gradient
buckets with qcomm codecs, with optional error feedback. See :doc:`ddp`.
"""

# No "from __future__ import annotations" here: DistributedDataParallel
# compares the hook's annotations with the real types.

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives._args import check_chunk_bytes
from qcomm.collectives.all_reduce import Residuals, all_reduce
from qcomm.discovery import load_codec
from qcomm.types import CodecError, QuantizedCommCodec

__all__ = ["DDPCommHookState", "all_reduce_hook", "ddp_comm_hook"]

_VERSION = 1


def _load(value: Any, name: str) -> tuple[Any, str | None]:
    """The codec (``None`` for none) and its spec, if given as one."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return load_codec(value), value.strip()
    if isinstance(value, QuantizedCommCodec):
        return value, None
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
        {'version': 1, 'error_feedback': True, 'residuals': {}}
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
        #: how often a bucket's residuals restarted from zero for a new layout
        self.resets = 0
        self._residuals: dict[int, tuple[tuple[Any, ...], Residuals]] = {}

    def residuals(self, bucket: dist.GradBucket) -> Residuals:
        r"""
        residuals(bucket: torch.distributed.GradBucket) -> Residuals

        The bucket's residuals, for the hook to fill in; from zero if its
        layout changed.

        Args:
            bucket (torch.distributed.GradBucket): the bucket.
        """
        buffer = bucket.buffer()
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        shapes = tuple(tuple(p.shape) for p in bucket.parameters())
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = (buffer.numel(), str(buffer.dtype), world, rank, shapes)
        index = bucket.index()
        kept = self._residuals.get(index)
        if kept is None or kept[0] != key:
            if kept is not None:
                self.resets += 1
            kept = self._residuals[index] = (key, Residuals())
        return kept[1]

    def reset(self) -> None:
        r"""
        reset() -> None

        Drops every bucket's residuals.
        """
        self._residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        r"""
        state_dict() -> dict[str, Any]

        Copies of every bucket's residuals with their layout.

        Returns:
            dict[str, Any]: ``version``, ``error_feedback`` and ``residuals``
            (bucket index to ``layout``, ``scatter`` and ``gather``).
        """
        residuals = {
            index: {
                "layout": _thaw(key),
                "scatter": kept.scatter.detach().clone(),
                "gather": kept.gather.detach().clone(),
            }
            for index, (key, kept) in sorted(self._residuals.items())
            if kept.scatter is not None and kept.gather is not None
        }
        return {"version": _VERSION, "error_feedback": self.error_feedback, "residuals": residuals}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        r"""
        load_state_dict(state_dict: Mapping[str, Any]) -> None

        Restores what :meth:`state_dict` saved; a bucket whose layout has
        changed since restarts from zero.

        Args:
            state_dict (Mapping[str, Any]): from :meth:`state_dict`, else ``ValueError``.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != _VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else state_dict
            raise ValueError(
                f"state_dict: expected a DDPCommHookState.state_dict() of version {_VERSION}, "
                f"got {got!r:.80}"
            )
        loaded: dict[int, tuple[tuple[Any, ...], Residuals]] = {}
        entries = state_dict.get("residuals")
        if not isinstance(entries, Mapping):
            raise ValueError("state_dict['residuals']: expected a mapping of bucket index to entry")
        for index, entry in entries.items():
            where = f"state_dict['residuals'][{index!r}]"
            if (
                isinstance(index, bool)
                or not isinstance(index, int)
                or not isinstance(entry, Mapping)
            ):
                raise ValueError(f"{where}: expected an int bucket index and a mapping")
            tensors = []
            for name in ("scatter", "gather"):
                t = entry.get(name)
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                    raise ValueError(f"{where}[{name!r}]: expected a 1-D float32 tensor")
                tensors.append(t.detach().clone())
            layout = _freeze(entry.get("layout"))
            if not isinstance(layout, tuple) or len(layout) != 5:
                raise ValueError(f"{where}['layout']: expected the layout state_dict() saved")
            loaded[index] = (layout, Residuals(*tensors))
        self._residuals = loaded

    def __getstate__(self) -> dict[str, Any]:
        reduce_spec, gather_spec = self._specs
        return {
            "reduce": reduce_spec if reduce_spec is not None else self.reduce_codec,
            "gather": gather_spec if gather_spec is not None else self.gather_codec,
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

    The DDP communication hook: averages the bucket over the ranks with
    :func:`~qcomm.collectives.all_reduce.all_reduce` and returns once it is
    reduced (see :doc:`ddp`).

    Args:
        state (DDPCommHookState): the codecs and residuals.
        bucket (torch.distributed.GradBucket): DDP's bucket.

    Returns:
        torch.futures.Future[torch.Tensor]: done, holding the averaged bucket.

    Raises:
        TypeError: if ``state`` is not a :class:`DDPCommHookState`.
        CodecError: if a codec fails or the ranks disagree.
    """
    if not isinstance(state, DDPCommHookState):
        raise TypeError(
            f"state: expected the DDPCommHookState from qcomm.ddp_comm_hook, "
            f"got {type(state).__name__}"
        )
    buffer = bucket.buffer()
    all_reduce(
        buffer,
        group=state.process_group,
        reduce_codec=state.reduce_codec,
        gather_codec=state.gather_codec,
        average=True,
        residuals=state.residuals(bucket) if state.error_feedback else None,
        chunk_bytes=state.chunk_bytes,
    )
    future: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[buffer.device])
        if buffer.device.type == "cuda"
        else torch.futures.Future()
    )
    future.set_result(buffer)
    return future


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
        spec (str | QuantizedCommCodec): a spec (``"int8"``), a
            ``"reduce/gather"`` pair, a codec object, or ``None`` (no codec).
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
        CodecError: if a spec names no installed codec or its options are wrong.
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
