r"""
The all-reduce of a flat buffer with codecs, which the DDP communication hook
(:func:`~qcomm.ddp_comm_hook`) runs on every gradient bucket: an encoded
reduce-scatter, then an encoded all-gather, on the exchange of the other
collectives. See :doc:`ddp` for the steps, their error bound and error
feedback.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qcomm import _events
from qcomm.collectives._args import check_chunk_bytes, check_flag, check_input, pair_codecs
from qcomm.collectives._blocks import _every_codec, granule, layout, split_blocks
from qcomm.collectives._call import begin
from qcomm.collectives._coding import is_identity
from qcomm.collectives._compiled import chained, group_name, group_of, kept, object_key
from qcomm.collectives._feedback import Residuals, check_residuals
from qcomm.collectives._reduce import reduce_in_steps
from qcomm.collectives._topology import steps
from qcomm.types import HostCodecs

__all__ = ["Residuals", "all_reduce", "granule", "layout"]


def all_reduce(
    buffer: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    reduce_codec: Any | None = None,
    gather_codec: Any | None = None,
    average: bool = False,
    residuals: Residuals | None = None,
    chunk_bytes: int | None = None,
    by_host: HostCodecs | None = None,
) -> torch.Tensor:
    r"""
    all_reduce(buffer, *, group=None, reduce_codec=None, gather_codec=None, average=False, residuals=None, chunk_bytes=None, by_host=None) -> Tensor

    Sums (or averages) a 1-D buffer over the ranks in place: an encoded
    reduce-scatter, then an encoded all-gather. With ``by_host``, on hosts
    with equal numbers of ranks, it is hierarchical: a reduce-scatter inside
    each host, a reduce-scatter and an all-gather of each rank's block
    between hosts, an all-gather inside each host (see :doc:`topology`).

    Every rank ends with the same values, each off the exact sum by at most
    what the codecs' bounds allow (see :class:`~qcomm.CodecInfo` and
    :doc:`ddp`). An infinity or NaN on any rank leaves that place not finite
    on every rank, with codecs that keep NaN as the built-in ones do. With
    ``residuals``, what each codec lost is added to what this rank sends from
    the same place on the next call (error feedback).

    .. note::
        Every rank of ``group`` must make the same calls, in the same order,
        with buffers of the same length and dtype, the same codecs and the
        same ``average``, ``chunk_bytes`` and use of ``residuals``; the
        first call on each group checks that they do, as the other
        collectives do. The call returns when the buffer holds the result.

    Args:
        buffer (Tensor): 1-D contiguous floating-point tensor; overwritten.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        reduce_codec (QuantizedCommCodec, optional): the reduce-scatter's
            codec. Default: ``None`` (the no-op codec: the buffer's dtype travels).
        gather_codec (QuantizedCommCodec, optional): the all-gather's codec.
            Default: ``None`` (the no-op codec).
        average (bool, optional): divide the sum by the world size.
            Default: ``False``.
        residuals (Residuals, optional): error feedback state of this buffer,
            filled in on first use, emptied when a call fails and left empty
            when both codecs are the no-op codec. Default: ``None`` (no error
            feedback).
        chunk_bytes (int, optional): the exchanges' chunk size, as for the
            collectives. Default: ``None`` (automatic).
        by_host (HostCodecs, optional): codecs by host, instead of
            ``reduce_codec`` and ``gather_codec``: each pair's forward codec
            reduces, its backward codec gathers; error feedback applies
            between hosts only. Default: ``None``.

    Returns:
        Tensor: ``buffer``, holding the result.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if ``buffer`` is not 1-D and contiguous, ``chunk_bytes``
            is not positive, or ``residuals`` does not fit the buffer.
        CodecError: if a codec fails or breaks its contract, on this rank or
            another, or the ranks' calls disagree (checked as for the other
            collectives: see :mod:`qcomm.collectives`).

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> all_reduce(torch.ones(4), average=True).tolist()
        [1.0, 1.0, 1.0, 1.0]
        >>> dist.destroy_process_group()
    """
    if torch.compiler.is_compiling():
        if not buffer.is_contiguous():
            # Checked here: the operator's call sees a contiguous copy.
            raise ValueError("buffer: expected a contiguous tensor")
        keys = [object_key(value) for value in (reduce_codec, gather_codec, residuals, by_host)]
        reduced = _all_reduce_op(buffer, group_name(group), average, chunk_bytes, *keys)
        return buffer.copy_(reduced)
    with begin("all_reduce", group, buffer, "all_reduce") as call:
        rank, world = call.rank, call.world
        with call.agreement as agree:
            check_input(buffer, "buffer", call.backend, ndim=1)
            if not buffer.is_contiguous():
                raise ValueError("buffer: expected a contiguous tensor")
            check_flag(average, "average")
            if residuals is not None and not isinstance(residuals, Residuals):
                raise TypeError(
                    f"residuals: expected a Residuals or None, got {type(residuals).__name__}"
                )
            chunk = check_chunk_bytes(chunk_bytes)
            reduce, gather = pair_codecs(
                reduce_codec, gather_codec, by_host, buffer.dtype, call.backend
            )
            every = _every_codec(reduce) + _every_codec(gather)
            bounds = split_blocks(buffer.numel(), world, reduce, gather)
            if all(is_identity(codec, buffer.dtype) for codec in every):
                residuals = None  # nothing is lost, nothing to keep
            if residuals is not None:
                own = bounds[rank + 1] - bounds[rank]
                check_residuals(residuals, bounds[-1], own, call.backend.device)
            agree.same("buffer", f"{buffer.numel()} elements of {buffer.dtype}")
            agree.same("reduce_codec", reduce)
            agree.same("gather_codec", gather)
            agree.same("average", str(average))
            agree.same("residuals", "error feedback" if residuals is not None else "none")
            agree.same("chunk_bytes", [chunk or 0])
        if world == 1 or buffer.numel() == 0:
            return buffer  # nothing to move: no communication at all
        try:
            exchanges = steps(reduce, gather, call)
            reduce_in_steps(buffer, call, exchanges, bounds, residuals, chunk, average)
        except BaseException:
            call.abandon()
            if residuals is not None:
                residuals.scatter = residuals.gather = None
            raise
    return buffer


def _all_reduce_impl(
    buffer: torch.Tensor, group: str, average: bool, chunk_bytes: int | None, *keys: str
) -> torch.Tensor:
    # What a compiled graph runs: the eager all-reduce on a copy of the
    # buffer (an operator's output may not be its input); the traced
    # function copies it back in place.
    _events.emit("compiled_call", "all_reduce")
    names = ("reduce_codec", "gather_codec", "residuals", "by_host")
    objects = {name: kept(key, f"all_reduce: {name}") for name, key in zip(names, keys)}
    reduced = buffer.clone()
    all_reduce(reduced, group=group_of(group), average=average, chunk_bytes=chunk_bytes, **objects)
    return reduced


def _all_reduce_fake(buffer: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(buffer)


_all_reduce_op = chained(
    "all_reduce",
    "(Tensor buffer, str group, bool average, int? chunk_bytes, str reduce_codec, "
    "str gather_codec, str residuals, str by_host) -> Tensor",
    _all_reduce_impl,
    _all_reduce_fake,
)
