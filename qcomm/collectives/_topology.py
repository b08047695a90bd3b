"""
The exchanges of an all-reduce, from where its ranks are: a reduce-scatter
and an all-gather among all ranks, or, under a :class:`~qcomm.HostCodecs`
on hosts of equal size, four (docs/topology.rst).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qcomm.collectives._call import Call
from qcomm.collectives._exchange import send_order
from qcomm.collectives._hosts import ByHost, host_of_ranks


@dataclasses.dataclass
class Step:
    """One exchange of an all-reduce: a reduce-scatter or an all-gather, among ``peers``."""

    gather: bool
    codec: Any
    peers: list[int]
    where: str = ""
    #: whether error feedback (the residuals) applies to it
    feedback: bool = True
    #: the blocks each peer (and this rank) sums or holds; default: its own
    blocks: dict[int, list[int]] | None = None
    #: whether an all-gather divides the sum first (for an average)
    divides: bool = True

    @property
    def name(self) -> str:
        return f"all_reduce {'all-gather' if self.gather else 'reduce-scatter'}{self.where}"


def steps(reduce: Any, gather: Any, call: Call) -> list[Step]:
    """
    The exchanges of the call: a reduce-scatter and an all-gather among all
    ranks, or, by host on hosts of equal size, four (see :doc:`topology`).
    """
    rank, world = call.rank, call.world
    everyone = send_order(rank, world)
    if not isinstance(reduce, ByHost):
        return [Step(False, reduce, everyone), Step(True, gather, everyone)]
    hosts = host_of_ranks(call.group, reduce.ranks_per_host, call.backend.device)
    members: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(r)
    sizes = {len(m) for m in members.values()}
    if len(members) == 1:
        return [Step(False, reduce.same, everyone), Step(True, gather.same, everyone)]
    if sizes == {1} or len(sizes) > 1:
        # One rank per host, or hosts of unequal sizes: flat, with one codec
        # for every peer (an all-gather must give every rank the same values).
        return [Step(False, reduce.other, everyone), Step(True, gather.other, everyone)]
    place = {r: members[hosts[r]].index(r) for r in range(world)}
    # Within the host, each peer sums the blocks of the ranks with its place.
    blocks = {q: [r for r in range(world) if place[r] == place[q]] for q in members[hosts[rank]]}
    in_host = [q for q in everyone if hosts[q] == hosts[rank]]
    across = [p for p in everyone if place[p] == place[rank]]
    return [
        Step(False, reduce.same, in_host, " in host", feedback=False, blocks=blocks),
        Step(False, reduce.other, across, " between hosts"),
        Step(True, gather.other, across, " between hosts"),
        Step(True, gather.same, in_host, " in host", False, blocks, divides=False),
    ]
