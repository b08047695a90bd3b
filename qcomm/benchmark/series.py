r"""
What ``qcomm bench`` runs: each collective's input at one message size
(:class:`Case`) and the implementations and codecs it runs with
(:class:`Series`): qcomm's, TorchRec's, PyTorch's DDP hooks and the
backend's own calls.

Rank :math:`r` of :math:`n` sends :math:`x (1 + r / n)`, with :math:`x` one
random tensor all ranks draw from the same seed: inputs differ between
ranks, yet every rank knows the exact float32 output to check against.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from qcomm.benchmark.candidates import Candidate
from qcomm.benchmark.options import BenchOp, DenseOp
from qcomm.ops import CommOp
from qcomm.types import HostCodecs, QuantizedCommCodecs

__all__ = [
    "BARE",
    "PYTORCH_HOOKS",
    "Case",
    "Series",
    "all_reduce_series",
    "bare_series",
    "base_input",
    "make_case",
    "pair_of",
    "qcomm_collective",
    "run_series",
    "torchrec_all_to_all",
]


@dataclasses.dataclass
class Case:
    r"""
    One collective at one message size, on this rank.

    Args:
        op (CommOp | DenseOp): the collective.
        size_bytes (int): this rank's float32 buffer, the message size ``S``.
        input (Tensor): ``[rows, dim]``, rows split evenly over the ranks.
        expected (Tensor): the exact float32 output on this rank.
        rows_per_rank (int): rows of the input addressed to each rank.
        dim (int): columns of the input.
        grad (Tensor): the output's gradient, for the backward pass.
    """

    op: BenchOp
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
        impl (str): ``"qcomm"``, ``"torchrec"``, ``"pytorch"`` (PyTorch's DDP
            hooks, see :data:`PYTORCH_HOOKS`) or ``"bare"`` (the backend's
            own calls on float32, see :data:`BARE`).
        codec (str): the codec's label, ``"none"`` for TorchRec without
            codecs, the call's or hook's name for ``"bare"`` and ``"pytorch"``.
        codecs (QuantizedCommCodecs | None): the codec pair passed, ``None``
            for none.
        call (Callable | None): the collective function, ``None`` if it cannot run.
        error (str | None): why it cannot run.
        chunk_bytes (int | None): qcomm's chunk size, ``None`` for automatic.
        has_backward (bool): whether the collective has a backward pass.
    """

    impl: str
    codec: str
    codecs: QuantizedCommCodecs | None
    call: Callable[..., Any] | None
    error: str | None = None
    chunk_bytes: int | None = None
    has_backward: bool = True
    #: whether there is a backward pass to time (not for the bare calls and the all-reduce)
    differentiable: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.differentiable = self.impl != "bare" and self.has_backward

    def label(self) -> str:
        r"""
        label() -> str

        The report's name: ``codec``, ``torchrec[codec]``, ``pytorch[hook]`` or ``bare:call``.
        """
        if self.impl == "qcomm":
            return self.codec
        if self.impl == "bare":
            return f"bare:{self.codec}"
        return f"{self.impl}[{self.codec}]"


# Newer torch names reduce_scatter_tensor (which then warns) reduce_scatter_single.
_reduce_scatter_single = (
    getattr(torch.distributed, "reduce_scatter_single", None)
    or torch.distributed.reduce_scatter_tensor
)


def base_input(size_bytes: int, *, world_size: int, dim: int, seed: int) -> torch.Tensor:
    r"""
    base_input(size_bytes: int, *, world_size: int, dim: int, seed: int) -> Tensor

    The standard normal ``[rows, dim]`` float32 tensor all ranks share,
    drawn on the CPU so that every device gets the same numbers.

    Args:
        size_bytes (int): the message size.
        world_size (int): ranks; rows are a multiple of it, at least one each.
        dim (int): columns.
        seed (int): the run's seed.

    Examples::

        >>> base_input(65536, world_size=2, dim=128, seed=0).shape
        torch.Size([128, 128])
    """
    rows = max(world_size, size_bytes // (4 * dim) // world_size * world_size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + size_bytes)
    return torch.randn(rows, dim, generator=generator)


def make_case(
    op: BenchOp, base: torch.Tensor, *, rank: int, world_size: int, device: torch.device
) -> Case:
    r"""
    make_case(op: CommOp | DenseOp, base: Tensor, *, rank: int, world_size: int, device: torch.device) -> Case

    This rank's input, ``base`` scaled by :math:`1 + r / n`, and the exact
    output it must receive (for the all-reduce: the ranks' average).

    Args:
        op (CommOp | DenseOp): the collective.
        base (Tensor): from :func:`base_input`.
        rank (int): :math:`r`.
        world_size (int): :math:`n`.
        device (torch.device): where the case's tensors go.

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
    if op is DenseOp.ALL_REDUCE:
        expected = base * (sum(scales) / world_size)
    elif op is CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL:
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

    qcomm's function for a collective (:attr:`~qcomm.CommOp.collective`), from
    :mod:`qcomm` or :mod:`qcomm.collectives`; ``ImportError`` if there is none.

    Args:
        op (CommOp): the collective.
    """
    name = op.collective
    fn: Callable[..., Any] | None = getattr(importlib.import_module("qcomm"), name, None)
    if fn is None:
        fn = getattr(importlib.import_module("qcomm.collectives"), name, None)
    if fn is None:
        raise ImportError(f"qcomm.{name} is not available")
    return fn


def torchrec_all_to_all() -> Callable[..., Any]:
    r"""
    torchrec_all_to_all() -> Callable[..., Any]

    TorchRec's ``alltoall_pooled``.

    Raises:
        ImportError: if TorchRec is not importable.
    """
    return importlib.import_module("torchrec.distributed.comm_ops").alltoall_pooled  # type: ignore[no-any-return]


#: the backend's own calls measured beside qcomm, on the same float32 data:
#: ``p2p`` sends every peer its block and receives its block from every peer,
#: all at once, receives posted first (what the link allows); ``native`` is
#: the backend's collective of the same kind (``all_to_all_single``, or
#: ``reduce_scatter_single`` for the reduce-scatter), into a kept output.
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

    The backend's own call beside a collective; its output is kept from call
    to call and is not in the collective's layout (it is timed, not checked).

    Args:
        op (CommOp): the collective.
        name (str): one of :data:`BARE`.
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
            _reduce_scatter_single(mine, case.input, group=group)
            return mine
        torch.distributed.all_to_all_single(out, case.input, group=group)
        return out

    return Series("bare", name, None, call)


class _Bucket:
    # What DDP hands a communication hook: here each rank's whole buffer.

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer]


#: PyTorch's own DDP communication hooks measured beside qcomm's on the
#: all-reduce: ``allreduce_hook`` is what DDP does without a hook (divide,
#: then the backend's all-reduce); ``fp16_compress_hook`` casts to float16 and
#: all-reduces that.
PYTORCH_HOOKS = ("allreduce_hook", "fp16_compress_hook")


def _pytorch_hook(name: str) -> Callable[[Case, Any], torch.Tensor]:
    hooks = importlib.import_module("torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
    hook = getattr(hooks, name)

    def call(case: Case, group: Any) -> torch.Tensor:
        hook(group, _Bucket(case.input.view(-1))).wait()
        return case.input

    return call


def pair_of(candidate: Candidate) -> QuantizedCommCodecs:
    r"""
    pair_of(candidate: Candidate) -> QuantizedCommCodecs

    The codecs a loaded candidate runs with: its codec both ways, or its
    :class:`~qcomm.HostCodecs` as they are.

    Args:
        candidate (Candidate): a candidate whose codec was built.
    """
    if isinstance(candidate.codec, HostCodecs):
        return candidate.codec
    return QuantizedCommCodecs(forward=candidate.codec, backward=candidate.codec)


def _qcomm_hook(codecs: QuantizedCommCodecs, chunk_bytes: int | None) -> Callable[..., Any]:
    from qcomm.ddp import DDPCommHookState, all_reduce_hook

    def call(case: Case, group: Any) -> torch.Tensor:
        # Codecs by host make the hook's all-reduce hierarchical (by_host=).
        spec, gather = (
            (codecs, None) if isinstance(codecs, HostCodecs) else (codecs.forward, codecs.backward)
        )
        state = DDPCommHookState(spec, gather=gather, process_group=group, chunk_bytes=chunk_bytes)
        all_reduce_hook(state, _Bucket(case.input.view(-1))).wait()  # type: ignore[arg-type]
        return case.input

    return call


def all_reduce_series(candidates: list[Candidate], chunk_bytes: int | None) -> list[Series]:
    r"""
    all_reduce_series(candidates: list[Candidate], chunk_bytes: int | None) -> list[Series]

    The series of the all-reduce, each averaging the case's input in place as
    a hook does a bucket: qcomm's DDP hook with each codec, PyTorch's hooks
    (:data:`PYTORCH_HOOKS`), then ``bare:p2p`` twice over (what a
    reduce-scatter and an all-gather of float32 move).

    Args:
        candidates (list[Candidate]): qcomm's codecs, loaded or not.
        chunk_bytes (int | None): qcomm's chunk size, ``None`` for automatic.
    """
    lines = []
    for c in candidates:
        if c.codec is None:
            error = f"codec failed to load: {c.error}"
            lines.append(Series("qcomm", c.label, None, None, error, has_backward=False))
            continue
        pair = pair_of(c)
        call = _qcomm_hook(pair, chunk_bytes)
        lines.append(Series("qcomm", c.label, pair, call, None, chunk_bytes, has_backward=False))
    for name in PYTORCH_HOOKS:
        lines.append(Series("pytorch", name, None, _pytorch_hook(name), has_backward=False))

    kept: dict[int, torch.Tensor] = {}

    def twice(case: Case, group: Any) -> torch.Tensor:
        out = kept.get(case.size_bytes)
        if out is None:
            kept.clear()
            out = kept[case.size_bytes] = torch.empty_like(case.input)
        _bare_p2p(case, group, out)
        return _bare_p2p(case, group, out)

    lines.append(Series("bare", "p2p", None, twice))
    return lines


def run_series(series: Series, case: Case, group: Any, backward: bool = False) -> torch.Tensor:
    r"""
    run_series(series: Series, case: Case, group: Any, backward: bool = False) -> Tensor

    Runs a case once and returns this rank's output once it is there;
    ``RuntimeError`` if ``series`` cannot run (its :attr:`Series.error`).

    Args:
        series (Series): what runs.
        case (Case): the input.
        group (Any): the process group.
        backward (bool, optional): also the backward pass with ``case.grad``. Default: ``False``.
    """
    if series.call is None:
        raise RuntimeError(series.error or f"{series.label()} cannot run")
    if series.impl == "bare" or case.op is DenseOp.ALL_REDUCE:
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
