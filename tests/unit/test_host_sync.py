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
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from codec_calls import SPECS, contract_calls, same_bits, sample
from torch.utils._python_dispatch import TorchDispatchMode

import qcomm

aten = torch.ops.aten

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
            outputs = contract_calls(codec, x)
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
    x = sample()
    torch.manual_seed(0)  # mx4's stochastic rounding draws the same numbers on every path
    with _paths(monkeypatch, kernels=False, fbgemm=False), _HostReads() as mode:
        device_path = contract_calls(codec, x)
    assert not mode.reads, f"{spec}: {len(mode.reads)} host sync(s):\n" + "\n".join(mode.reads)
    for kernels, fbgemm in ((True, True), (False, True)):
        torch.manual_seed(0)
        with _paths(monkeypatch, kernels=kernels, fbgemm=fbgemm):
            cpu_path = contract_calls(codec, x)
        for i, (a, b) in enumerate(zip(device_path, cpu_path, strict=True)):
            assert same_bits(a, b), (
                f"{spec}: output {i} differs (kernels={kernels}, fbgemm={fbgemm})"
            )
    if isinstance(codec, qcomm.BlockCodec):  # rows with NaN or +-inf decode to NaN
        back = device_path[1].view(x.shape[0], -1)
        assert bool(back[1:4].isnan().any(dim=1).all()) and not bool(back[0].isnan().any())
