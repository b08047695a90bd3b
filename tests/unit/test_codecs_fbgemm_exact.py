r"""
Bit-for-bit comparisons of the built-in codecs with fbgemm-gpu on CPU.

- fp16, bf16: the wire equals fbgemm's ``QuantizedCommCodec`` (with and
  without a loss scale).
- int8: the wire equals fbgemm's ``FloatToFused8BitRowwiseQuantized`` kernel
  and fbgemm's codec, whether qcomm runs that kernel or its torch fallback;
  decoding equals fbgemm's ``Fused8BitRowwiseQuantizedToFloat``.
- fp8_e4m3, fp8_e5m2: fbgemm has no CPU kernel for row-wise FP8. Its element
  rounding is checked against fbgemm's CPU kernel of the same element format
  (``FloatToHFP8Quantized`` with the forward / backward exponent bits, bias
  and largest value), and the scale against fbgemm's formula in float32.
- fp8_e4m3_tensor: the wire equals fbgemm's ``fp32_to_hfp8_with_clamp`` with
  TorchRec's default FP8 parameters and fbgemm's codec of ``SparseType.FP8``
  without a row dim (TorchRec's default FP8 comm); decoding equals
  ``hfp8_to_fp32``.
- int4: fbgemm's ``FusedNBitRowwiseQuantizedSBHalfToFloat`` decodes its wire
  to the same values (the layout is fbgemm's; its encoder rounds the scale
  and bias to nearest, so the bytes differ).

Skipped as a whole where fbgemm-gpu is not installed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qcomm

pytest.importorskip("fbgemm_gpu")

from fbgemm_gpu.quantize_comm import QuantizedCommCodec  # noqa: E402
from fbgemm_gpu.split_embedding_configs import SparseType  # noqa: E402

OPS = torch.ops.fbgemm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8_inputs(d: int) -> list[torch.Tensor]:
    g = _gen(d)
    rows = 3000
    scaled = torch.randn(rows, d, generator=g) * 10 ** torch.empty(rows, 1).uniform_(
        -8, 8, generator=g
    )
    # Rows whose values sit on rounding ties of the 255 steps of [0, 1].
    ties = (torch.randint(0, 255, (rows, d), generator=g).float() + 0.5) / 255
    ties[:, 0], ties[:, -1] = 0.0, 1.0
    return [
        torch.randn(rows, d, generator=g),
        scaled,
        ties,
        torch.full((7, d), 0.3),  # constant rows
        torch.randn(rows, d, generator=g) * 1e-30,
        torch.randn(rows, d, generator=g) * 1e37,
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# -- fp16, bf16 -----------------------------------------------------------------


@pytest.mark.parametrize("name, precision", [("fp16", SparseType.FP16), ("bf16", SparseType.BF16)])
@pytest.mark.parametrize("loss_scale", [None, 3.0, 1024.0, 1e-3])
def test_half_wire_equals_fbgemm(
    name: str, precision: SparseType, loss_scale: float | None
) -> None:
    g = _gen(1)
    x = torch.randn(300_007, generator=g) * 10 ** torch.empty(300_007).uniform_(
        -45, 39, generator=g
    )
    x[:6] = torch.tensor([math.nan, math.inf, -math.inf, 3.4e38, -0.0, 1e-45])
    ours = qcomm.load_codec(name, loss_scale=loss_scale)
    theirs = QuantizedCommCodec(precision, loss_scale=loss_scale)
    wire = ours.encode(x)
    assert torch.equal(_bits(wire), _bits(theirs.encode(x)))
    if loss_scale is None:
        # fbgemm divides by the loss scale in the wire's 16-bit dtype; qcomm in
        # float32 (more exact), so decoding is compared without one.
        assert torch.equal(_bits(ours.decode(wire)), _bits(theirs.decode(wire)))


# -- int8 -----------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 5, 8, 32, 64, 100, 128])
def test_int8_wire_equals_fbgemm_kernel(d: int, int8_path: str) -> None:
    codec = qcomm.load_codec("int8", row_dim=d)
    for x in _int8_inputs(d):
        ref = OPS.FloatToFused8BitRowwiseQuantized(x)
        wire = codec.encode(x.reshape(-1))
        assert torch.equal(wire, ref.view(-1)), (d, int8_path)
        decoded = codec.decode(wire)
        assert torch.equal(_bits(decoded), _bits(OPS.Fused8BitRowwiseQuantizedToFloat(ref)))


def test_int8_wire_equals_fbgemm_codec(int8_path: str) -> None:
    x = torch.randn(32 * 4096, generator=_gen(2))
    theirs = QuantizedCommCodec(SparseType.INT8)
    ctx = theirs.create_context()
    ours = qcomm.load_codec("int8")
    wire = ours.encode(x)
    assert torch.equal(wire, theirs.encode(x, ctx))
    assert torch.equal(_bits(ours.decode(wire)), _bits(theirs.decode(wire, ctx)))
    assert ours.calc_quantized_size(x.numel()) == theirs.calc_quantized_size(x.numel(), ctx)


def test_int8_fallback_equals_fbgemm_on_large_chunked_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # More than one CPU chunk, a partial last row, and a NaN row in the middle.
    x = torch.randn(3 * (1 << 20) + 17, generator=_gen(3))
    x[1_500_000] = math.nan
    codec = qcomm.load_codec("int8")
    wire = codec.encode(x)
    decoded = codec.decode(wire)
    monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    assert torch.equal(codec.encode(x), wire)
    assert torch.equal(_bits(codec.decode(wire)), _bits(decoded))
    assert int(decoded.isnan().sum()) == 32


# -- int4 ---------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 8, 32, 64])
def test_int4_wire_decodes_as_fbgemms_fused_4bit_rows(d: int) -> None:
    codec = qcomm.load_codec("int4", row_dim=d)
    for x in _int8_inputs(d):
        x = x.clamp(-6e4, 6e4)  # float16 scale and bias
        wire = codec.encode(x)
        theirs = OPS.FusedNBitRowwiseQuantizedSBHalfToFloat(wire.view(x.shape[0], -1), 4)
        assert torch.equal(_bits(codec.decode(wire)), _bits(theirs))


# -- fp8 ----------------------------------------------------------------------

FP8 = {
    # name: (fbgemm's exponent bits, bias, largest value), per fbgemm's
    # row-wise kernel: forward 1-4-3, backward 1-5-2.
    "fp8_e4m3": (4, 15, 0.9375),
    "fp8_e5m2": (5, 31, 0.875),
}


def _fp8_values(name: str) -> torch.Tensor:
    # Every magnitude class of the format: random values over all binades,
    # every representable value, and every midpoint between neighbours
    # (round-half-to-even ties), in the units of the scaled row.
    ebits, bias, max_pos = FP8[name]
    g = _gen(4)
    n = 100_000
    rand = (torch.rand(n, generator=g) * 2 - 1) * 2.0 ** torch.randint(
        -40, 1, (n,), generator=g
    ).float()
    codes = torch.arange(256, dtype=torch.uint8).view(1, -1)
    grid = OPS.HFP8QuantizedToFloat(codes, ebits, bias).view(-1)
    grid = grid[grid.abs() <= max_pos].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, mids, torch.tensor([max_pos, -max_pos, 0.0]), rand])


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("d", [4, 7, 32])
def test_fp8_elements_and_scale_equal_fbgemm(name: str, d: int) -> None:
    ebits, bias, max_pos = FP8[name]
    values = _fp8_values(name)
    values = values[: values.numel() // (d - 1) * (d - 1)].view(-1, d - 1)
    # Each row also holds its max-abs m, so that the row's scale
    # max_pos / (m + 1e-20) maps it onto `values`: exactly for half the rows
    # (m = max_pos * 2**k makes the scale 2**-k, keeping the ties), and
    # through float32 rounding for the other half (any m).
    g = _gen(5)
    k = torch.randint(-30, 60, (values.shape[0], 1), generator=g).float()
    m = max_pos * 2.0**k
    half = values.shape[0] // 2
    m[half:] = 10 ** torch.empty(values.shape[0] - half, 1).uniform_(-30, 30, generator=g)
    spread = torch.cat([values[:half] * 2.0 ** k[:half], values[half:] / max_pos * m[half:]])
    x = torch.cat([spread, m], dim=1).float()
    codec = qcomm.load_codec(name, row_dim=d)
    rows = codec.encode(x.reshape(-1)).view(x.shape[0], -1)
    a = (d + 3) // 4 * 4
    # fbgemm's scale, in float32 as its kernel computes it.
    xn = x.numpy()
    max_abs = np.maximum(xn.max(axis=1), -xn.min(axis=1)).astype(np.float32)
    scale = np.float32(max_pos) / (max_abs + np.float32(1e-20))
    ours_scale = rows[:, a : a + 4].clone().view(torch.float32).view(-1).numpy()
    assert np.array_equal(ours_scale, scale)
    assert rows[:, a + 4 :].eq(0).all() and rows[:, d:a].eq(0).all()
    # fbgemm's element rounding of x * scale (its CPU kernel of the format).
    scaled = torch.from_numpy(xn * scale[:, None])
    ref = OPS.FloatToHFP8Quantized(scaled.contiguous(), ebits, bias, max_pos)
    assert torch.equal(rows[:, :d], ref)
    # fbgemm's decoding: element value / scale, in float32.
    elems = OPS.HFP8QuantizedToFloat(ref.contiguous(), ebits, bias).numpy()
    expected = torch.from_numpy(elems / scale[:, None])
    assert torch.equal(_bits(codec.decode(rows.reshape(-1))), _bits(expected))


def test_fbgemm_has_no_cpu_rowwise_fp8() -> None:
    # Why the fp8 codecs are compared piecewise above: should fbgemm gain a
    # CPU kernel, compare whole wires instead and use it where it is fast.
    with pytest.raises(RuntimeError):
        OPS.FloatToFP8RowwiseQuantized(torch.randn(4, 32), True)


# -- fp8_e4m3_tensor ------------------------------------------------------------


def _hfp8_inputs() -> torch.Tensor:
    # Every code's value and every midpoint between neighbours (ties to
    # even), a few ulps around them, values beyond the clamp, subnormals of
    # the format and of float32, random magnitudes over all binades, signs.
    grid = OPS.HFP8QuantizedToFloat(torch.arange(120, dtype=torch.uint8).view(1, -1), 4, 15)
    grid = grid.view(-1)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([grid, mids]).view(torch.int32)
    near = torch.cat([near + k for k in range(-3, 4)]).view(torch.float32)
    g = _gen(11)
    n = 200_000
    rand = torch.rand(n, generator=g) * 2.0 ** torch.randint(-150, 10, (n,), generator=g).float()
    extra = torch.tensor([0.9375, 0.96875, 0.97, 1.0, 7.0, 3.4e38, math.inf, 2.0**-18, 1e-45])
    x = torch.cat([near, rand, extra])
    x = x[~x.isnan()]  # NaN is the one deliberate difference
    return torch.cat([x, -x])


def test_fp8_tensor_wire_equals_fbgemm_hfp8() -> None:
    from fbgemm_gpu.quantize_comm import bias, ebits, mbits
    from fbgemm_gpu.quantize_utils import fp32_to_hfp8_with_clamp, hfp8_to_fp32

    x = _hfp8_inputs()
    codec = qcomm.load_codec("fp8_e4m3_tensor")
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 and wire.shape == x.shape
    # fbgemm's CPU kernel takes 2-D input only.
    ref = fp32_to_hfp8_with_clamp(x.view(1, -1), ebits, mbits, bias).view(-1)
    assert torch.equal(wire, ref)
    assert torch.equal(_bits(codec.decode(wire)), _bits(hfp8_to_fp32(ref.view(1, -1), ebits, bias)))


def test_fp8_tensor_equals_torchrecs_default_fp8_codec() -> None:
    # TorchRec's CommType.FP8 without fp8_quantize_dim: fbgemm's codec with
    # no row dim, on both passes; it ignores any loss scale.
    theirs = QuantizedCommCodec(SparseType.FP8)
    ctx = theirs.create_context()
    assert ctx.row_dim <= 0  # tensor-wise
    ours = qcomm.load_codec("fp8_e4m3_tensor")
    x = _hfp8_inputs().view(2, -1)
    wire = theirs.encode(x, ctx)
    assert torch.equal(ours.encode(x), wire)
    assert torch.equal(_bits(ours.decode(wire)), _bits(theirs.decode(wire, ctx)))
    for n in (0, 1, 7, 4096):
        assert ours.calc_quantized_size(n) == theirs.calc_quantized_size(n, ctx) == n


def test_fp8_tensor_decodes_every_code_fbgemm_writes() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    written = (codes & 0x7F) <= 0x77  # fbgemm clamps to 0.9375, code 0x77
    theirs = OPS.HFP8QuantizedToFloat(codes[written].view(1, -1), 4, 15).view(-1)
    ours = qcomm.load_codec("fp8_e4m3_tensor").decode(codes)
    assert torch.equal(_bits(ours[written]), _bits(theirs))
    # The exponent field fbgemm never writes: ours are finite values above
    # the clamp but NaN at 0x7F / 0xFF, the code NaN is sent as.
    assert ours[~written].isnan().tolist() == [c & 0x7F == 0x7F for c in codes[~written].tolist()]
