"""
The built-in codecs' ``round_trip_error`` (their C kernels' one-pass
measurement) against qcomm's own, and the measurement's use of it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from kernel_copies import KERNELS, MISSING
from qcomm_builtin import _native

import qcomm
from qcomm.collectives import _measure
from qcomm.collectives._coding import uniform

needs_kernels = pytest.mark.skipif(KERNELS is None, reason=MISSING)

SPECS = [
    "int8",
    "int8:row_dim=7",
    "fp8_e4m3",
    "fp8_e5m2:row_dim=48",
    "mx4",
    "mx4:rounding=nearest",
    "mx4:rounding=floor",
    "mx4:rounding=ceil",
    "fp16",
    "bf16",
    "fp16:loss_scale=1024",
]


def _generic(codec: Any, x: torch.Tensor) -> list[float]:
    """qcomm's own measurement, by encoding and decoding (the codec's figures hidden)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_measure, "_quick", lambda codec, x: None)
        figures = _measure._error(codec, x, torch.float32)
    return [float(v) for v in figures]  # a tensor where it measured in float64


def _samples(block: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 4 * block, generator=g)
    x[::7, 1] *= 40.0  # outliers in some rows
    out = [
        ("whole blocks", x.reshape(-1)),
        ("a partial last block", x.reshape(-1)[: 5 * block + max(1, block // 3)]),
        ("runs of rows apart", x.reshape(-1).as_strided((8, 2 * block), (12 * block, 1))),
        ("one element", x.reshape(-1)[:1]),
    ]
    for scale in (1e-6, 1e-30, 1e20):
        out.append((f"scaled by {scale}", x.reshape(-1) * scale))
    out.append(("zeros", torch.zeros(3 * block)))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_a_codecs_own_figures_are_qcomms_measurement(spec: str, isa: str) -> None:
    codec: Any = qcomm.load_codec(spec)
    block = max(1, qcomm.codec_info(codec).error_block)
    for label, sample in _samples(block):
        got = codec.round_trip_error(sample)
        assert got is not None, label
        want = _generic(codec, sample)
        for value, expected in zip(got, want, strict=True):
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-30), (label, got, want)


@needs_kernels
@pytest.mark.parametrize("spec", SPECS)
def test_a_nonfinite_value_is_left_to_qcomms_measurement(spec: str) -> None:
    codec: Any = qcomm.load_codec(spec)
    x = torch.randn(256)
    for bad in (math.nan, math.inf):
        x[17] = bad
        assert codec.round_trip_error(x) is None
    # A finite input that decodes to inf (fp16 past 65504 is clamped, so only
    # a float32 difference that overflows) is left to it too.
    huge = torch.tensor([3e38, -3e38] * 16)
    if codec.round_trip_error(huge) is None:
        figures = [float(v) for v in _measure._error(codec, huge, torch.float32)]
        assert figures == _generic(codec, huge)


@pytest.mark.parametrize("spec", ["int8", "fp8_e4m3", "mx4", "fp16"])
def test_without_kernels_or_off_the_cpu_a_codec_has_no_figures(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec: Any = qcomm.load_codec(spec)
    assert codec.round_trip_error(torch.randn(64, dtype=torch.float64)) is None
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    assert codec.round_trip_error(torch.randn(64)) is None
    # qcomm then measures by encoding and decoding, to the same figures.
    x = torch.randn(64)
    assert _measure._error(codec, x, torch.float32) == _generic(codec, x)


def test_a_stochastic_codec_gives_no_figures_of_its_own() -> None:
    codec: Any = qcomm.load_codec("mx4:rounding=stochastic")
    assert codec.round_trip_error(torch.randn(64)) is None


class _Counting:
    """A codec whose ``round_trip_error`` counts its calls and gives what it is told."""

    def __init__(self, gives: Any) -> None:
        self._codec: Any = qcomm.load_codec("int8")
        self.info = qcomm.codec_info(self._codec)
        self.gives = gives
        self.calls = 0
        self.encodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)

    def encode(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self.encodes += 1
        return self._codec.encode(x, ctx)

    def round_trip_error(self, x: torch.Tensor) -> Any:
        self.calls += 1
        if isinstance(self.gives, Exception):
            raise self.gives
        return self.gives


def test_the_measurement_takes_a_codecs_own_figures_where_it_gives_them() -> None:
    x = torch.randn(256)
    codec = _Counting((0.25, 0.5))
    assert _measure._error(codec, x, torch.float32) == [0.25, 0.5]
    assert (codec.calls, codec.encodes) == (1, 0)
    for gives in (None, RuntimeError("no")):
        codec = _Counting(gives)
        assert _measure._error(codec, x, torch.float32) == _generic(qcomm.load_codec("int8"), x)
        assert (codec.calls, codec.encodes) == (1, 1)


def test_a_stochastic_codecs_own_figures_are_not_asked_for() -> None:
    import dataclasses

    codec = _Counting((0.25, 0.5))
    codec.info = dataclasses.replace(codec.info, stochastic=True)
    _measure._error(codec, torch.randn(256), torch.float32)
    assert (codec.calls, codec.encodes) == (0, 1)


class _Piece:
    """A chunk of no region (what Meter.take reads of a piece)."""

    region = None
    size = start = stop = 0


def test_a_chunks_sample_is_runs_of_whole_blocks_spread_over_it() -> None:
    int8 = qcomm.load_codec("int8")
    codings = uniform(int8, 2, torch.float32)
    side = codings.sides[0]

    chunk = torch.arange(32 * 1000, dtype=torch.float32)  # 1000 blocks of 32
    meter = _measure.Meter(codings, [], torch.float32, [1], [True])
    meter._quota = [_measure.SAMPLE]
    meter.take(side.coding, _Piece(), chunk)
    (sample,) = meter._samples[0]
    assert sample.data_ptr() == chunk.data_ptr()  # read in place, not copied
    blocks = sample.reshape(-1, 32)[:, 0].long() // 32
    runs = blocks.view(_measure.RUNS, -1)
    assert runs.numel() == _measure.SAMPLE // 32
    assert torch.equal(runs[:, 1:] - runs[:, :-1], torch.ones_like(runs[:, 1:]))  # consecutive
    assert torch.equal(runs[:, 0], torch.arange(_measure.RUNS) * (1000 // _measure.RUNS))
    # The errors measured are exactly those of encoding these blocks.
    lost = int8.decode(int8.encode(sample.reshape(-1))) - sample.reshape(-1)
    rms, top = _measure._error(int8, sample, torch.float32)
    assert rms == pytest.approx(float(lost.norm() / sample.norm()), rel=1e-5)
    assert top == pytest.approx(float(lost.abs().max() / sample.abs().max()), rel=1e-5)


@needs_kernels
def test_the_kernels_refuse_bad_arguments_naming_them() -> None:
    x = torch.randn(64)
    p = x.data_ptr()
    with pytest.raises(
        ValueError, match="codec must be .int8., .fp8., .mx4., .fp16. or .bf16., got .int4."
    ):
        KERNELS.round_trip_error("int4", p, 1, 64, 64, 32, True, 0)
    with pytest.raises(ValueError, match="runs must be in"):
        KERNELS.round_trip_error("int8", p, 0, 64, 64, 32, True, 0)
    with pytest.raises(ValueError, match="stride must be in"):
        KERNELS.round_trip_error("int8", p, 2, 32, 16, 32, True, 0)
    with pytest.raises(ValueError, match="group_size must be even"):
        KERNELS.round_trip_error("mx4", p, 1, 64, 64, 31, False, p)
    with pytest.raises(ValueError, match="table is a null pointer"):
        KERNELS.round_trip_error("mx4", p, 1, 64, 64, 32, False, 0)
    with pytest.raises(ValueError, match="n must be in"):
        KERNELS.error_norms(p, p, 0)
    with pytest.raises(ValueError, match="src is a null pointer"):
        KERNELS.error_norms(0, p, 4)


@pytest.mark.parametrize("spec", ["int8", "fp16"])
def test_a_sample_from_several_chunks_is_measured_as_one(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    codings = uniform(codec, 2, torch.float32)
    side = codings.sides[0]

    chunks = [torch.randn(32 * 600), torch.randn(32 * 600) * 1e-3]
    meter = _measure.Meter(codings, [], torch.float32, [1], [True])
    meter._quota = [_measure.SAMPLE // 2]
    for chunk in chunks:
        meter.take(side.coding, _Piece(), chunk)
    parts = [p.reshape(-1) for p in meter._samples[0]]
    assert len(parts) == 2 and all(p.numel() == _measure.SAMPLE // 2 for p in parts)
    figures = meter.errors()
    assert figures == pytest.approx(_generic(codec, torch.cat(parts)), rel=1e-5)
