r"""
What ``fp16`` and ``bf16`` allocate: ``encode`` of float32 input allocates its
wire and nothing else (no float32 temporary, which fbgemm's clamp-then-cast
makes), ``decode`` its output, ``decode_into`` nothing; and a large wire or
output is a buffer advised for huge pages, whose page faults would otherwise
cost more than the cast (measured in bench/bench_codecs.py, never
asserted here). Allocations are counted by torch's profiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import qcomm
from qcomm.collectives import _buffers

SPECS = ["fp16", "bf16"]
LARGE = 1 << 22  # 16 MiB of float32: its wire and output are past the huge-page size


def _allocations(fn: Callable[[], Any]) -> list[int]:
    # Bytes of every tensor allocation fn makes, in order.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]


@pytest.mark.parametrize("n", [1000, LARGE])
@pytest.mark.parametrize("spec", SPECS)
def test_encode_and_decode_allocate_their_result_alone(spec: str, n: int) -> None:
    codec: Any = qcomm.load_codec(spec)  # an ElementwiseCodec: decode_into
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    wire = codec.encode(x)
    assert _allocations(lambda: codec.encode(x)) == [wire.numel() * wire.element_size()]
    assert _allocations(lambda: codec.encode(x.view(-1, 8))) == [wire.numel() * 2]
    assert _allocations(lambda: codec.decode(wire)) == [n * 4]
    out = torch.empty(n)
    assert _allocations(lambda: codec.decode_into(wire, out)) == []


@pytest.mark.parametrize("spec", SPECS)
def test_large_wire_and_output_are_advised_for_huge_pages(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    advised: list[tuple[int, int]] = []

    def record(start: int, length: int, advice: int) -> int:
        advised.append((start, start + length))
        return 0

    monkeypatch.setattr(_buffers, "_madvise", lambda: record)
    codec = qcomm.load_codec(spec)
    x = torch.randn(LARGE)

    def inside(t: torch.Tensor) -> bool:
        # Some advised range lies within t's bytes (whole huge pages of it).
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(lo <= a < b <= hi for a, b in advised)

    wire = codec.encode(x)
    assert inside(wire), "encode's wire is not advised for huge pages"
    advised.clear()
    y = codec.decode(wire)
    assert inside(y), "decode's output is not advised for huge pages"
    advised.clear()
    codec.encode(torch.randn(1000))
    assert advised == []  # small buffers are left alone
