"""
Which ranks share a host, and the codec each peer takes under a
:class:`~qcomm.HostCodecs`: the same-host codec for a peer on this rank's
host, the other-host codec for the rest (docs/topology.rst).

A group's hosts come from, in order: the policy's ``ranks_per_host``, the
setting ``ranks_per_host`` (:mod:`qcomm.config`: set in code,
``QCOMM_RANKS_PER_HOST`` or torchrun's ``LOCAL_WORLD_SIZE``; ranks numbered
host by host, as torchrun does), or else the ranks' host names, exchanged
once per group. The first two are read on each rank alone, so the ranks
compare them in their agreement check; the host names are the same table on
every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import weakref
from typing import Any

import torch
import torch.distributed as dist

from qcomm import config
from qcomm.collectives import _backends

# Host names learned by exchange, by group: the host index of every rank.
_by_name: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)


def ranks_per_host(given: int | None) -> tuple[int | None, str]:
    """
    Ranks per host as this rank reads them (``None``: learn the host names),
    and where from: ``given`` (the policy's), or the settings' (set in code,
    ``QCOMM_RANKS_PER_HOST`` or torchrun's ``LOCAL_WORLD_SIZE``).
    """
    if given is not None:
        return given, "ranks_per_host"
    value, where = config._read("ranks_per_host")
    if value is None:
        return None, "host names"
    return value, where


@dataclasses.dataclass(frozen=True)
class ByHost:
    """One direction's codecs of a :class:`~qcomm.HostCodecs`, and how hosts are told apart."""

    same: Any
    other: Any
    #: ranks per host as this rank reads them; ``None``: by host name
    ranks_per_host: int | None
    #: where ``ranks_per_host`` comes from (for messages)
    source: str

    def describe(self, codec: Any) -> str:
        """What the ranks compare: both codecs (described by ``codec``) and the hosts."""
        hosts = (
            f"{self.ranks_per_host} ranks per host ({self.source})"
            if self.ranks_per_host is not None
            else "hosts by name"
        )
        # Each part of a codec's description named by its class of peer, so
        # that a disagreement names the side that differs.
        parts = [
            f"{side} {part}"
            for side, value in (("same host", self.same), ("other hosts", self.other))
            for part in codec(value).split("; ")
        ]
        return "; ".join([*parts, hosts])


def host_of_ranks(
    group: dist.ProcessGroup, per_host: int | None, device: torch.device
) -> list[int]:
    """The host index of every rank of ``group`` (by global rank, or by host name)."""
    world = dist.get_world_size(group)
    if per_host is not None:
        return [dist.get_global_rank(group, r) // per_host for r in range(world)]
    found = _by_name.get(group)
    if found is None:
        found = _by_name[group] = _exchange_names(group, world, device)
    return list(found)


def _exchange_names(group: dist.ProcessGroup, world: int, device: torch.device) -> tuple[int, ...]:
    # One int64 per rank: a hash of its host name, numbered in order of
    # first appearance.
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = int.from_bytes(digest[:8], "little", signed=True)
    where = _backends.small_exchange_device(group, device)
    if where is None:
        raise ValueError(
            "by host: NCCL needs a GPU to exchange host names; set QCOMM_RANKS_PER_HOST"
        )
    row = torch.tensor([mine], dtype=torch.int64, device=where)
    names = _backends.gather_rows(group, world, row).view(-1).tolist()
    first = {h: i for i, h in reversed(list(enumerate(names)))}
    order = {h: n for n, h in enumerate(sorted(first, key=first.__getitem__))}
    return tuple(order[h] for h in names)


def per_peer(codec: Any, group: dist.ProcessGroup, rank: int, device: torch.device) -> list[Any]:
    """The codec of every rank of ``group`` from this rank's side: ``codec``, or by host."""
    world = dist.get_world_size(group)
    if not isinstance(codec, ByHost):
        return [codec] * world
    hosts = host_of_ranks(group, codec.ranks_per_host, device)
    return ByPeer(
        [codec.same if hosts[p] == hosts[rank] else codec.other for p in range(world)],
        (codec.same, codec.other),
    )


class ByPeer(list[Any]):
    """The codec of every rank, and ``sides``: the same host's and the other hosts' (alike on every rank)."""

    def __init__(self, codecs: list[Any], sides: tuple[Any, Any]) -> None:
        super().__init__(codecs)
        self.sides = sides
