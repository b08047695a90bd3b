r"""
The collectives ``qcomm bench`` measures, and the input of one message size.

Inputs are ``[rows, dim]`` float32 tensors split evenly over the ranks by
rows, so that a message of ``S`` bytes is each rank's whole buffer, as in
nccl-tests. Rank :math:`r` sends :math:`x \cdot s_r` with :math:`x` one
random tensor every rank draws from the same seed and
:math:`s_r = 1 + r / n`: inputs differ from rank to rank, yet every rank can
compute the exact float32 result without qcomm, which is what the decoded
output is compared with.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from qcomm.types import CommOp, QuantizedCommCodecs

__all__ = [
    "BARE",
    "Case",
    "Series",
    "bare_series",
    "make_case",
    "qcomm_collective",
    "run_series",
    "torchrec_all_to_all",
]

# qcomm's function for each collective; see DESIGN.md for the signatures.
_QCOMM_NAMES = {
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL: "all_to_all_pooled",
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER: "reduce_scatter_pooled",
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL: "all_to_all_sequence",
}


@dataclasses.dataclass
class Case:
    r"""
    One collective at one message size, on this rank.

    Args:
        op (CommOp): the collective.
        size_bytes (int): this rank's float32 buffer, the message size ``S``.
        input (Tensor): ``[rows, dim]``, rows split evenly over the ranks.
        expected (Tensor): the exact float32 output on this rank.
        rows_per_rank (int): rows of the input addressed to each rank.
        dim (int): columns of the input.
        grad (Tensor): the output's gradient, for timing the backward pass.
    """

    op: CommOp
    size_bytes: int
    input: torch.Tensor
    expected: torch.Tensor
    rows_per_rank: int
    dim: int
    grad: torch.Tensor


@dataclasses.dataclass
class Series:
    r"""
    One implementation with one codec: a line of the bandwidth plot.

    Args:
        impl (str): ``"qcomm"``, ``"torchrec"`` or ``"bare"`` (the backend's
            own calls on float32, see :data:`BARE`).
        codec (str): the codec's label, ``"none"`` for TorchRec without
            codecs, the call's name for ``"bare"``.
        codecs (QuantizedCommCodecs | None): the codec pair passed, ``None``
            for none.
        call (Callable | None): the collective function, ``None`` if it cannot run.
        error (str | None): why it cannot run.
        chunk_bytes (int | None): qcomm's chunk size, ``None`` for automatic.
    """

    impl: str
    codec: str
    codecs: QuantizedCommCodecs | None
    call: Callable[..., Any] | None
    error: str | None = None
    chunk_bytes: int | None = None

    @property
    def label(self) -> str:
        r"""
        label() -> str

        ``codec`` for qcomm, ``torchrec[codec]`` for TorchRec, ``bare:call``
        for the backend's own calls.
        """
        if self.impl == "qcomm":
            return self.codec
        if self.impl == "bare":
            return f"bare:{self.codec}"
        return f"{self.impl}[{self.codec}]"

    @property
    def differentiable(self) -> bool:
        r"""
        differentiable() -> bool

        Whether the series has a backward pass to time (the bare calls have none).
        """
        return self.impl != "bare"


def base_input(size_bytes: int, *, world_size: int, dim: int, seed: int) -> torch.Tensor:
    r"""
    base_input(size_bytes: int, *, world_size: int, dim: int, seed: int) -> Tensor

    The random tensor all ranks share for one message size: standard normal
    values, like trained embeddings, drawn on the CPU so that every device
    gets the same numbers.

    Args:
        size_bytes (int): the wanted message size; rows are rounded down to a
            multiple of ``world_size`` (at least one row per rank).
        world_size (int): number of ranks.
        dim (int): columns.
        seed (int): the run's seed.

    Returns:
        Tensor: ``[rows, dim]`` float32 on the CPU.

    Examples::

        >>> base_input(65536, world_size=2, dim=128, seed=0).shape
        torch.Size([128, 128])
    """
    rows = max(world_size, size_bytes // (4 * dim) // world_size * world_size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + size_bytes)
    return torch.randn(rows, dim, generator=generator)


def make_case(
    op: CommOp, base: torch.Tensor, *, rank: int, world_size: int, device: torch.device
) -> Case:
    r"""
    make_case(op: CommOp, base: Tensor, *, rank: int, world_size: int, device: torch.device) -> Case

    This rank's input of ``op`` and the exact output it must receive.

    Args:
        op (CommOp): the collective.
        base (Tensor): the shared tensor from ``base_input``.
        rank (int): this rank.
        world_size (int): number of ranks.
        device (torch.device): where the collective runs.

    Returns:
        Case: the input (``base`` scaled by :math:`1 + r / n`) and expected output.

    Examples::

        >>> import torch
        >>> base = base_input(65536, world_size=2, dim=128, seed=0)
        >>> case = make_case(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER, base, rank=1, world_size=2,
        ...                  device=torch.device("cpu"))
        >>> case.expected.equal(base[64:] + base[64:] * 1.5)
        True
    """
    rows, dim = base.shape
    per = rows // world_size
    scales = [1.0 + r / world_size for r in range(world_size)]
    mine = base[rank * per : (rank + 1) * per]
    received = [mine * s for s in scales]  # what rank r sends to this rank
    if op is CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL:
        expected = torch.cat(received, dim=1)
    elif op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
        expected = received[0]
        for block in received[1:]:
            expected = expected + block
    else:
        expected = torch.cat(received, dim=0)
    generator = torch.Generator().manual_seed(rows * 7919 + rank)
    return Case(
        op=op,
        size_bytes=base.numel() * base.element_size(),
        input=(base * scales[rank]).to(device),
        expected=expected.to(device),
        rows_per_rank=per,
        dim=dim,
        grad=torch.randn(expected.shape, generator=generator).to(device),
    )


def qcomm_collective(op: CommOp) -> Callable[..., Any]:
    r"""
    qcomm_collective(op: CommOp) -> Callable[..., Any]

    qcomm's function for ``op``, from :mod:`qcomm` or, before it is exported
    there, from :mod:`qcomm.collectives`.

    Args:
        op (CommOp): the collective.

    Returns:
        Callable[..., Any]: e.g. ``qcomm.all_to_all_pooled``.

    Raises:
        ImportError: if qcomm has no such function.
    """
    name = _QCOMM_NAMES[op]
    fn = getattr(importlib.import_module("qcomm"), name, None)
    if fn is None:
        fn = getattr(importlib.import_module("qcomm.collectives"), name, None)
    if fn is None:
        raise ImportError(f"qcomm.{name} is not available")
    return fn


def torchrec_all_to_all() -> Callable[..., Any]:
    r"""
    torchrec_all_to_all() -> Callable[..., Any]

    TorchRec's ``alltoall_pooled`` (``torchrec.distributed.comm_ops``).

    Returns:
        Callable[..., Any]: the function.

    Raises:
        ImportError: if TorchRec is not importable.
    """
    return importlib.import_module("torchrec.distributed.comm_ops").alltoall_pooled  # type: ignore[no-any-return]


#: the backend's own calls measured beside qcomm, on the same float32 data:
#: ``p2p`` sends every peer its block and receives its block from every peer,
#: all at once, receives posted first (what the link allows); ``native`` is
#: the backend's collective of the same kind (``all_to_all_single``, or
#: ``reduce_scatter_tensor`` for the reduce-scatter), into a kept output.
BARE = ("p2p", "native")


def _bare_p2p(case: Case, group: Any, out: torch.Tensor) -> torch.Tensor:
    dist = torch.distributed
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = case.input.view(world, -1)
    recv = out.view(world, -1)
    peers = [(rank + i) % world for i in range(1, world)]
    recvs = [dist.irecv(recv[p], group=group, group_src=p) for p in peers]
    sends = [dist.isend(send[p], group=group, group_dst=p) for p in peers]
    for work in recvs + sends:
        if work is not None:
            work.wait()
    return out


def bare_series(op: CommOp, name: str) -> Series:
    r"""
    bare_series(op: CommOp, name: str) -> Series

    A series of the backend's own calls (see :data:`BARE`) for ``op``.

    Args:
        op (CommOp): the collective it stands beside.
        name (str): one of :data:`BARE`.

    Returns:
        Series: whose ``call(case, group)`` returns an output it keeps from
        call to call (not the collective's layout: it is timed, not checked).
    """
    kept: dict[int, torch.Tensor] = {}

    def call(case: Case, group: Any) -> torch.Tensor:
        out = kept.get(case.size_bytes)
        if out is None:
            kept.clear()
            out = kept[case.size_bytes] = torch.empty_like(case.input)
        if name == "p2p":
            return _bare_p2p(case, group, out)
        if op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
            world = torch.distributed.get_world_size(group)
            mine = out[: case.input.shape[0] // world]
            torch.distributed.reduce_scatter_tensor(mine, case.input, group=group)
            return mine
        torch.distributed.all_to_all_single(out, case.input, group=group)
        return out

    return Series("bare", name, None, call)


def run_series(series: Series, case: Case, group: Any, backward: bool = False) -> torch.Tensor:
    r"""
    run_series(series: Series, case: Case, group: Any, backward: bool = False) -> Tensor

    Runs the collective of ``case`` once with the implementation and codec of
    ``series`` and waits for its output (and, with ``backward``, for the
    input's gradient).

    Args:
        series (Series): what runs.
        case (Case): the input.
        group (Any): the process group.
        backward (bool, optional): also run the backward pass with
            ``case.grad``. Default: ``False``.

    Returns:
        Tensor: the output on this rank.

    Raises:
        RuntimeError: if ``series`` cannot run (its :attr:`Series.error`).
    """
    if series.call is None:
        raise RuntimeError(series.error or f"{series.label} cannot run")
    if series.impl == "bare":
        return series.call(case, group)  # type: ignore[no-any-return]
    world_size = case.input.shape[0] // case.rows_per_rank
    splits = [case.rows_per_rank] * world_size
    x = case.input.detach().requires_grad_(backward)
    extra = {} if series.chunk_bytes is None else {"chunk_bytes": series.chunk_bytes}
    if case.op is CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL:
        pending = series.call(
            x, splits, [case.dim] * world_size, group=group, codecs=series.codecs, **extra
        )
    elif case.op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
        pending = series.call(x, input_splits=splits, group=group, codecs=series.codecs, **extra)
    else:
        pending = series.call(
            x,
            input_splits=splits,
            output_splits=splits,
            group=group,
            codecs=series.codecs,
            **extra,
        )
    out = pending.wait()
    if backward:
        out.backward(case.grad)
    return out  # type: ignore[no-any-return]
