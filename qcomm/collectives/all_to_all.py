r"""
The two all-to-alls of sharded embeddings: the pooled one, where every rank
holds its tables' pooled embeddings for the whole global batch and receives
every table's columns for its own part of the batch (TorchRec's
``POOLED_EMBEDDINGS_ALL_TO_ALL``), and the sequence one, where rows of an
``[N, D]`` tensor go to the rank that needs them (TorchRec's
``SEQUENCE_EMBEDDINGS_ALL_TO_ALL``).
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
from qcomm.collectives._layouts import pooled_backward, pooled_forward, sequence_exchange
from qcomm.collectives._pending import Pending, untracked

__all__ = ["all_to_all_pooled", "all_to_all_sequence"]


def all_to_all_pooled(
    input: torch.Tensor,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    *,
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    gradient_division: bool = False,
    chunk_bytes: int | None = None,
) -> Awaitable[torch.Tensor]:
    r"""
    all_to_all_pooled(input, batch_size_per_rank, dim_sum_per_rank, *, group=None, codecs=None, gradient_division=False, chunk_bytes=None) -> Awaitable[Tensor]

    All-to-all of pooled embeddings, encoded with a codec on each pass.

    Rank :math:`k` sends rows ``sum(batch_size_per_rank[:r])`` onwards
    (``batch_size_per_rank[r]`` of them) to rank :math:`r`, which places them
    in its output's columns ``sum(dim_sum_per_rank[:k])`` onwards. With
    :math:`B_r` = ``batch_size_per_rank[r]`` and :math:`D_r` =
    ``dim_sum_per_rank[r]``, the input on rank :math:`k` is
    :math:`[\sum_r B_r, D_k]` and the output is :math:`[B_k, \sum_r D_r]`.
    Each rank's columns are padded to what the codec's
    :meth:`~qcomm.QuantizedCommCodec.padded_size` asks for, on both passes,
    and the padding is stripped after decoding.

    See :mod:`qcomm.collectives` for what all three collectives share.

    Args:
        input (Tensor): ``[sum(batch_size_per_rank), dim_sum_per_rank[rank]]``
            floating-point pooled embeddings of this rank's tables.
        batch_size_per_rank (list[int]): every rank's batch size.
        dim_sum_per_rank (list[int]): every rank's sum of embedding dims.
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
        Awaitable[Tensor]: the ``[batch_size_per_rank[rank], sum(dim_sum_per_rank)]``
        output, in ``input``'s dtype.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if shapes and split lists disagree, or the device does not
            suit the backend.
        CodecError: if a codec fails or breaks its contract, or the ranks
            disagree, or another rank's arguments are invalid.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> pending = all_to_all_pooled(torch.ones(4, 3), [4], [3])
        >>> pending.wait().shape
        torch.Size([4, 3])
        >>> dist.destroy_process_group()
    """
    if torch.compiler.is_compiling():
        own = (batch_size_per_rank, dim_sum_per_rank, gradient_division)
        return _traced_pooled(input, own, group, codecs, chunk_bytes)
    with begin("all_to_all_pooled forward", group, input, "all_to_all_pooled") as call:
        pg, rank, world = call.group, call.rank, call.world
        with call.agreement as agree:
            check_input(input, "input", call.backend, ndim=2)
            batches = check_splits(
                batch_size_per_rank, "batch_size_per_rank", world, input.shape[0], "input.shape[0]"
            )
            dims = check_splits(dim_sum_per_rank, "dim_sum_per_rank", world)
            if dims[rank] != input.shape[1]:
                raise ValueError(
                    f"dim_sum_per_rank[{rank}]: expected this rank's width input.shape[1] "
                    f"({input.shape[1]}), got {dims[rank]}"
                )
            divide = world if check_flag(gradient_division, "gradient_division") else 1
            chunk = check_chunk_bytes(chunk_bytes)
            forward, backward = resolve_codecs(codecs, input.dtype, call.backend)
            agree.same("batch_size_per_rank", batches)
            agree.same("dim_sum_per_rank", dims)
            agree.same("codecs.forward", forward)
            agree.same("codecs.backward", backward)
            agree.same("chunk_bytes", [chunk or 0])
        forward, backward = call.by_peer(forward), call.by_peer(backward)
        finish = pooled_forward(untracked(input), batches, dims, forward, call, chunk)
        # Named after its forward call: ranks that run their backward passes
        # in different orders (one backward() per output, called in other
        # orders) raise instead of swapping gradients.
        backward_name = f"all_to_all_pooled backward of call {call.number}"

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        # grad comes in the input's dtype (Pending casts it).
        with begin(backward_name, pg, grad) as back:
            return pooled_backward(grad, batches, dims, backward, back, divide, chunk)

    return Pending(input, finish, backward_fn, finish.out)


def all_to_all_sequence(
    input: torch.Tensor,
    *,
    input_splits: list[int],
    output_splits: list[int],
    group: dist.ProcessGroup | None = None,
    codecs: Any | None = None,
    chunk_bytes: int | None = None,
) -> Awaitable[torch.Tensor]:
    r"""
    all_to_all_sequence(input, *, input_splits, output_splits, group=None, codecs=None, chunk_bytes=None) -> Awaitable[Tensor]

    All-to-all of rows (sequence embeddings), encoded with a codec on each pass.

    Rank :math:`k` sends ``input_splits[r]`` consecutive rows to rank
    :math:`r`, in rank order; rank :math:`r` receives ``output_splits[k]``
    rows from rank :math:`k`, in rank order, so ``output_splits[k]`` on rank
    :math:`r` must equal ``input_splits[r]`` on rank :math:`k`. Each block is
    padded at its end to what the codec's
    :meth:`~qcomm.QuantizedCommCodec.padded_size` asks for (the block seen as
    one row). The gradient goes back through the reverse all-to-all.

    See :mod:`qcomm.collectives` for what all three collectives share.

    Args:
        input (Tensor): ``[sum(input_splits), D]`` floating-point rows (any
            trailing shape travels with its row).
        input_splits (list[int]): rows sent to every rank.
        output_splits (list[int]): rows received from every rank.
        group (ProcessGroup, optional): the process group. Default: ``None``
            (the default group).
        codecs (QuantizedCommCodecs, optional): the forward and backward
            codecs. Default: ``None`` (no-op codecs: the data travels in its
            own dtype).
        chunk_bytes (int, optional): the pipeline's chunk size in float32
            bytes. Default: ``None`` (automatic).

    Returns:
        Awaitable[Tensor]: the ``[sum(output_splits), D]`` rows, in ``input``'s
        dtype.

    Raises:
        TypeError: if an argument has the wrong type, or a codec does not
            follow the contract.
        ValueError: if shapes and split lists disagree, or the device does not
            suit the backend.
        CodecError: if a codec fails or breaks its contract, the ranks' splits
            do not mirror each other, the ranks disagree otherwise, or another
            rank's arguments are invalid.

    Examples::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.arange(6.0).view(3, 2)
        >>> all_to_all_sequence(x, input_splits=[3], output_splits=[3]).wait().equal(x)
        True
        >>> dist.destroy_process_group()
    """
    if torch.compiler.is_compiling():
        own = (input_splits, output_splits)
        return _traced_sequence(input, own, group, codecs, chunk_bytes)
    with begin("all_to_all_sequence forward", group, input, "all_to_all_sequence") as call:
        pg, world = call.group, call.world
        with call.agreement as agree:
            check_input(input, "input", call.backend)
            sends = check_splits(
                input_splits, "input_splits", world, input.shape[0], "input.shape[0]"
            )
            recvs = check_splits(output_splits, "output_splits", world)
            chunk = check_chunk_bytes(chunk_bytes)
            forward, backward = resolve_codecs(codecs, input.dtype, call.backend)
            rest = tuple(input.shape[1:])
            agree.same("input.shape[1:]", rest)
            agree.same("codecs.forward", forward)
            agree.same("codecs.backward", backward)
            agree.same("chunk_bytes", [chunk or 0])
            agree.mirror(sends, recvs)
        forward, backward = call.by_peer(forward), call.by_peer(backward)
        finish = sequence_exchange(
            untracked(input), sends, recvs, forward, call, chunk, background=True
        )
        # Named after its forward call: ranks that run their backward passes
        # in different orders (one backward() per output, called in other
        # orders) raise instead of swapping gradients.
        backward_name = f"all_to_all_sequence backward of call {call.number}"

    def backward_fn(grad: torch.Tensor) -> torch.Tensor:
        with begin(backward_name, pg, grad) as back:
            # grad comes in the input's dtype (Pending casts it).
            return sequence_exchange(grad, recvs, sends, backward, back, chunk)()

    return Pending(input, finish, backward_fn, finish.out)


def _at(values: list[Any] | None, index: int) -> Any:
    return values[index] if values is not None and 0 <= index < len(values) else 0


def _pooled_shape(
    input_shape: list[Any],
    rank: int,
    world: int,
    *,
    batch_size_per_rank: list[Any],
    dim_sum_per_rank: list[Any],
    gradient_division: bool,
) -> list[Any]:
    return [_at(batch_size_per_rank, rank), sum(dim_sum_per_rank)]


def _pooled_gradient(
    grad: torch.Tensor,
    back: Call,
    backward: list[Any],
    input_shape: list[int],
    *,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    gradient_division: bool,
    chunk_bytes: int | None,
) -> torch.Tensor:
    divide = back.world if gradient_division else 1
    batches, dims = list(batch_size_per_rank), list(dim_sum_per_rank)
    return pooled_backward(grad, batches, dims, backward, back, divide, chunk_bytes)


def _sequence_shape(
    input_shape: list[Any],
    rank: int,
    world: int,
    *,
    input_splits: list[Any],
    output_splits: list[Any],
) -> list[Any]:
    return [sum(output_splits), *input_shape[1:]]


def _sequence_gradient(
    grad: torch.Tensor,
    back: Call,
    backward: list[Any],
    input_shape: list[int],
    *,
    input_splits: list[int],
    output_splits: list[int],
    chunk_bytes: int | None,
) -> torch.Tensor:
    sends, receives = list(input_splits), list(output_splits)
    return sequence_exchange(grad, receives, sends, backward, back, chunk_bytes)()


_traced_pooled = define(
    Collective(
        "all_to_all_pooled",
        (
            ("SymInt[]", "batch_size_per_rank"),
            ("SymInt[]", "dim_sum_per_rank"),
            ("bool", "gradient_division"),
        ),
        all_to_all_pooled,
        _pooled_gradient,
        _pooled_shape,
    )
)
_traced_sequence = define(
    Collective(
        "all_to_all_sequence",
        (("SymInt[]", "input_splits"), ("SymInt[]", "output_splits")),
        all_to_all_sequence,
        _sequence_gradient,
        _sequence_shape,
    )
)
