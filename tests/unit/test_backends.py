"""The one table of what each torch.distributed backend moves and carries
(qcomm/collectives/_backends.py), read from get_backend's text."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives import _backends

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_backend_text_by_device() -> None:
    assert _backends.by_device("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert _backends.by_device("NCCL") == {"cuda": "nccl"}
    assert _backends.by_device("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert _backends.by_device("mpi") == {"cpu": "mpi", "cuda": "mpi"}  # unknown: any device


@pytest.mark.parametrize(
    ("text", "cpu_problem", "limit", "alone", "cuda_only"),
    [
        ("gloo", False, "gloo", True, False),
        ("nccl", True, None, False, True),
        ("cpu:gloo,cuda:nccl", False, "gloo", True, False),
        ("mpi", False, None, False, False),
    ],
)
def test_what_each_backend_moves(
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    cpu_problem: bool,
    limit: str | None,
    alone: bool,
    cuda_only: bool,
) -> None:
    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda g=None: text)
    problem = _backends.device_problem(group, CPU)
    assert (problem is not None) == cpu_problem, problem
    if problem:
        assert "moves tensors on cuda only; got a tensor on cpu" in problem
    assert _backends.device_problem(group, CUDA) is None
    got = _backends.dtype_limit(group, CPU)
    assert (got and got[0]) == limit
    if got:  # gloo refuses float8 and int16 on CPU, carries the wire dtypes qcomm uses
        assert torch.float8_e4m3fn not in got[1] and torch.int16 not in got[1]
        assert {torch.float32, torch.float16, torch.bfloat16, torch.uint8} <= got[1]
    assert _backends.dtype_limit(group, CUDA) is None
    assert _backends.moves_alone(group, CPU) is alone
    assert _backends.moves_alone(group, CUDA) is False
    assert _backends.cuda_only(group) is cuda_only
