r"""
No host synchronisation in the built-in codecs off the CPU.

Reading device data on the host (``.item()``, ``bool()``, ``int()``) or running
an operator whose output size depends on the data (``nonzero``,
``masked_select``, indexing with a boolean mask) makes the host wait for a
CUDA device: it cannot queue the collective and the work after it meanwhile.
``_HostReads`` records every such operator as it is dispatched, with the
codec line that ran it, while every call of the codec contract runs:

- on meta tensors: their device is not the CPU, so the codecs take the code
  path they take on CUDA, and any read of a meta tensor's data raises (which
  also catches ``.tolist()``, read below the dispatcher);
- on CPU tensors holding NaN and infinities, with qcomm's C kernels and
  fbgemm switched off: the torch code that path runs, on real data. Its wire
  and values must equal, bit for bit, those of each CPU path (C kernels,
  fbgemm), whose early-outs read flags on the host, which costs nothing there.

The same checks on a real GPU (``torch.cuda.set_sync_debug_mode``) live in
``test_codecs_cuda.py``.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qcomm

aten = torch.ops.aten

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

# Operators that read device data on the host, or size their output by it.
_HOST_READS = {
    aten._local_scalar_dense: "host read (.item(), bool(), int(), float())",
    aten.is_nonzero: "host read (bool() of a one-element tensor)",
    aten.equal: "host read (torch.equal)",
    aten.nonzero: "data-dependent size (nonzero)",
    aten.argwhere: "data-dependent size (argwhere)",
    aten.masked_select: "data-dependent size (masked_select)",
    aten.unique_consecutive: "data-dependent size (unique)",
    aten._unique2: "data-dependent size (unique)",
    aten.repeat_interleave: "data-dependent size (repeat_interleave)",
}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _codec_line(frames: traceback.StackSummary) -> str:
    # The innermost frame in qcomm or its built-in codecs: who asked.
    for frame in reversed(frames):
        path = Path(frame.filename)
        if "qcomm_builtin" in path.parts or "qcomm" in path.parts[-2:-1]:
            return f"{path.name}:{frame.lineno} `{frame.line}`"
    return "?"


def _why(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    # The reason this operator syncs, or None.
    packet = func.overloadpacket
    if packet in _HOST_READS:
        return _HOST_READS[packet]
    if packet in _INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)):
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        if masks:
            return "data-dependent size (indexing with a boolean mask)"
    if packet is aten._to_copy and isinstance(args[0], torch.Tensor):
        target = kwargs.get("device")
        if (
            args[0].device.type == "cpu"
            and target is not None
            and torch.device(target).type != "cpu"
        ):
            return "blocking host-to-device copy"
    return None


class _HostReads(TorchDispatchMode):
    """Records every operator that would make the host wait for a device, and where."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None:
            self.reads.append(f"{func}: {why} at {_codec_line(traceback.extract_stack())}")
        return func(*args, **kwargs)


def _contract_calls(codec: Any, x: torch.Tensor) -> list[torch.Tensor]:
    # Every call of the contract, the way TorchRec's collectives make them:
    # a 2-D pooled input with padded columns (rows cut into whole blocks), a
    # split size, decode and decode_into with the context, then a flat input
    # ending in a partial block, without a context.
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


def _data(rows: int = 10, width: int = 40) -> torch.Tensor:
    # Normal rows, and rows each codec must mark: NaN, +-inf, a range that
    # overflows float32, a huge maximum; plus an all-zero row and a tiny one.
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


@contextlib.contextmanager
def _paths(monkeypatch: pytest.MonkeyPatch, *, kernels: bool, fbgemm: bool) -> Iterator[None]:
    # The CPU fast paths on or off; off, CPU tensors run the non-CPU code.
    with monkeypatch.context() as m:
        for env, on in (("QCOMM_DISABLE_KERNELS", kernels), ("QCOMM_DISABLE_FBGEMM", fbgemm)):
            if on:
                m.delenv(env, raising=False)
            else:
                m.setenv(env, "1")
        yield


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Equal bytes; floats may differ only in NaN payloads.
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def test_host_reads_catches_what_syncs() -> None:
    t = torch.randn(5, 4)
    with _HostReads() as mode:
        bool(t.any())
        int(t.sum())
        t.nonzero()
        _ = t[t > 0]
        t[t[:, 0] > 0, :2] = 0.0
        t.masked_select(t > 0)
        t.to("meta")
    whys = [r.split(": ", 1)[1].split(" at ")[0] for r in mode.reads]
    assert len(whys) == 7, mode.reads
    assert whys.count("data-dependent size (indexing with a boolean mask)") == 2


@pytest.mark.parametrize("spec", SPECS)
def test_no_host_sync_on_a_non_cpu_device(spec: str) -> None:
    codec: Any = qcomm.load_codec(spec)
    x = torch.empty(6, 40, device="meta")
    with _HostReads() as mode:
        try:
            outputs = _contract_calls(codec, x)
        except (RuntimeError, NotImplementedError) as e:  # a read of meta data, recorded or not
            if not mode.reads:
                where = _codec_line(traceback.extract_tb(e.__traceback__))
                mode.reads.append(f"raised {type(e).__name__}: {e} at {where}")
            outputs = []
    assert not mode.reads, f"{spec}: {len(mode.reads)} host sync(s):\n" + "\n".join(mode.reads)
    assert all(t.device.type == "meta" for t in outputs)


@pytest.mark.parametrize("spec", SPECS)
def test_device_path_has_no_host_sync_and_the_cpu_paths_bytes(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec: Any = qcomm.load_codec(spec)
    x = _data()
    torch.manual_seed(0)  # mx4's stochastic rounding draws the same numbers on every path
    with _paths(monkeypatch, kernels=False, fbgemm=False), _HostReads() as mode:
        device_path = _contract_calls(codec, x)
    assert not mode.reads, f"{spec}: {len(mode.reads)} host sync(s):\n" + "\n".join(mode.reads)
    for kernels, fbgemm in ((True, True), (False, True)):
        torch.manual_seed(0)
        with _paths(monkeypatch, kernels=kernels, fbgemm=fbgemm):
            cpu_path = _contract_calls(codec, x)
        for i, (a, b) in enumerate(zip(device_path, cpu_path, strict=True)):
            assert _same_bits(a, b), (
                f"{spec}: output {i} differs (kernels={kernels}, fbgemm={fbgemm})"
            )
    if isinstance(codec, qcomm.BlockCodec):  # rows with NaN or +-inf decode to NaN
        back = device_path[1].view(x.shape[0], -1)
        assert bool(back[1:4].isnan().any(dim=1).all()) and not bool(back[0].isnan().any())
