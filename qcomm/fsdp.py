r"""
FSDP2 (``torch.distributed.fsdp.fully_shard``) with qcomm's codecs: every
``FSDPModule`` of a model gets a reduce-scatter of gradients and an
all-gather of weights built on qcomm's collectives, and with a replica group
(HSDP) an all-reduce of the replicas' gradients. See :doc:`fsdp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from qcomm import _events
from qcomm.adaptive import AdaptiveCodec
from qcomm.collectives import _streams, all_gather_pooled, reduce_scatter_pooled
from qcomm.collectives._args import check_chunk_bytes
from qcomm.collectives._coding import is_identity
from qcomm.collectives._describe import fingerprint
from qcomm.collectives._feedback import Residuals
from qcomm.collectives._wire import (
    checked_decode,
    checked_encode,
    encodable,
    padded_lengths,
    quantized_sizes,
    wire_dtype,
)
from qcomm.collectives.all_reduce import all_reduce
from qcomm.errors import CodecError
from qcomm.registry import load_pair
from qcomm.types import HostCodecs, QuantizedCommCodecs, codec_info

__all__ = ["FSDPCommState", "fsdp_quantize"]

_VERSION = 1


def _pair(value: Any, name: str) -> QuantizedCommCodecs | None:
    """The codecs a spec, codec, pair or codecs by host gives; ``None`` for none."""
    return None if value is None else load_pair(value, name)


def _roundtrip(codec: Any, x: torch.Tensor, index: int, lengths: list[int]) -> torch.Tensor:
    """
    ``x`` (entry ``index`` of a call's blocks of ``lengths``) encoded and
    decoded as the exchange does it, padded with zeros to the codec's width:
    the values its peers decode, as float32.
    """
    ctx = codec.create_context()
    width = padded_lengths(codec, ctx, lengths, index, x.device)[index]
    flat = encodable(x.reshape(-1), codec)
    if width > flat.numel():
        flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
    size = quantized_sizes(codec, ctx, [width])[0]
    wire = checked_encode(codec, ctx, flat.contiguous(), size, wire_dtype(codec))
    return checked_decode(codec, ctx, wire, width)[: x.numel()].float()


def _lost(codec: Any, x: torch.Tensor, residual: torch.Tensor, rank: int, world: int) -> None:
    """Sets ``residual`` to what ``codec`` loses of each block of ``x`` sent to a peer."""
    n = x.numel() // world
    for b in range(world):
        block, kept = x[b * n : (b + 1) * n], residual[b * n : (b + 1) * n]
        if b == rank:
            kept.zero_()  # not encoded, nothing lost
        else:
            torch.sub(block, _roundtrip(codec, block, b, [n] * world), out=kept)
    # An inf or NaN in a gradient would otherwise stay in the residual and
    # poison every later step; the step that had it is lost either way.
    residual.nan_to_num_(0.0, 0.0, 0.0)


def _scale(op: Any, world: int) -> tuple[str, float]:
    """What FSDP's ``op`` does after the sum: ``("div", world)``, ``("mul", factor)`` or nothing."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return "none", 1.0
    if kind == dist.ReduceOp.AVG:
        return "div", float(world)
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, (int, float)):
            raise ValueError(f"op: PREMUL_SUM with a factor qcomm cannot read ({factor!r})")
        return "mul", float(factor)
    raise ValueError(f"op: expected SUM, AVG or PREMUL_SUM (what FSDP reduces with), got {op!r}")


class _Gathering(dist.Work):
    """The all-gather's work: FSDP waits on it, once or more, before it reads the output."""

    def __init__(self, finish: Callable[[], None]) -> None:
        super().__init__()
        self._finish: Callable[[], None] | None = finish
        self._error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        finish, self._finish = self._finish, None
        if finish is not None:
            try:
                finish()
            except BaseException as err:
                self._error = err
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class _Allocating:
    """FSDP's buffers: plain tensors (qcomm's exchange leases its own)."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _QuantizedReduceScatter(_Allocating, ReduceScatter):
    """One module's reduce-scatter of gradients with qcomm's codecs (and error feedback)."""

    def __init__(self, state: FSDPCommState, name: str, codecs: QuantizedCommCodecs) -> None:
        self.state, self.name, self.codecs = state, name, codecs

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        how, factor = _scale(op, group.size())
        world, rank = group.size(), group.rank()
        residual = None
        x = input_tensor
        if self.state.error_feedback:
            kept = self.state._residuals[self.name]
            if kept.scatter is not None and kept.scatter.numel() != x.numel():
                # A restored state of other shapes or ranks: dropped, not
                # raised before the call (the other ranks would wait for it).
                kept.scatter = None
                self.state.resets += 1
            if kept.scatter is None:
                kept.scatter = torch.zeros(x.numel(), device=x.device)
            elif kept.scatter.device != x.device:
                kept.scatter = kept.scatter.to(x.device)  # restored on another device
            residual = kept.scatter
            x = x.float() + residual
        pending = reduce_scatter_pooled(
            x, group=group, codecs=self.codecs, chunk_bytes=self.state.chunk_bytes
        )
        if residual is not None:
            # What each peer decodes of its block, as it decodes it (the
            # exchange encodes every block alike, whatever its chunks), kept
            # while the blocks travel; the call's own error comes first.
            try:
                _lost(self.codecs.forward, x, residual, rank, world)
            except BaseException:
                pending.wait()
                raise
        out = pending.wait()
        if how == "div":
            torch.div(out, factor, out=output_tensor)
        elif how == "mul":
            torch.mul(out, factor, out=output_tensor)
        else:
            output_tensor.copy_(out)
        _events.emit("fsdp_call", "reduce_scatter")


class _QuantizedAllGather(_Allocating, AllGather):
    """One module's all-gather of weights: every rank, the owner too, takes the decoded shards."""

    def __init__(self, state: FSDPCommState, codecs: QuantizedCommCodecs) -> None:
        self.state, self.codecs = state, codecs

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not input_tensor.is_floating_point():
            # FSDP gathers bytes (uint8) for a group of mixed dtypes or with
            # fsdp_pre_all_gather extensions: not values a codec can carry.
            # Every rank of the group has the same kind of input.
            _events.emit("fsdp_call", "all_gather_fsdp")
            work: dist.Work | None = dist.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
            return work
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        pending = all_gather_pooled(
            input_tensor, group=group, codecs=self.codecs, chunk_bytes=self.state.chunk_bytes
        )
        codec = self.codecs.forward
        own = None
        if not is_identity(codec, input_tensor.dtype):
            # The exchange does not encode the owner's block: the owner takes
            # what its peers decode of it, so that every replica of the
            # parameter is the same to the bit. Done while the blocks travel.
            try:
                own = _roundtrip(codec, input_tensor, rank, [n] * world)
            except BaseException:
                pending.wait()  # the call's own error, on every rank, comes first
                raise
        # ``own`` is made on the issuing stream (FSDP's all-gather stream on
        # CUDA) and may be read on the waiting one: ordered and kept there.
        mark = _streams.issued(input_tensor.device)

        def finish() -> None:
            out = pending.wait()
            if own is not None:
                _streams.join(mark)
                _streams.keep(mark, own)
            lo, hi = rank * n, (rank + 1) * n
            if own is None:
                output_tensor.copy_(out)
            else:
                output_tensor[:lo].copy_(out[:lo])
                output_tensor[lo:hi].copy_(own)
                output_tensor[hi:].copy_(out[hi:])
            _events.emit("fsdp_call", "all_gather")

        if async_op or output_tensor.device.type == "cpu":
            # On CPU FSDP asks for a synchronous call (it has no streams to
            # order it) and still waits on a Work it gets before it reads the
            # output: the blocks travel while the prefetching module computes.
            return _Gathering(finish)
        finish()
        return None


def _replica_hook(
    state: FSDPCommState, name: str, param_group: Any
) -> Callable[[torch.Tensor], None]:
    """The hook that averages a module's reduced gradient shard over the replica group."""

    def hook(reduce_output: torch.Tensor) -> None:
        # With a divide factor FSDP's reduce-scatter has divided by it the
        # sum over the shard group: the replicas are then summed, as FSDP's
        # own HSDP does; else averaged, after the shard group's average.
        average = param_group.gradient_divide_factor is None
        assert state.replica_group is not None and state._replicas is not None
        residuals = state._residuals[name].replicas if state.error_feedback else None
        x = reduce_output if reduce_output.is_contiguous() else reduce_output.contiguous()
        all_reduce(
            x,
            group=state.replica_group,
            reduce_codec=state._replicas.forward,
            gather_codec=state._replicas.backward,
            average=average,
            residuals=residuals,
            chunk_bytes=state.chunk_bytes,
        )
        if x is not reduce_output:
            reduce_output.copy_(x)
        _events.emit("fsdp_call", "all_reduce")

    return hook


@dataclasses.dataclass
class _ModuleResiduals:
    """What the codecs lost of one module's gradients (error feedback)."""

    scatter: torch.Tensor | None = None
    replicas: Residuals | None = None


def _residual(value: Any, name: str) -> torch.Tensor:
    """A copy of a saved residual, flat; refused by ``name`` unless a float32 tensor."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected a float32 tensor, got {got}")
    return value.detach().clone().view(-1)


class FSDPCommState:
    r"""
    What :func:`fsdp_quantize` installed on a model: its codecs and options
    and, with error feedback, every module's residuals, saved and restored
    with :meth:`state_dict` and :meth:`load_state_dict` beside the model's
    and the optimizer's (each rank its own). Made by :func:`fsdp_quantize`.

    Attributes:
        gradients (QuantizedCommCodecs): the reduce-scatter's codecs, or ``None``.
        weights (QuantizedCommCodecs): the all-gather's codecs, or ``None``.
        error_feedback (bool): whether the gradients' codec losses are carried over.
        replica_group (ProcessGroup): HSDP's replica group, or ``None``.
        chunk_bytes (int): the collectives' chunk size, or ``None`` (automatic).
        modules (list[str]): the names of the ``FSDPModule`` s it serves.
        resets (int): restored residuals dropped as they did not fit.
    """

    def __init__(
        self,
        gradients: QuantizedCommCodecs | None,
        weights: QuantizedCommCodecs | None,
        error_feedback: bool,
        replica_group: dist.ProcessGroup | None,
        replicas: QuantizedCommCodecs | None,
        chunk_bytes: int | None,
    ) -> None:
        self.gradients = gradients
        self.weights = weights
        self.error_feedback = error_feedback
        self.replica_group = replica_group
        self._replicas = replicas
        self.chunk_bytes = chunk_bytes
        self.modules: list[str] = []
        # Restored residuals that did not fit their module's gradients.
        self.resets = 0
        self._residuals: dict[str, _ModuleResiduals] = {}

    def _lazy_residuals(self, name: str) -> _ModuleResiduals:
        return self._residuals.setdefault(name, _ModuleResiduals())

    def state_dict(self) -> dict[str, Any]:
        r"""
        state_dict() -> dict[str, Any]

        Copies of every module's residuals (this rank's).

        Returns:
            dict[str, Any]: ``version``, ``error_feedback`` and ``residuals``:
            per module name, ``scatter`` (what the reduce-scatter's codec lost
            of every block this rank sent, or ``None``) and ``replicas`` (the
            replica all-reduce's ``scatter`` and ``gather`` residuals, or
            ``None``).
        """
        residuals: dict[str, Any] = {}
        for name, r in self._residuals.items():
            replicas = None
            if r.replicas is not None and r.replicas.scatter is not None:
                assert r.replicas.gather is not None
                replicas = {
                    "scatter": r.replicas.scatter.detach().clone(),
                    "gather": r.replicas.gather.detach().clone(),
                }
            scatter = None if r.scatter is None else r.scatter.detach().clone()
            residuals[name] = {"scatter": scatter, "replicas": replicas}
        return {"version": _VERSION, "error_feedback": self.error_feedback, "residuals": residuals}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        r"""
        load_state_dict(state_dict: Mapping[str, Any]) -> None

        Restores what :meth:`state_dict` saved, so that training resumes bit
        for bit: every module it names takes the saved residuals (an entry
        saved as ``None`` clears this state's); modules it does not name keep
        theirs. A ``scatter`` residual whose length does not fit the
        module's gradients (another model or world size) is dropped on the
        next step and counted in ``resets``.

        Args:
            state_dict (Mapping[str, Any]): from :meth:`state_dict` of a state
                over the same modules, with the same ``error_feedback``.

        Raises:
            ValueError: if ``state_dict`` is not one, its ``error_feedback``
                differs from this state's, it names a module this state does
                not serve, or a residual is not a float32 tensor.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != _VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else None
            raise ValueError(
                f"state_dict: expected an FSDPCommState.state_dict() of version {_VERSION}, "
                f"got {type(state_dict).__name__} of version {got!r}"
            )
        if state_dict.get("error_feedback") != self.error_feedback:
            raise ValueError(
                f"state_dict['error_feedback']: expected {self.error_feedback} (this state's), "
                f"got {state_dict.get('error_feedback')!r}"
            )
        saved = state_dict.get("residuals")
        if not isinstance(saved, Mapping):
            raise ValueError(
                f"state_dict['residuals']: expected a mapping of module name to entry, "
                f"got {type(saved).__name__}"
            )
        for name, entry in saved.items():
            if name not in self._residuals:
                raise ValueError(
                    f"state_dict['residuals']: module {name!r} is not one of this state's "
                    f"({', '.join(map(repr, self.modules))})"
                )
            where = f"state_dict['residuals'][{name!r}]"
            if not isinstance(entry, Mapping):
                raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
            mine = self._residuals[name]
            scatter = entry.get("scatter")
            # Its length is checked against the gradients' on the next step.
            mine.scatter = None if scatter is None else _residual(scatter, f"{where}['scatter']")
            replicas = entry.get("replicas")
            if replicas is None:
                if mine.replicas is not None:
                    mine.replicas.scatter = mine.replicas.gather = None
                continue
            if mine.replicas is None:
                raise ValueError(
                    f"{where}['replicas']: this state reduces no replicas with error feedback"
                )
            if not isinstance(replicas, Mapping):
                raise ValueError(
                    f"{where}['replicas']: expected a mapping of 'scatter' and 'gather', "
                    f"got {type(replicas).__name__}"
                )
            mine.replicas.scatter = _residual(
                replicas.get("scatter"), f"{where}['replicas']['scatter']"
            )
            mine.replicas.gather = _residual(
                replicas.get("gather"), f"{where}['replicas']['gather']"
            )

    def __repr__(self) -> str:
        return (
            f"FSDPCommState(gradients={self.gradients!r}, weights={self.weights!r}, "
            f"error_feedback={self.error_feedback}, modules={len(self.modules)})"
        )


def _split(
    value: QuantizedCommCodecs | None, hsdp: bool, name: str
) -> tuple[QuantizedCommCodecs | None, QuantizedCommCodecs | None]:
    """The codecs inside the shard group and between replicas, of codecs by host or not."""
    if not isinstance(value, HostCodecs):
        return value, value
    if not hsdp:
        if name == "weights":
            raise ValueError(
                "weights: codecs by host would give the ranks of different hosts different "
                "replicas of a weight; shard inside a host and replicate across hosts "
                "(replica_group=...), see the FSDP page of qcomm's docs"
            )
        return value, None
    same = value.same_host
    # An all-gather of weights encodes with its forward codec only.
    used = (same.forward,) if name == "weights" else (same.forward, same.backward)
    identity = all(is_identity(c, torch.float32) for c in used)
    return (None if identity else same), value.other_host


def _check_replicas(found: list[tuple[str, Any]], replica_group: dist.ProcessGroup) -> None:
    """Refuses a ``replica_group`` that does not complete FSDP's shard groups to the world."""
    me, world = dist.get_rank(), dist.get_world_size()
    replicas = set(dist.get_process_group_ranks(replica_group))
    for name, module in found:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            if param_group._is_hsdp:
                raise ValueError(
                    f"replica_group: module {name!r} is sharded with FSDP's own HSDP (a 2-D "
                    f"mesh), which reduces the replicas itself; give fully_shard the shard "
                    f"group's mesh only"
                )
            shard = param_group._all_gather_process_group
            ranks = set(dist.get_process_group_ranks(shard))
            if ranks & replicas != {me} or len(ranks) * len(replicas) != world:
                raise ValueError(
                    f"replica_group: expected the ranks that hold this rank's shard elsewhere "
                    f"(one per shard group, {world} // {len(ranks)} of them, sharing only this "
                    f"rank {me} with module {name!r}'s shard group {sorted(ranks)}), "
                    f"got ranks {sorted(replicas)}"
                )


def _codecs_text(value: QuantizedCommCodecs | None) -> str:
    """What ``value`` does, as ranks compare it: its codecs' fingerprints and names."""
    if value is None:
        return "None"
    if isinstance(value, HostCodecs):
        same, other = _codecs_text(value.same_host), _codecs_text(value.other_host)
        return f"same_host={same} other_host={other} ranks_per_host={value.ranks_per_host}"
    (f, fname), (b, bname) = fingerprint(value.forward), fingerprint(value.backward)
    return f"({fname} #{f:016x}, {bname} #{b:016x})"


def _agree(group: dist.ProcessGroup, what: dict[str, Any], where: str) -> None:
    """Raises :class:`CodecError` on every rank of ``group`` unless all give the same ``what``."""
    # Ranks that differ here would run different collectives (FSDP's own
    # on one, qcomm's exchange on another) and wait for each other forever.
    every: list[Any] = [None] * group.size()
    dist.all_gather_object(every, what, group=group)
    for key in what:
        values = [w[key] for w in every]
        if any(v != values[0] for v in values):
            told = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise CodecError(f"{key}: the ranks of the {where} give different values ({told})")


def fsdp_quantize(
    model: torch.nn.Module,
    *,
    gradients: Any = None,
    weights: Any = None,
    error_feedback: bool = False,
    replica_group: dist.ProcessGroup | None = None,
    chunk_bytes: int | None = None,
) -> FSDPCommState:
    r"""
    fsdp_quantize(model, *, gradients=None, weights=None, error_feedback=False, replica_group=None, chunk_bytes=None) -> FSDPCommState

    Gives every ``FSDPModule`` of ``model`` (made by ``fully_shard``) qcomm's
    reduce-scatter of gradients and all-gather of weights with the codecs
    given; call it on every rank after ``fully_shard`` and before the first
    forward pass (see :doc:`fsdp`).

    Gradients are encoded, exchanged, decoded and summed in float32, then
    FSDP's op is applied (``AVG``, ``SUM``, ``PREMUL_SUM``). Each weight
    shard is sent once, and every rank, the shard's owner included (it
    encodes and decodes its own shard locally), builds the parameter from
    the same decoded values: replicas stay identical to the bit. With
    ``replica_group`` (HSDP by host: ``fully_shard`` on the shard group
    inside a host), the replicas' gradients are averaged over it with
    :func:`~qcomm.all_reduce` (summed under a gradient divide factor). The
    ranks first agree on the arguments over each shard group and the replica
    group; in-band statuses and failure on every rank are then those of the
    collectives (:mod:`qcomm.collectives`).

    Args:
        model (torch.nn.Module): the model, with ``fully_shard`` applied.
        gradients (str | QuantizedCommCodec | QuantizedCommCodecs | HostCodecs, optional):
            the reduce-scatter's codec (a pair's forward codec), as a spec
            (``"int8"``), codec object, ``QuantizedCommCodecs`` pair or codecs
            by host (``"same_host=noop+other_host=int8"``:
            with ``replica_group``, the same-host pair inside the shard group
            and the other-host pair between replicas). Default: ``None``
            (FSDP's own reduce-scatter).
        weights (str | QuantizedCommCodec | QuantizedCommCodecs | HostCodecs, optional):
            the all-gather's codec (a pair's forward codec); codecs by host only with
            ``replica_group``. Default: ``None`` (FSDP's own all-gather).
        error_feedback (bool, optional): carry what the gradients' codecs lose
            into the next step, per module (a float32 residual as long as its
            unsharded gradients, on every rank). Default: ``False``.
        replica_group (ProcessGroup, optional): the replicas of HSDP (one rank
            per host), whose gradients qcomm averages; ``fully_shard`` must
            then shard over the shard group only. Default: ``None``.
        chunk_bytes (int, optional): the collectives' chunk size. Default:
            ``None`` (automatic).

    Returns:
        FSDPCommState: the codecs and the residuals, to save with the model.

    Raises:
        CodecError: if a spec names no installed codec or breaks the contract,
            or the ranks give different arguments (on every rank).
        TypeError: if an argument has the wrong type.
        ValueError: if ``model`` holds no ``FSDPModule``, a module has more
            than one parameter group, a weight codec is stateful or
            stochastic (replicas would differ), a gradient codec is with
            ``error_feedback``, weights are given by host without
            ``replica_group``, or ``replica_group`` does not fit FSDP's mesh.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(4, 4))
        >>> state = fsdp_quantize(model, gradients="int8", weights="fp8_e4m3")
        >>> state.modules
        ['']
        >>> dist.destroy_process_group()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(error_feedback, bool):
        raise TypeError(
            f"error_feedback: expected a bool, got {type(error_feedback).__name__} "
            f"{error_feedback!r}"
        )
    if replica_group is not None and not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError(
            f"replica_group: expected a torch.distributed.ProcessGroup or None, "
            f"got {type(replica_group).__name__}"
        )
    chunk = check_chunk_bytes(chunk_bytes)
    hsdp = replica_group is not None
    grads, replicas = _split(_pair(gradients, "gradients"), hsdp, "gradients")
    gather, _ = _split(_pair(weights, "weights"), hsdp, "weights")
    if gather is not None:
        info = codec_info(gather.forward)
        if isinstance(gather.forward, AdaptiveCodec):
            # The owner encodes and decodes its own shard itself, with the
            # codec the exchange would use: which one an adaptive codec
            # chooses, only the exchange knows.
            raise ValueError(
                "weights: an adaptive or budgeted codec cannot gather weights: each shard's "
                "owner decodes its own shard with the codec itself, outside the exchange that "
                "chooses and measures it; give it to gradients, or a plain codec to weights"
            )
        if info.stateful or info.stochastic:
            raise ValueError(
                f"weights: codec {info.name!r} is {'stateful' if info.stateful else 'stochastic'}: "
                f"its peers and the shard's owner would decode different weights"
            )
    if not hsdp:
        replicas = None
    elif replicas is None:
        replicas = QuantizedCommCodecs()  # the replicas still need averaging
    if error_feedback and grads is not None and not isinstance(grads, HostCodecs):
        info = codec_info(grads.forward)
        if isinstance(grads.forward, AdaptiveCodec):
            # The residual comes of a second, local encoding with the codec
            # itself (see below), which an adaptive codec leaves to the exchange.
            raise ValueError(
                "error_feedback: an adaptive or budgeted gradient codec cannot carry error "
                "feedback in FSDP2: the residual is what a second, local encoding of each "
                "block loses, and only the exchange knows which candidate encoded it; drop "
                "error_feedback or give a plain codec"
            )
        if info.stateful or info.stochastic:
            # The residual is what a second, local encoding of each block
            # loses, not what the wire lost: the same only for a codec that
            # encodes a block alike every time.
            raise ValueError(
                f"error_feedback: gradient codec {info.name!r} is "
                f"{'stateful' if info.stateful else 'stochastic'}: error feedback needs one "
                f"that encodes a block alike every time"
            )
    if error_feedback and isinstance(grads, HostCodecs):
        raise ValueError(
            "error_feedback: with gradients by host, give replica_group (HSDP): error feedback "
            "applies between hosts"
        )
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("model: expected fully_shard applied to it or its submodules, found none")
    if replica_group is not None:
        _check_replicas(found, replica_group)
    what = {
        "gradients": _codecs_text(grads),
        "weights": _codecs_text(gather),
        "error_feedback": error_feedback,
        "replica_group": None if replica_group is None else replica_group.size(),
        "replicas": _codecs_text(replicas),
        "model": [name for name, _ in found],
    }
    agreed: set[int] = set()
    for _, module in found:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            shard = param_group._all_gather_process_group  # FSDP's shard group
            if id(shard) not in agreed:
                agreed.add(id(shard))
                _agree(shard, what, "shard group")
    if replica_group is not None:
        _agree(replica_group, what, "replica_group")
    state = FSDPCommState(grads, gather, error_feedback, replica_group, replicas, chunk)
    for name, module in found:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"model: module {name!r} has {len(groups)} parameter groups; FSDP takes custom "
                f"collectives for one only"
            )
        if not groups:
            continue  # no parameters of its own: nothing to move
        state.modules.append(name)
        residuals = state._lazy_residuals(name)
        if grads is not None:
            module.set_custom_reduce_scatter(_QuantizedReduceScatter(state, name, grads))
        if gather is not None:
            module.set_custom_all_gather(_QuantizedAllGather(state, gather))
        if hsdp:
            if error_feedback:
                residuals.replicas = Residuals()
            module.set_all_reduce_hook(_replica_hook(state, name, groups[0]))
    return state
