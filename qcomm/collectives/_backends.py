"""
What each ``torch.distributed`` backend can do, in one place: which devices'
tensors it moves, which dtypes it carries, and whether its point-to-point
messages move on their own (gloo's threads) so that a call may post them all
and return. The collectives ask here; no other module names a backend.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# What gloo carries on CPU (torch 2.13); it refuses int16, the unsigned ints
# above 8 bits and the float8 dtypes with a bare "Invalid scalar type".
_GLOO_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)

# backend -> (device types it moves, dtypes it carries on CPU or None for
# any, whether its point-to-point messages on CPU move on their own)
_TABLE: dict[str, tuple[frozenset[str], frozenset[torch.dtype] | None, bool]] = {
    "gloo": (frozenset({"cpu", "cuda"}), _GLOO_DTYPES, True),
    # NCCL moves only CUDA memory; a CPU tensor fails deep inside it (or
    # hangs the peers).
    "nccl": (frozenset({"cuda"}), None, False),
}


def by_device(backend: str) -> dict[str, str]:
    """
    The backend that moves each device type's tensors, from
    ``dist.get_backend``'s text: ``"gloo"``, ``"nccl"``, or per device as
    ``"cpu:gloo,cuda:nccl"``. A backend not in the table is taken to move
    every device.
    """
    text = backend.strip().lower()
    if ":" not in text:
        devices = _TABLE[text][0] if text in _TABLE else frozenset({"cpu", "cuda"})
        return {device: text for device in devices}
    out = {}
    for item in text.split(","):
        device, _, name = item.partition(":")
        out[device.strip()] = name.strip()
    return out


def _of(group: Any, device_type: str) -> str | None:
    return by_device(str(dist.get_backend(group))).get(device_type)


def device_problem(group: Any, device: torch.device) -> str | None:
    """Why ``group`` cannot move tensors on ``device``, or ``None`` if it can."""
    if _of(group, device.type) is not None:
        return None
    return (
        f"the process group's backend is {dist.get_backend(group)}, which moves tensors on "
        f"{', '.join(sorted(by_device(str(dist.get_backend(group)))))} only; got a tensor "
        f"on {device}"
    )


def dtype_limit(group: Any, device: torch.device) -> tuple[str, frozenset[torch.dtype]] | None:
    """The backend that moves ``device``'s tensors on ``group`` and the only
    dtypes it carries, where it refuses others; ``None`` where it carries any."""
    if group is None or device.type != "cpu":
        return None
    name = _of(group, "cpu")
    dtypes = _TABLE[name][1] if name in _TABLE else None
    return None if name is None or dtypes is None else (name, dtypes)


def moves_alone(group: Any, device: torch.device) -> bool:
    """Whether ``group``'s point-to-point messages of ``device``'s tensors move
    on their own (gloo on CPU): the point-to-point transport's condition."""
    name = _of(group, device.type) if device.type == "cpu" else None
    return name in _TABLE and _TABLE[name][2]


# Compared and hashed as an object (one per group and device, see backend_of):
# a call looks its codecs' checks up by it, and hashing its fields (a
# frozenset among them) every call would cost more than the lookup.
@dataclass(frozen=True, eq=False)
class Backend:
    """What a group's backend does with one device's tensors: what a call asks, once."""

    #: where the call's tensors live
    device: torch.device
    #: why the backend cannot move them, or ``None``
    problem: str | None
    #: the backend's name and the only dtypes it carries there, or ``None`` for any
    dtypes: tuple[str, frozenset[torch.dtype]] | None
    #: whether its point-to-point messages move on their own there
    moves_alone: bool


# What each group's backend does with each device, asked once: a group's
# backend never changes, and asking torch costs a small call dearly.
_known: weakref.WeakKeyDictionary[Any, dict[torch.device, Backend]] = weakref.WeakKeyDictionary()


def backend_of(group: Any, device: torch.device) -> Backend:
    """What ``group``'s backend does with ``device``'s tensors."""
    by_group = _known.get(group)
    if by_group is None:
        by_group = _known[group] = {}
    found = by_group.get(device)
    if found is None:
        found = by_group[device] = Backend(
            device,
            device_problem(group, device),
            dtype_limit(group, device),
            moves_alone(group, device),
        )
    return found


def cuda_only(group: Any) -> bool:
    """Whether ``group`` moves CUDA tensors only (NCCL alone)."""
    return set(by_device(str(dist.get_backend(group)))) == {"cuda"}


def small_exchange_device(group: Any, device: torch.device | None) -> torch.device | None:
    """
    Where a small exchange of the group's ranks (the agreement check, host
    names) runs: ``device`` (the call's, if it has one) where the backend
    moves its tensors, else this rank's current GPU for NCCL (``None``
    without one), else the CPU.
    """
    nccl_only = cuda_only(group)
    if device is not None and not (nccl_only and device.type != "cuda"):
        return device
    if nccl_only:
        # No usable tensor to tell where this rank's GPU is: its current one.
        return (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
    return torch.device("cpu")


def gather_rows(group: Any, world: int, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D row ``mine``, as ``[world, len(mine)]`` on every rank."""
    # Every rank sends its row to every rank: on gloo a small all-to-all
    # takes half the time of its all-gather.
    out = mine.new_empty(world * mine.numel())
    dist.all_to_all_single(out, mine.repeat(world), group=group)
    return out.view(world, -1)
