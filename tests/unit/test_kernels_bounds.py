r"""
The block codecs' ``quantize``, ``dequantize`` and ``dequantize_into``, called
directly with tensors their C kernels (and fbgemm's CPU operators) cannot
take as packed memory: a strided view, an ``out`` of the wrong length or
dtype, a wire that is not whole blocks. Every path (qcomm's kernels, fbgemm's
operators for int8, the torch code) must behave as the torch code does, and
nothing outside the tensors may be read or written.

The memory around each view holds values that would change the result if
they were read (NaN, huge magnitudes) or sentinels that show a write.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from qcomm_builtin import _fbgemm, _native

import qcomm

KERNELS: Any = _native._load()

SPECS = [
    "int8",
    "int8:row_dim=7",
    "fp8_e4m3",
    "fp8_e5m2:row_dim=3",
    "mx4",
    "mx4:group_size=6,rounding=floor",
]
SENTINEL = -12345.0


def _paths() -> list[str]:
    paths = ["torch"]
    if KERNELS is not None:
        paths.append("kernels")
    if _fbgemm._load() is not None:
        paths.append("fbgemm")  # int8 without the kernels
    return paths


@pytest.fixture(params=_paths())
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    r"""Runs a test with each CPU path: qcomm's kernels, fbgemm's operators, the torch code."""
    monkeypatch.setenv(_native.DISABLE_ENV, "0" if request.param == "kernels" else "1")
    monkeypatch.setenv(_fbgemm.DISABLE_ENV, "0" if request.param == "fbgemm" else "1")
    return str(request.param)


@pytest.fixture(params=[p for p in _paths() if p != "fbgemm"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    r"""As :func:`path`, without fbgemm's operators (which take other dtypes as they are)."""
    monkeypatch.setenv(_native.DISABLE_ENV, "0" if request.param == "kernels" else "1")
    monkeypatch.setenv(_fbgemm.DISABLE_ENV, "1")
    return str(request.param)


def _load(spec: str) -> Any:
    return qcomm.load_codec(spec)


def _torch_code(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> Any:
    # What the torch code does: its result, or the exception it raises.
    with monkeypatch.context() as m:
        m.setenv(_native.DISABLE_ENV, "1")
        m.setenv(_fbgemm.DISABLE_ENV, "1")
        try:
            return fn()
        except Exception as err:  # the reference outcome
            return err


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _same_outcome(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any], what: str) -> Any:
    # fn() on the path under test against the torch code: the same bits, or
    # an exception of the same type.
    expected = _torch_code(monkeypatch, fn)
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)):
            fn()
        return None
    got = fn()
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, what
        assert torch.equal(_bits(got), _bits(expected)), f"{what}: differs from the torch code"
    return got


def _poisoned(n: int, step: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A view of n values `step` apart, `offset` in; every other element of its
    # storage is NaN or huge, so a kernel reading them changes the wire.
    base = torch.full((offset + n * step + 7,), float("nan"))
    base[1::3] = 3e38
    view = base[offset : offset + n * step : step]
    view.copy_(torch.randn(n, generator=torch.Generator().manual_seed(n + step)))
    return view, base


@pytest.mark.parametrize("spec", SPECS)
def test_quantize_of_a_strided_view_reads_the_view_alone(
    spec: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    for n in [5 * codec.block, 5 * codec.block + 1, 1]:
        for step, offset in [(2, 0), (3, 5), (7, 1)]:
            view, base = _poisoned(n, step, offset)
            before = base.clone()
            wire = _same_outcome(monkeypatch, partial(codec.quantize, view), f"{spec} {path}")
            assert torch.equal(wire, codec.quantize(view.contiguous())), f"{spec} [{path}]"
            assert torch.equal(_bits(base), _bits(before)), "quantize wrote into its input"
    # A column of a matrix, through encode too.
    matrix = torch.randn(4 * codec.block, 3, generator=torch.Generator().manual_seed(1))
    matrix[:, 0] = float("nan")
    column = matrix[:, 1]
    expected = codec.quantize(column.contiguous())
    assert torch.equal(_same_outcome(monkeypatch, lambda: codec.quantize(column), spec), expected)
    assert torch.equal(codec.encode(column), expected)


@pytest.mark.parametrize("spec", SPECS)
def test_quantize_of_another_dtype_or_shape_does_what_the_torch_code_does(
    spec: str, kernel_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel reads float32: a float16 tensor would be read twice as far.
    codec = _load(spec)
    x = torch.randn(6 * codec.block, generator=torch.Generator().manual_seed(2))
    for label, t in [
        ("float16", x.half()),
        ("bfloat16", x.bfloat16()),
        ("float64", x.double()),
        ("2-D", x.view(6, codec.block)),
        ("2-D ragged", torch.randn(2, codec.block + 1)),
    ]:
        what = f"{spec} [{kernel_path}] {label}"
        _same_outcome(monkeypatch, partial(codec.quantize, t), what)


@pytest.mark.parametrize("spec", SPECS)
def test_dequantize_of_a_strided_wire_reads_the_wire_alone(
    spec: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    wire = codec.encode(torch.randn(9 * codec.block, generator=torch.Generator().manual_seed(3)))
    # The wire's bytes every other byte of a buffer whose other bytes are 0xFF
    # (an mx4 exponent of NaN, a NaN int8 or fp8 scale where they land).
    base = torch.full((2 * wire.numel() + 3,), 255, dtype=torch.uint8)
    strided = base[1 : 1 + 2 * wire.numel() : 2]
    strided.copy_(wire)
    expected = codec.dequantize(wire)
    got = _same_outcome(monkeypatch, lambda: codec.dequantize(strided), f"{spec} [{path}]")
    if got is not None:
        assert torch.equal(_bits(got), _bits(expected))
    out = torch.empty(expected.numel())
    _same_outcome(monkeypatch, lambda: codec.dequantize_into(strided, out), f"{spec} [{path}]")
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("spec", SPECS)
def test_dequantize_into_a_wrong_out_writes_nothing_outside_it(
    spec: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    b = codec.block
    wire = codec.encode(torch.randn(4 * b, generator=torch.Generator().manual_seed(4)))
    n = codec.dequantize(wire).numel()
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for label, size in [("one block short", n - b), ("one element short", n - 1)]:
        buffer = torch.full((2 * n + 64,), SENTINEL)
        cases[label] = (buffer[:size], buffer)
        cases[f"{label}, 2-D"] = (buffer[: size // b * b].view(-1, b), buffer)
    buffer = torch.full((3 * n,), SENTINEL)
    cases["one block long"] = (buffer[: n + b], buffer)
    wide = torch.full((2, 2 * n), SENTINEL)
    cases["band of columns, one block short"] = (wide[:, : (n - 2 * b) // 2], wide)
    buffer = torch.full((n,), SENTINEL, dtype=torch.float64)
    cases["float64"] = (buffer, buffer)
    buffer = torch.full((n + 64,), SENTINEL, dtype=torch.float16)
    cases["float16 (half the bytes)"] = (buffer[:n], buffer)
    empty = codec.encode(torch.zeros(0))
    for label, (out, whole) in cases.items():
        inside = torch.zeros(whole.numel(), dtype=torch.bool)
        offset = out.storage_offset()
        mask = inside.as_strided(out.shape, out.stride(), offset)
        mask.fill_(True)
        for w in (wire, empty):
            whole_before = whole.clone()
            what = f"{spec} [{path}] dequantize_into {label}"
            _same_outcome(monkeypatch, partial(codec.dequantize_into, w, out), what)
            flat, flat_before = whole.reshape(-1), whole_before.reshape(-1)
            outside = ~inside
            assert torch.equal(_bits(flat[outside]), _bits(flat_before[outside])), (
                f"{what}: wrote outside out"
            )
        # decode_into checks out first and says so.
        with pytest.raises(ValueError, match="out"):
            codec.decode_into(wire, out)


@pytest.mark.parametrize("spec", SPECS)
def test_a_wire_not_whole_blocks_is_refused_as_by_the_torch_code(
    spec: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    wire = codec.encode(torch.randn(3 * codec.block, generator=torch.Generator().manual_seed(5)))
    short = wire[:-1]
    out = torch.full((3 * codec.block,), SENTINEL)
    _same_outcome(monkeypatch, lambda: codec.dequantize(short), f"{spec} [{path}] dequantize")
    _same_outcome(
        monkeypatch, lambda: codec.dequantize_into(short, out[: 2 * codec.block]), f"{spec}"
    )
    assert bool((out[2 * codec.block :] == SENTINEL).all())
    # A wire of another dtype: a kernel would read its bytes as the wire's.
    wide = wire.to(torch.int16)
    _same_outcome(monkeypatch, lambda: codec.dequantize(wide), f"{spec} [{path}] int16 wire")
