"""
Argument checks shared by the collectives, run before any communication.

A mistake on one rank does not fail alone: the other ranks wait for data
that never comes, or receive garbage. So whatever a rank can check about its
own call is checked here, and raises at once.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from qcomm.adaptive import AdaptiveCodec
from qcomm.collectives._backends import Backend
from qcomm.collectives._hosts import ByHost, ranks_per_host
from qcomm.types import (
    CODEC_MEMBERS,
    CodecError,
    HostCodecs,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    codec_info,
    read_quantized_dtype,
)

# Split entries must fit in a tensor's int64 sizes.
_MAX_SPLIT = 1 << 63

# This rank and the world size of each group, asked of torch once per group:
# its lookups cost microseconds each, a fair share of a small call.
_members: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, int]] = (
    weakref.WeakKeyDictionary()
)


_UNINITIALISED = (
    "group: expected an initialised process group, got none "
    "(call torch.distributed.init_process_group first)"
)


def resolve_group(group: Any) -> tuple[dist.ProcessGroup, int, int]:
    """The process group of a call (``None``: the default group), this rank and the world size."""
    # The default group is looked up late so that importing qcomm never
    # requires an initialised process group (it is None until then).
    if not dist.is_available():
        raise ValueError(_UNINITIALISED)
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise ValueError(_UNINITIALISED)
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        # What new_group() hands the processes it leaves out.
        raise ValueError(
            "group: this process is not a member of the given process group "
            "(new_group returned NON_GROUP_MEMBER here)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    known = _members.get(group)
    if known is not None and group not in dist.distributed_c10d._world.pg_map:
        known = None  # destroyed since: torch says so below
    if known is None:
        if not dist.is_initialized():  # a group kept from before a destroy
            raise ValueError(_UNINITIALISED)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        known = _members[group] = (rank, dist.get_world_size(group))
    return group, *known


def check_input(input: Any, name: str, backend: Backend, ndim: int | None = None) -> None:
    """Checks a collective's input tensor: type, dtype, layout, dimensions and device (``backend``: the call's)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {input.dtype}")
    if input.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {input.layout}")
    if ndim is not None and input.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D tensor, got {input.dim()}-D of shape {tuple(input.shape)}"
        )
    if input.dim() < 1:
        raise ValueError(f"{name}: expected at least 1 dimension, got a 0-D tensor")
    if input.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")
    # A tensor the backend cannot move fails deep inside it (or hangs the
    # peers), so say so here.
    if backend.problem is not None:
        raise ValueError(f"{name}: {backend.problem}")


def check_splits(
    splits: Any, name: str, world_size: int, total: int | None = None, what: str = ""
) -> list[int]:
    """Checks a split list: one non-negative int per rank, summing to ``total`` if given."""
    if type(splits) is list and len(splits) == world_size and set(map(type, splits)) <= {int}:
        # The usual list of plain ints (a bool's type is not int), checked in
        # C steps; anything else takes the checks below, which name the fault.
        if not splits or (min(splits) >= 0 and max(splits) < _MAX_SPLIT):
            if total is None or sum(splits) == total:
                return list(splits)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, Sequence) or isinstance(splits, str):
        raise TypeError(
            f"{name}: expected a list of {world_size} non-negative ints, got {type(splits).__name__}"
        )
    out: list[int] = []
    for i, s in enumerate(splits):
        if isinstance(s, bool):
            raise TypeError(f"{name}[{i}]: expected an int, got bool {s!r}")
        try:
            value = operator.index(s)
        except TypeError:
            raise TypeError(f"{name}[{i}]: expected an int, got {type(s).__name__} {s!r}") from None
        if not 0 <= value < _MAX_SPLIT:
            raise ValueError(
                f"{name}[{i}]: expected a non-negative int below 2**63, got {value}"
                if value >= 0
                else f"{name}[{i}]: expected a non-negative int, got {value}"
            )
        out.append(value)
    if len(out) != world_size:
        raise ValueError(
            f"{name}: expected one entry per rank ({world_size}), got {len(out)}: {out}"
        )
    if total is not None and sum(out) != total:
        raise ValueError(
            f"{name}: expected entries summing to {what} ({total}), got {sum(out)}: {out}"
        )
    return out


# Codecs found to follow the contract, with the backends and wire dtypes they
# passed for: a protocol check asks every member of the contract, a fair
# share of a small call. A codec object keeps its class from call to call;
# its wire dtype is read again every call (a codec changed in place to one
# the backend cannot carry is still refused).
_checked: weakref.WeakKeyDictionary[Any, set[tuple[Backend, Any]]] = weakref.WeakKeyDictionary()


def check_codec(codec: Any, name: str, backend: Backend) -> None:
    """Checks that ``codec`` follows the contract, runs on the call's device and its wire can travel."""
    if isinstance(codec, AdaptiveCodec):
        for i, candidate in enumerate(codec.candidates):
            check_codec(candidate, f"{name}.candidates[{i}]", backend)
        return
    try:
        passed = _checked.get(codec)
    except TypeError:  # not weakly referenceable, or unhashable: checked every time
        _check_codec(codec, name, backend)
        return
    if passed is not None:
        try:
            if (backend, read_quantized_dtype(codec)) in passed:
                return
        except Exception:  # noqa: BLE001 - the full check below says what is wrong
            pass
    _check_codec(codec, name, backend)
    _checked.setdefault(codec, set()).add((backend, read_quantized_dtype(codec)))


def _check_codec(codec: Any, name: str, backend: Backend) -> None:
    if not isinstance(codec, QuantizedCommCodec):
        missing = [m for m in CODEC_MEMBERS if not hasattr(codec, m)]
        raise TypeError(
            f"{name}: expected an object following the qcomm.QuantizedCommCodec contract, "
            f"got {type(codec).__name__} missing {', '.join(missing)}"
        )
    for member in CODEC_MEMBERS:
        if member != "quantized_dtype" and not callable(getattr(codec, member)):
            value = getattr(codec, member)
            raise TypeError(
                f"{name}.{member}: expected a method of the codec contract, "
                f"got {type(value).__name__} {value!r}"
            )
    dtype = read_quantized_dtype(codec)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{name}.quantized_dtype: expected a torch.dtype, got {type(dtype).__name__} {dtype!r}"
        )
    info = codec_info(codec)
    device = backend.device
    if device.type not in info.devices:
        raise CodecError(
            f"{name}: codec {info.name!r} runs on {', '.join(info.devices)}, "
            f"got a tensor on {device.type}"
        )
    limit = backend.dtypes
    if limit is not None and dtype not in limit[1]:
        raise CodecError(
            f"{name}: codec {info.name!r} sends {dtype}, which the {limit[0]} backend cannot "
            f"carry (it carries {', '.join(sorted(str(d) for d in limit[1]))})"
        )


def resolve_codecs(codecs: Any, dtype: torch.dtype, backend: Backend) -> tuple[Any, Any]:
    """
    The checked forward and backward codecs of a call (no-op codecs for
    ``codecs=None``; a :class:`~._hosts.ByHost` each for a :class:`~qcomm.HostCodecs`).
    """
    if isinstance(codecs, HostCodecs):
        return by_host(codecs, "codecs", backend)
    if codecs is not None:
        if not (hasattr(codecs, "forward") and hasattr(codecs, "backward")):
            raise TypeError(
                "codecs: expected a qcomm.QuantizedCommCodecs (an object with forward and "
                f"backward codecs) or None, got {type(codecs).__name__}"
            )
        check_codec(codecs.forward, "codecs.forward", backend)
        check_codec(codecs.backward, "codecs.backward", backend)
        return codecs.forward, codecs.backward
    limit = backend.dtypes
    if limit is not None and dtype not in limit[1]:
        raise TypeError(
            f"input: the {limit[0]} backend cannot carry {dtype} as it is; give codecs "
            f"that encode it (e.g. fp16) or convert the input"
        )
    # Without codecs the data travels in its own dtype, as with a plain
    # collective: no cast, no extra bytes.
    noop = _noop(dtype)
    return noop, noop


# qcomm's no-op codec of each dtype, made once (it keeps no state).
_noops: dict[torch.dtype, NoOpQuantizedCommCodec] = {}


def _noop(dtype: torch.dtype) -> NoOpQuantizedCommCodec:
    noop = _noops.get(dtype)
    if noop is None:
        noop = _noops[dtype] = NoOpQuantizedCommCodec(dtype)
    return noop


def pair_codecs(
    reduce_codec: Any, gather_codec: Any, policy: Any, dtype: torch.dtype, backend: Backend
) -> tuple[Any, Any]:
    """
    The all-reduce's checked reduce-scatter and all-gather codecs (each a
    :class:`~._hosts.ByHost` for a ``by_host`` ``policy``).
    """
    if policy is not None:
        if not isinstance(policy, HostCodecs):
            raise TypeError(
                f"by_host: expected a qcomm.HostCodecs or None, got {type(policy).__name__}"
            )
        if reduce_codec is not None or gather_codec is not None:
            raise ValueError(
                "by_host: gives the codecs by host (forward: the reduce-scatter's, backward: "
                "the all-gather's); leave reduce_codec and gather_codec unset"
            )
        return resolve_codecs(policy, dtype, backend)
    codecs = []
    for name, codec in (("reduce_codec", reduce_codec), ("gather_codec", gather_codec)):
        codec = _noop(dtype) if codec is None else codec
        check_codec(codec, name, backend)
        codecs.append(codec)
    return codecs[0], codecs[1]


def by_host(policy: HostCodecs, name: str, backend: Backend) -> tuple[ByHost, ByHost]:
    """The checked forward and backward codecs of a :class:`~qcomm.HostCodecs`, by host."""
    per_host, source = ranks_per_host(policy.ranks_per_host)
    sides = []
    for side in ("forward", "backward"):
        same = getattr(policy.same_host, side)
        other = getattr(policy.other_host, side)
        check_codec(same, f"{name}.same_host.{side}", backend)
        check_codec(other, f"{name}.other_host.{side}", backend)
        sides.append(ByHost(same, other, per_host, source))
    return sides[0], sides[1]


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def check_chunk_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"chunk_bytes: expected None (automatic) or a positive int, got "
            f"{type(value).__name__} {value!r}"
        )
    if value <= 0:
        raise ValueError(f"chunk_bytes: expected a positive number of bytes, got {value}")
    return value
