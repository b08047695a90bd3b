r"""
The all-gather: every rank's block to every rank, the reduce-scatter's
adjoint. Not one of TorchRec's registry ops; it shows what a collective is in
qcomm: a call begun on its group, the arguments the ranks agree on, an
exchange of blocks, and its backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qcomm.awaitable import Awaitable
from qcomm.collectives._args import check_chunk_bytes, check_input, check_splits, resolve_codecs
from qcomm.collectives._call import Call, begin
from qcomm.collectives._compiled import Collective, define
from qcomm.collectives._layouts import gather_blocks, sum_blocks
from qcomm.collectives._pending import Pending, untracked

__all__ = ["all_gather_pooled"]


def all_gather_pooled(
    input: torch.Tensor,
    *,
    output_splits: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    chunk_bytes: int | None = None,
) -> Awaitable[torch.Tensor]:
    r"""
    all_gather_pooled(input, *, output_splits=None, group=None, codecs=None, chunk_bytes=None) -> Awaitable[Tensor]

    All-gather along dim 0, encoded with a codec on each pass: every rank
    receives every rank's ``input``, one after the other in rank order,

    .. math::

        \text{output} = \text{cat}(\text{input}^{(0)}, \ldots, \text{input}^{(W-1)})

    A rank's block is encoded once for all its peers; its own block is not
    encoded. The gradient goes back through a reduce-scatter: rank :math:`r`'s
    input gradient is the sum over ranks of their output gradient's block
    :math:`r`, summed after decoding, in float32 at least.

    See :mod:`qcomm.collectives` for what the collectives share.

    Args:
        input (Tensor): ``[output_splits[rank], ...]`` floating-point rows.
        output_splits (list[int], optional): rows of every rank's block.
            Default: ``None`` (every rank's as many as this one's).
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs).
        chunk_bytes (int, optional): the pipeline's chunk size in float32
            bytes. Default: ``None`` (automatic).

    Returns:
        Awaitable[Tensor]: the ``[sum(output_splits), ...]`` rows, in
        ``input``'s dtype.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if ``input`` and ``output_splits`` disagree, or the
            device does not suit the backend.
        CodecError: if a codec fails or breaks its contract, or the ranks
            disagree, or another rank's arguments are invalid.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> all_gather_pooled(torch.ones(2, 3)).wait().shape
        torch.Size([2, 3])
        >>> dist.destroy_process_group()
    """
    if torch.compiler.is_compiling():
        return _traced(input, (output_splits,), group, codecs, chunk_bytes)
    with begin("all_gather_pooled forward", group, input, "all_gather_pooled") as call:
        pg, world, rank = call.group, call.world, call.rank
        with call.agreement as agree:
            check_input(input, "input", call.backend)
            rows = input.shape[0]
            if output_splits is None:
                splits = [rows] * world
            else:
                splits = check_splits(output_splits, "output_splits", world)
                if splits[rank] != rows:
                    raise ValueError(
                        f"output_splits: this rank's block is input.shape[0] = {rows} rows, "
                        f"got output_splits[{rank}] = {splits[rank]}"
                    )
            chunk = check_chunk_bytes(chunk_bytes)
            forward, backward = resolve_codecs(codecs, input.dtype, call.backend)
            rest = tuple(input.shape[1:])
            agree.same("output_splits", splits)
            agree.same("input.shape[1:]", rest)
            agree.same("codecs.forward", forward)
            agree.same("codecs.backward", backward)
            agree.same("chunk_bytes", [chunk or 0])
        forward, backward = call.by_peer(forward), call.by_peer(backward)
        finish = gather_blocks(untracked(input), splits, forward, call, chunk, background=True)
        # Named after its forward call, as the other collectives' backward passes.
        backward_name = f"all_gather_pooled backward of call {call.number}"

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        # grad is every rank's block, in the input's dtype (Pending casts it).
        with begin(backward_name, pg, grad) as back:
            return sum_blocks(grad, splits, backward, back, chunk)()

    return Pending(input, finish, backward_fn, finish.out)


def _splits(rows: Any, world: int, splits: list[Any] | None) -> list[Any]:
    # Without splits, every rank's block has this rank's rows.
    return [rows] * world if splits is None else list(splits)


def _shape(
    input_shape: list[Any], rank: int, world: int, *, output_splits: list[Any] | None
) -> list[Any]:
    return [sum(_splits(input_shape[0], world, output_splits)), *input_shape[1:]]


def _gradient(
    grad: torch.Tensor,
    back: Call,
    backward: list[Any],
    input_shape: list[int],
    *,
    output_splits: list[int] | None,
    chunk_bytes: int | None,
) -> torch.Tensor:
    splits = _splits(input_shape[0], back.world, output_splits)
    return sum_blocks(grad, splits, backward, back, chunk_bytes)()


_traced = define(
    Collective(
        "all_gather_pooled",
        (("SymInt[]?", "output_splits"),),
        all_gather_pooled,
        _gradient,
        _shape,
    )
)
