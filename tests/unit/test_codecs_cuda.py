r"""
The built-in codecs on a CUDA device: the wire and the values of every call
of the contract equal the CPU's bit for bit, NaN and infinities included,
through fbgemm-gpu's CUDA decoders (int8, row-wise FP8) where they are loaded
and through the torch code; and nothing makes the host wait for the device
(``torch.cuda.set_sync_debug_mode("error")`` raises on every such wait).

Every test skips without a CUDA device. ``test_host_sync.py`` checks the same
code paths for host reads on any machine, with meta tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from codec_calls import SPECS, contract_calls, same_bits, sample

import qcomm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (checks the built-in codecs' CUDA paths)",
)

# The fbgemm-gpu CUDA operators a codec decodes with, by codec name.
FBGEMM_DECODERS = {
    "int8": "Fused8BitRowwiseQuantizedToFloat",
    "fp8_e4m3": "FP8RowwiseQuantizedToFloat",
    "fp8_e5m2": "FP8RowwiseQuantizedToFloat",
}


def _fbgemm_cuda_loaded() -> bool:
    from qcomm_builtin._fbgemm import cuda_op

    probe = torch.empty(0, device="cuda")
    return all(cuda_op(name, probe) is not None for name in set(FBGEMM_DECODERS.values()))


def _int8_cpu_fuses() -> bool:
    from qcomm_builtin.int8 import _rounds_once

    return _rounds_once() is True


@pytest.fixture(params=["fbgemm", "torch"])
def cuda_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    r"""Runs a test with fbgemm-gpu's CUDA operators, then with the torch code alone."""
    if request.param == "torch":
        monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    elif not _fbgemm_cuda_loaded():
        pytest.skip("fbgemm-gpu's CUDA operators are not loaded (fbgemm-gpu-cpu or no fbgemm-gpu)")
    yield str(request.param)


# Stochastic rounding draws from the device's generator: no CPU twin.
DETERMINISTIC = [s for s in SPECS if "stochastic" not in s]


@pytest.mark.parametrize("spec", DETERMINISTIC)
def test_cuda_equals_cpu_bit_for_bit(spec: str, cuda_path: str) -> None:
    codec: Any = qcomm.load_codec(spec)
    x = sample()
    cpu = contract_calls(codec, x)
    cuda = contract_calls(codec, x.cuda())
    if codec.info.name == "int8" and not _int8_cpu_fuses():
        # This CPU rounds q * scale + bias twice, CUDA once: only wires compare.
        cpu, cuda = [cpu[0], cpu[3]], [cuda[0], cuda[3]]
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert b.is_cuda, f"{spec}: output {i} left the device"
        # NaN payloads may differ (CUDA's fp16/bf16 casts write 0x7FFF); the rest may not.
        assert same_bits(a, b.cpu()), f"{spec}: output {i} differs from the CPU's ({cuda_path})"


@pytest.mark.parametrize("spec", SPECS)
def test_no_host_sync_on_cuda(spec: str, cuda_path: str) -> None:
    codec: Any = qcomm.load_codec(spec)
    x = sample().cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = contract_calls(codec, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(t.is_cuda for t in outputs)


@pytest.mark.parametrize("spec", ["int8", "int8:row_dim=64", "fp8_e4m3", "fp8_e5m2:row_dim=8"])
def test_fbgemm_cuda_decoders_are_used(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _fbgemm_cuda_loaded():
        pytest.skip("fbgemm-gpu's CUDA operators are not loaded (fbgemm-gpu-cpu or no fbgemm-gpu)")
    codec: Any = qcomm.load_codec(spec)
    module = importlib.import_module(type(codec).__module__)
    calls: list[str] = []
    real = module.cuda_op

    def recording(name: str, tensor: torch.Tensor) -> Any:
        op = real(name, tensor)
        if op is not None:
            calls.append(name)
        return op

    monkeypatch.setattr(module, "cuda_op", recording)
    codec.decode(codec.encode(sample().cuda()))
    assert calls == [FBGEMM_DECODERS[codec.info.name]]


@pytest.mark.parametrize("spec", ["int8:row_dim=6", "fp8_e4m3:row_dim=7"])
def test_fbgemm_cuda_decoders_skip_unaligned_rows(spec: str) -> None:
    # fbgemm's CUDA kernels pad row values to 4 bytes: other row_dims are not
    # their layout, and decode through torch (bit for bit the CPU's).
    codec: Any = qcomm.load_codec(spec)
    x = sample()
    wire = codec.encode(x)
    assert same_bits(codec.decode(wire), codec.decode(wire.cuda()).cpu())
