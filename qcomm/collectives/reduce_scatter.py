r"""
The pooled-embedding reduce-scatter (TorchRec's
``POOLED_EMBEDDINGS_REDUCE_SCATTER``): every rank holds partial sums for every
rank's block and receives the total of its own block. Sums are taken after
decoding, never on the wire (docs/collectives.rst says why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qcomm.awaitable import Awaitable
from qcomm.collectives._args import (
    check_chunk_bytes,
    check_flag,
    check_input,
    check_splits,
    resolve_codecs,
)
from qcomm.collectives._call import Call, begin
from qcomm.collectives._compiled import Collective, define
from qcomm.collectives._layouts import gather_blocks, sum_blocks
from qcomm.collectives._pending import Pending, untracked

__all__ = ["reduce_scatter_pooled"]


def reduce_scatter_pooled(
    input: torch.Tensor,
    *,
    input_splits: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    gradient_division: bool = False,
    chunk_bytes: int | None = None,
) -> Awaitable[torch.Tensor]:
    r"""
    reduce_scatter_pooled(input, *, input_splits=None, group=None, codecs=None, gradient_division=False, chunk_bytes=None) -> Awaitable[Tensor]

    Reduce-scatter of pooled embeddings along dim 0, encoded with a codec on
    each pass.

    ``input`` is split on dim 0 into one block per rank (``input_splits[r]``
    rows for rank :math:`r`); the output on rank :math:`r` is the sum over all
    ranks of their block :math:`r`:

    .. math::

        \text{output}_r = \sum_{k} \text{input}^{(k)}_{[o_r, o_r + s_r)}, \quad
        o_r = \sum_{j < r} s_j

    Every block travels encoded and is summed after decoding, in float32 (at
    least), the ranks' blocks added in rank order on every rank (through a
    no-op codec, the bits of a reference that sums all ranks' data in rank
    order); a rank's own block is not encoded. Each block is padded at its
    end to what the codec's :meth:`~qcomm.QuantizedCommCodec.padded_size`
    asks for (the block seen as one row). The gradient goes back through an
    all-gather.

    See :mod:`qcomm.collectives` for what all three collectives share.

    Args:
        input (Tensor): ``[sum(input_splits), ...]`` floating-point partial sums.
        input_splits (list[int], optional): rows of every rank's block.
            Default: ``None`` (equal blocks; dim 0 must divide by the world size).
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs: the data travels in its
            own dtype).
        gradient_division (bool, optional): divide the input's gradient by
            the world size, as TorchRec does by default. Default: ``False``.
        chunk_bytes (int, optional): the pipeline's chunk size in float32
            bytes. Default: ``None`` (automatic).

    Returns:
        Awaitable[Tensor]: the ``[input_splits[rank], ...]`` sum, in ``input``'s
        dtype.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if shapes and ``input_splits`` disagree, or the device
            does not suit the backend.
        CodecError: if a codec fails or breaks its contract, or the ranks
            disagree, or another rank's arguments are invalid.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> reduce_scatter_pooled(torch.ones(2, 3)).wait().sum().item()
        6.0
        >>> dist.destroy_process_group()
    """
    if torch.compiler.is_compiling():
        own = (input_splits, gradient_division)
        return _traced(input, own, group, codecs, chunk_bytes)
    with begin("reduce_scatter_pooled forward", group, input, "reduce_scatter_pooled") as call:
        pg, world = call.group, call.world
        with call.agreement as agree:
            check_input(input, "input", call.backend)
            rows = input.shape[0]
            if input_splits is None:
                if rows % world:
                    raise ValueError(
                        f"input: with input_splits=None, expected dim 0 divisible by the world "
                        f"size ({world}), got {rows}"
                    )
                splits = [rows // world] * world
            else:
                splits = check_splits(input_splits, "input_splits", world, rows, "input.shape[0]")
            divide = world if check_flag(gradient_division, "gradient_division") else 1
            chunk = check_chunk_bytes(chunk_bytes)
            forward, backward = resolve_codecs(codecs, input.dtype, call.backend)
            rest = tuple(input.shape[1:])
            agree.same("input_splits", splits)
            agree.same("input.shape[1:]", rest)
            agree.same("codecs.forward", forward)
            agree.same("codecs.backward", backward)
            agree.same("chunk_bytes", [chunk or 0])
        forward, backward = call.by_peer(forward), call.by_peer(backward)
        finish = sum_blocks(untracked(input), splits, forward, call, chunk, background=True)
        # Named after its forward call: ranks that run their backward passes
        # in different orders (outputs waited for in different orders) raise
        # instead of swapping gradients.
        backward_name = f"reduce_scatter_pooled backward of call {call.number}"

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        # Every rank's gradient block goes to every rank: encoded once, sent
        # to all. grad is this rank's block, in the input's dtype (Pending).
        with begin(backward_name, pg, grad) as back:
            grad_input = gather_blocks(grad, splits, backward, back, chunk)()
        return grad_input.div_(divide) if divide > 1 else grad_input

    return Pending(input, finish, backward_fn)


def _splits(rows: Any, world: int, splits: list[Any] | None) -> list[Any]:
    # Without splits, dim 0 in equal blocks (the call checks that it divides).
    return [rows // world] * world if splits is None else list(splits)


def _shape(
    input_shape: list[Any],
    rank: int,
    world: int,
    *,
    input_splits: list[Any] | None,
    gradient_division: bool,
) -> list[Any]:
    splits = _splits(input_shape[0], world, input_splits)
    return [splits[rank] if rank < len(splits) else 0, *input_shape[1:]]


def _gradient(
    grad: torch.Tensor,
    back: Call,
    backward: list[Any],
    input_shape: list[int],
    *,
    input_splits: list[int] | None,
    gradient_division: bool,
    chunk_bytes: int | None,
) -> torch.Tensor:
    splits = _splits(input_shape[0], back.world, input_splits)
    grad_input = gather_blocks(grad, splits, backward, back, chunk_bytes)()
    return grad_input.div_(back.world) if gradient_division and back.world > 1 else grad_input


_traced = define(
    Collective(
        "reduce_scatter_pooled",
        (("SymInt[]?", "input_splits"), ("bool", "gradient_division")),
        reduce_scatter_pooled,
        _gradient,
        _shape,
    )
)
