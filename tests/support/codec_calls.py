"""
What the host-sync checks (test_host_sync.py, on meta and CPU tensors) and the
CUDA checks (test_codecs_cuda.py) share: the codec specs they cover, every call
of the codec contract as TorchRec's collectives make it, the data, and a
bit-for-bit comparison.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: the built-in codecs and their options whose device paths are checked
SPECS = [
    "fp16",
    "fp16:loss_scale=1024",
    "bf16",
    "fp8_e4m3_tensor",
    "int4",
    "int4:row_dim=5",
    "int8",
    "int8:row_dim=6",
    "fp8_e4m3",
    "fp8_e4m3:row_dim=7",
    "fp8_e5m2",
    "mx4",
    "mx4:rounding=nearest",
    "mx4:rounding=floor",
    "mx4:rounding=ceil",
    "mx4:rounding=stochastic",
    "mx4:group_size=6",
]


def contract_calls(codec: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """
    Every call of the contract, the way TorchRec's collectives make them: a
    2-D pooled input with padded columns (rows cut into whole blocks), a split
    size, decode and decode_into with the context, then a flat input ending in
    a partial block, without a context; their outputs.
    """
    ctx = codec.create_context()
    width = x.shape[1]
    padded, _ = codec.padded_size(x, [width, width + 3], 0, ctx)
    wire = codec.encode(x, ctx)
    # After padded_size, sizes count the padded rows (as fbgemm's codecs do).
    assert codec.calc_quantized_size(x.shape[0] * padded, ctx) == wire.numel()
    back = codec.decode(wire, ctx)
    into = torch.empty(back.numel(), device=x.device)
    codec.decode_into(wire, into, ctx)
    flat = x.reshape(-1)[:-1]
    flat_wire = codec.encode(flat)
    assert codec.calc_quantized_size(flat.numel()) == flat_wire.numel()
    flat_back = codec.decode(flat_wire)
    flat_into = torch.empty(flat_back.numel(), device=x.device)
    codec.decode_into(flat_wire, flat_into)
    return [wire, back, into, flat_wire, flat_back, flat_into]


def sample(rows: int = 10, width: int = 40) -> torch.Tensor:
    """
    Normal rows, and rows each codec must mark: NaN, +-inf, a range that
    overflows float32, a huge maximum; plus an all-zero row and a tiny one.
    """
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(7))
    x[1, 3] = math.nan
    x[2, 30] = math.inf
    x[3, 0] = -math.inf
    x[4, :2] = torch.tensor([3e38, -3e38])
    x[5, 7] = 3.3e38
    x[6] = 0.0
    x[7] *= 1e-30
    x[8, 5:9] = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes; floats may differ only in NaN payloads."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))
