"""
How the all-reduce splits a flat buffer (a DDP bucket) into one block per
rank: :func:`split_blocks`, which the all-reduce cuts by and the DDP hook's
residuals are laid out by, so that the two cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Any

from qcomm.collectives._hosts import ByHost
from qcomm.types import CodecInfo, HostCodecs

__all__ = ["granule", "layout", "split_blocks"]

# The largest block alignment asked of the layout: a codec that scales
# longer blocks than this pads its last block instead.
_MAX_GRANULE = 4096


def granule(*codecs: Any) -> int:
    r"""
    granule(*codecs: Any) -> int

    The block alignment that :func:`layout` takes: the least common multiple
    of the codecs' :attr:`~qcomm.CodecInfo.error_block`, so that only the
    last block pads (``1`` when none declares one, or it is over 4096).

    Args:
        *codecs (Any): the codecs.

    Returns:
        int: elements.

    Examples::

        >>> from qcomm import NoOpQuantizedCommCodec
        >>> granule(NoOpQuantizedCommCodec())
        1
    """
    out = 1
    for codec in codecs:
        info = getattr(codec, "info", None)
        if isinstance(info, CodecInfo) and info.error_block >= 1:
            out = math.lcm(out, info.error_block)
    return out if out <= _MAX_GRANULE else 1


def layout(numel: int, world: int, granule: int) -> list[int]:
    r"""
    layout(numel: int, world: int, granule: int) -> list[int]

    Where each rank's block of a buffer starts: at multiples of ``granule``;
    the last blocks may be shorter, or empty.

    Args:
        numel (int): elements of the buffer.
        world (int): ranks, one block each.
        granule (int): block alignment, in elements.

    Returns:
        list[int]: ``world + 1`` offsets; block :math:`r` is
        ``[offsets[r], offsets[r + 1])``.

    Examples::

        >>> layout(100, 2, 32)
        [0, 64, 100]
        >>> layout(10, 3, 32)
        [0, 10, 10, 10]
        >>> layout(9, 3, 1)
        [0, 3, 6, 9]
    """
    per = -(-numel // world // granule) * granule
    return [min(r * per, numel) for r in range(world)] + [numel]


def split_blocks(numel: int, world: int, *codecs: Any) -> list[int]:
    """
    Where each rank's block of a buffer of ``numel`` elements starts, as the
    all-reduce with these codecs cuts it (:func:`layout` at the
    :func:`granule` of every codec it runs: a ``None`` stands for no codec,
    a :class:`~._hosts.ByHost` or :class:`~qcomm.HostCodecs` for all of its).
    """
    every = [c for codec in codecs for c in _every_codec(codec)]
    return layout(numel, world, granule(*every))


def _every_codec(codec: Any) -> list[Any]:
    if isinstance(codec, HostCodecs):
        pairs = (codec.same_host, codec.other_host)
        return [c for pair in pairs for c in (pair.forward, pair.backward)]
    if codec is None:
        return []
    return [codec.same, codec.other] if isinstance(codec, ByHost) else [codec]
