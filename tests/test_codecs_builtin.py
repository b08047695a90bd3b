r"""
The built-in codecs fp16, bf16, int8, fp8_e4m3 and fp8_e5m2, reached through
their entry points: the codec contract, the conformance kit, the declared
error bounds against float64 references, the wire formats, non-finite input,
bad options and malformed wire.

Bit-for-bit comparisons with fbgemm-gpu live in test_codecs_fbgemm_exact.py.
"""

from __future__ import annotations

import doctest
import importlib
import math
import sys

import pytest
import torch

import qcomm
from qcomm.testing import check_codec

SPECS = [
    "fp16",
    "fp16:loss_scale=1024",
    "fp16:loss_scale=0.125",
    "bf16",
    "bf16:loss_scale=3.5",
    "int8",
    "int8:row_dim=1",
    "int8:row_dim=5",
    "int8:row_dim=64",
    "fp8_e4m3",
    "fp8_e4m3:row_dim=7",
    "fp8_e5m2",
    "fp8_e5m2:row_dim=128",
]
BLOCK_SPECS = [s for s in SPECS if s.startswith(("int8", "fp8"))]
MODULES = ["qcomm_builtin._blocks", "qcomm_builtin._fbgemm"]
MODULES += ["qcomm_builtin.half", "qcomm_builtin.int8", "qcomm_builtin.fp8"]
MODULES += ["qcomm_builtin._native"]


@pytest.fixture(params=["fbgemm", "torch"])
def int8_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    r"""Runs a test with fbgemm's kernels allowed and with the torch fallback forced."""
    if request.param == "torch":
        monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    return str(request.param)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _datasets(n: int, max_abs: float) -> dict[str, torch.Tensor]:
    g = _gen(1)
    normal = torch.randn(n, generator=g)
    wide = torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-6, 6, generator=g)
    huge = torch.randn(n, generator=g, dtype=torch.float64)
    huge = (huge / huge.abs().max() * min(max_abs, 1e38)).float()
    sets = {
        "normal": normal,
        "wide": wide,
        "tiny 1e-30": normal * 1e-30,
        "tiny 1e-42 (subnormal)": normal * 1e-42,
        "huge": huge,
        "constant": torch.full((n,), -3.25),
        "zeros": torch.zeros(n),
    }
    # The bound speaks for |x| <= max_abs_input; saturation is tested apart.
    return {k: v.clamp(-max_abs, max_abs) for k, v in sets.items()}


def _declared_bound(info: qcomm.CodecInfo, x: torch.Tensor) -> torch.Tensor:
    # |x_hat - x| <= rel * s + abs, s = |x| or the block's max-abs (CodecInfo).
    mag = x.double().abs()
    if info.error_block > 1:
        b = info.error_block
        rows = -(-x.numel() // b)
        padded = torch.nn.functional.pad(mag, (0, rows * b - x.numel())).view(rows, b)
        mag = padded.amax(dim=1, keepdim=True).expand(rows, b).reshape(-1)[: x.numel()]
    return info.rel_error_bound * mag + info.abs_error_bound


# -- loading and the conformance kit --------------------------------------------


@pytest.mark.parametrize(
    "name, cls",
    [
        ("fp16", "FP16Codec"),
        ("bf16", "BF16Codec"),
        ("int8", "Int8Codec"),
        ("fp8_e4m3", "FP8E4M3Codec"),
        ("fp8_e5m2", "FP8E5M2Codec"),
    ],
)
def test_entry_point_loads_the_class(name: str, cls: str) -> None:
    codec = qcomm.load_codec(name)
    assert type(codec).__name__ == cls
    assert codec.info.name == name
    assert isinstance(codec, qcomm.QuantizedCommCodec)


@pytest.mark.parametrize("spec", SPECS)
def test_passes_conformance_kit(spec: str) -> None:
    report = check_codec(qcomm.load_codec(spec))
    assert report.worst_error <= 1.0
    assert "round_trip" in report.rules and "padded_size" in report.rules


@pytest.mark.parametrize("spec", [s for s in SPECS if s.startswith("int8")])
def test_int8_torch_fallback_passes_conformance_kit(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    assert check_codec(qcomm.load_codec(spec)).worst_error <= 1.0


def test_docstring_examples_run() -> None:
    for name in MODULES:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
        assert result.attempted > 0, name


# -- the declared bound, against float64 --------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_within_declared_bound(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    info = codec.info
    n = 4096 + 3  # a partial last row too
    for label, x in _datasets(n, info.max_abs_input).items():
        y = codec.decode(codec.encode(x))
        assert y.dtype == torch.float32
        assert n <= y.numel() <= n + max(info.error_block, 1)
        err = (y[:n].double() - x.double()).abs()
        bound = _declared_bound(info, x)
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{spec} on {label}: element {worst} = {x[worst].item()!r} decodes to "
            f"{y[worst].item()!r}, error {err[worst].item():.3g} > bound {bound[worst].item():.3g}"
        )


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_declared_bound_is_not_loose(spec: str) -> None:
    # The relative part must be reached to within a factor of 2 on normal data:
    # a bound declared far too wide would make the round-trip tests vacuous.
    codec = qcomm.load_codec(spec)
    x = torch.randn(1 << 16, generator=_gen(2))
    err = (codec.decode(codec.encode(x))[: x.numel()].double() - x.double()).abs()
    ratio = (err / _declared_bound(codec.info, x)).max().item()
    assert 0.5 < ratio <= 1.0


# -- sizes, padding, context ----------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_calc_quantized_size_matches_encode(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    for n in [0, 1, 2, 3, 31, 97, 1009, 65537, 1_000_003]:
        x = torch.randn(n, generator=_gen(n))
        for ctx in (None, codec.create_context()):
            wire = codec.encode(x, ctx)
            assert wire.dim() == 1 and wire.dtype == codec.quantized_dtype
            assert codec.calc_quantized_size(n, ctx) == wire.numel(), (spec, n)


@pytest.mark.parametrize("spec", BLOCK_SPECS)
def test_sizes_add_up_for_aligned_lengths_and_split_wire_decodes(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    d = codec.row_dim
    counts = [3 * d, 0, d, 5 * d]
    pieces = [torch.randn(c, generator=_gen(c)) * 10.0**i for i, c in enumerate(counts)]
    sizes = [codec.calc_quantized_size(c) for c in counts]
    assert sum(sizes) == codec.calc_quantized_size(sum(counts))
    wire = codec.encode(torch.cat(pieces))
    for piece, part in zip(pieces, wire.split(sizes)):
        assert torch.equal(part, codec.encode(piece))
        assert torch.equal(codec.decode(part), codec.decode(codec.encode(piece)))


@pytest.mark.parametrize("spec", BLOCK_SPECS)
def test_padded_size_pads_every_rank_to_whole_rows(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    d = codec.row_dim
    dims = [d + 1, 2 * d, 0, 3]
    ctx = codec.create_context()
    x = torch.randn(6, dims[0])
    padded, padding = codec.padded_size(x, dims, 0, ctx)
    expected = [-(-w // d) * d for w in dims]
    assert (padded, padding) == (expected[0], expected[0] - dims[0])
    assert ctx.padded_dim_sum_per_rank == expected
    # TorchRec pads the 2-D input and encodes it; the decoded rows hold the input.
    xp = torch.nn.functional.pad(x, (0, padding))
    y = codec.decode(codec.encode(xp, ctx), ctx).view(6, padded)[:, : dims[0]]
    bound = _declared_bound(codec.info, xp.reshape(-1)).view(6, padded)[:, : dims[0]]
    assert bool(((y.double() - x.double()).abs() <= bound).all())
    # A 1-D input needs no column padding; a None context records nothing.
    assert codec.padded_size(torch.zeros(10), dims, 0, ctx) == (10, 0)
    assert codec.padded_size(torch.zeros(2, 3), dims, 3, None) == (expected[3], expected[3] - 3)


@pytest.mark.parametrize("spec", SPECS)
def test_padded_size_rejects_a_wrong_width(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    with pytest.raises(ValueError, match="dim_per_rank"):
        codec.padded_size(torch.zeros(2, 5), [4, 4], 0, codec.create_context())
    with pytest.raises(ValueError, match="my_rank"):
        codec.padded_size(torch.zeros(2, 4), [4, 4], 2, codec.create_context())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_casts_need_no_context_nor_padding(name: str) -> None:
    codec = qcomm.load_codec(name)
    assert codec.create_context() is None
    assert codec.padded_size(torch.zeros(3, 7), [7, 9], 0, None) == (7, 0)


def test_input_of_any_shape_layout_and_float_dtype_is_read_flat() -> None:
    base = torch.randn(64, 48, generator=_gen(3))
    for spec in ["fp16", "bf16", "int8", "fp8_e4m3"]:
        codec = qcomm.load_codec(spec)
        flat = codec.encode(base.reshape(-1))
        # Element-wise casts keep the input's shape (TorchRec's reduce-scatter
        # reads it); block codecs return a flat wire.
        assert torch.equal(codec.encode(base).reshape(-1), flat)
        transposed = base.t().contiguous().t()  # same values, other strides
        assert torch.equal(codec.encode(transposed).reshape(-1), flat)
        strided = torch.stack([base.reshape(-1), base.reshape(-1)], dim=1)[:, 0]
        assert torch.equal(codec.encode(strided), flat)
        half = base.half()
        assert torch.equal(codec.encode(half), codec.encode(half.float()))
        # Quantizing is not differentiable: an input that requires grad is
        # encoded as its values (fbgemm's kernels refuse autograd inputs).
        leaf = base.clone().requires_grad_(True)
        wire = codec.encode(leaf)
        assert torch.equal(wire.reshape(-1), flat) and not wire.requires_grad


# -- wire formats -------------------------------------------------------------


def test_fp16_and_bf16_wire_is_the_clamped_cast() -> None:
    x = torch.randn(10_000, generator=_gen(4)) * 1e5
    for name, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16)]:
        hi = torch.finfo(dtype).max
        ref = torch.clamp(x.double() * 8.0, -hi, hi).float().to(dtype)
        wire = qcomm.load_codec(name, loss_scale=8.0).encode(x)
        assert torch.equal(wire.view(torch.int16), ref.view(torch.int16))
        back = qcomm.load_codec(name, loss_scale=8.0).decode(wire)
        assert torch.equal(back, ref.float() / 8.0)


def test_half_codecs_are_summable() -> None:
    a, b = torch.randn(1000, generator=_gen(5)), torch.randn(1000, generator=_gen(6))
    for name in ["fp16", "bf16"]:
        codec = qcomm.load_codec(name)
        assert codec.info.summable
        total = codec.decode(codec.encode(a) + codec.encode(b))
        bound = 3 * (_declared_bound(codec.info, a) + _declared_bound(codec.info, b))
        assert bool(((total.double() - (a + b).double()).abs() <= bound).all())


def test_int8_wire_layout() -> None:
    codec = qcomm.load_codec("int8:row_dim=4")
    wire = codec.encode(torch.tensor([0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0]))
    rows = wire.view(2, 12)
    assert rows[0, :4].tolist() == [0, 85, 170, 255]
    scale_bias = rows[:, 4:].clone().view(torch.float32)
    assert scale_bias[0].tolist() == [torch.tensor(3.0 / 255).item(), 0.0]
    assert scale_bias[1].tolist() == [0.0, 5.0]
    assert rows[1, :4].tolist() == [0, 0, 0, 0]
    # A partial last row repeats its last element: it keeps its own min/max.
    part = codec.encode(torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0, 1.0]))
    assert part.view(2, 12)[1, :4].tolist() == [0, 255, 255, 255]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_wire_layout(name: str) -> None:
    codec = qcomm.load_codec(name, row_dim=5)  # values padded to 8 bytes
    x = torch.randn(10, generator=_gen(7))
    rows = codec.encode(x).view(2, 16)
    assert rows[:, 5:8].eq(0).all() and rows[:, 12:].eq(0).all()
    max_pos = {"fp8_e4m3": 0.9375, "fp8_e5m2": 0.875}[name]
    max_abs = x.view(2, 5).abs().amax(dim=1)
    scale = rows[:, 8:12].clone().view(torch.float32).view(-1)
    assert torch.equal(scale, torch.full((2,), max_pos) / (max_abs + 1e-20))
    # Each row's largest magnitude is sent as the format's largest value.
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    shift = {"fp8_e4m3": 2.0**-8, "fp8_e5m2": 2.0**-16}[name]
    values = rows[:, :5].contiguous().view(fp8).float() * shift
    assert torch.equal(values.abs().amax(dim=1), torch.full((2,), max_pos))


@pytest.mark.parametrize(
    "spec, bits",
    [
        ("fp16", 16.0),
        ("bf16", 16.0),
        ("int8", 8 + 64 / 32),
        ("int8:row_dim=5", 8 + 64 / 5),
        ("fp8_e4m3", 8 * 40 / 32),
        ("fp8_e5m2:row_dim=7", 8 * 16 / 7),
    ],
)
def test_info_declares_true_bits_and_summability(spec: str, bits: float) -> None:
    codec = qcomm.load_codec(spec)
    assert codec.info.bits_per_element == pytest.approx(bits)
    assert codec.info.summable == spec.startswith(("fp16", "bf16"))
    assert not codec.info.stochastic and not codec.info.stateful
    n = 1120 * 4  # a multiple of every row_dim above
    wire_bits = 16 if codec.quantized_dtype in (torch.float16, torch.bfloat16) else 8
    assert codec.calc_quantized_size(n) * wire_bits / n == pytest.approx(bits)


def test_default_row_dim_is_fbgemms() -> None:
    assert qcomm.load_codec("int8").row_dim == 32
    assert qcomm.load_codec("fp8_e4m3").row_dim == 32
    assert qcomm.load_codec("fp8_e5m2").row_dim == 32


# -- non-finite input ---------------------------------------------------------


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_codecs_keep_nan_and_saturate_inf(name: str, dtype: torch.dtype) -> None:
    hi = torch.finfo(dtype).max
    codec = qcomm.load_codec(name)
    x = torch.tensor([math.nan, math.inf, -math.inf, 3e38, -3.4e38, 1.0])
    y = codec.decode(codec.encode(x))
    assert math.isnan(y[0].item())
    big = torch.tensor(3e38).clamp(-hi, hi).to(dtype).item()  # fp16: hi; bf16: rounded
    assert y[1:5].tolist() == [hi, -hi, big, -hi]
    assert y[5].item() == 1.0


def _check_non_finite_rows(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    d = codec.row_dim
    rows = 6
    x = torch.randn(rows * d, generator=_gen(8))
    x[0] = math.nan  # row 0
    x[2 * d + d - 1] = math.inf  # row 2
    x[3 * d] = -math.inf  # row 3
    overflow = spec.startswith("int8") and d > 1
    if overflow:
        x[4 * d], x[4 * d + 1] = -3e38, 3e38  # row 4: max - min overflows float32
    y = codec.decode(codec.encode(x)).view(rows, d)
    bad = {0, 2, 3} | ({4} if overflow else set())
    for r in range(rows):
        if r in bad:
            assert y[r].isnan().all(), (spec, r)
        else:
            alone = codec.decode(codec.encode(x.view(rows, d)[r]))
            assert y[r].isfinite().all() and torch.equal(y[r], alone), (spec, r)


@pytest.mark.parametrize("spec", [s for s in BLOCK_SPECS if s.startswith("fp8")])
def test_fp8_turns_a_non_finite_row_into_nan(spec: str) -> None:
    _check_non_finite_rows(spec)


@pytest.mark.parametrize("spec", [s for s in BLOCK_SPECS if s.startswith("int8")])
def test_int8_turns_a_non_finite_row_into_nan(spec: str, int8_path: str) -> None:
    _check_non_finite_rows(spec)


# -- bad options, bad input, malformed wire ---------------------------------------


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_bad_row_dim_is_refused(name: str) -> None:
    cls = type(qcomm.load_codec(name))
    for bad, err in [(0, ValueError), (-4, ValueError), (2.5, TypeError), ("32", TypeError)]:
        with pytest.raises(err, match="row_dim"):
            cls(row_dim=bad)
    with pytest.raises(TypeError, match="row_dim"):
        cls(row_dim=True)
    with pytest.raises(qcomm.CodecError, match="row_dim"):
        qcomm.load_codec(f"{name}:row_dim=0")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_bad_loss_scale_is_refused(name: str) -> None:
    cls = type(qcomm.load_codec(name))
    for bad in [0.0, -1.0, math.nan, math.inf]:
        with pytest.raises(ValueError, match="loss_scale"):
            cls(loss_scale=bad)
    for bad_type in ["2", True, [1.0]]:
        with pytest.raises(TypeError, match="loss_scale"):
            cls(loss_scale=bad_type)
    with pytest.raises(qcomm.CodecError, match="loss_scale"):
        qcomm.load_codec(f"{name}:loss_scale=-2")
    assert cls(loss_scale=4).loss_scale == 4.0


@pytest.mark.parametrize("spec", SPECS)
def test_encode_refuses_non_float_input(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.arange(8))
    with pytest.raises(TypeError, match="Tensor"):
        codec.encode([1.0, 2.0])


@pytest.mark.parametrize("spec", SPECS)
def test_decode_refuses_malformed_wire(spec: str) -> None:
    codec = qcomm.load_codec(spec)
    wire = codec.encode(torch.randn(256, generator=_gen(9)))
    wrong = torch.float32 if wire.dtype != torch.float32 else torch.float16
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(wire.to(wrong))
    with pytest.raises(ValueError):
        codec.decode([0, 1])
    if spec.startswith(("int8", "fp8")):
        with pytest.raises(ValueError, match="multiple"):
            codec.decode(wire[:-1])
        with pytest.raises(ValueError, match="multiple"):
            codec.decode(wire[1:])


@pytest.mark.parametrize("spec", SPECS)
def test_calc_quantized_size_refuses_a_negative_length(spec: str) -> None:
    with pytest.raises(ValueError, match="input_len"):
        qcomm.load_codec(spec).calc_quantized_size(-1)


# -- without fbgemm -----------------------------------------------------------


def test_every_codec_works_when_fbgemm_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm_builtin import _fbgemm

    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # import now raises
    _fbgemm._load.cache_clear()
    try:
        assert _fbgemm.fbgemm_ops() is None
        for spec in ["fp16", "bf16", "int8", "int8:row_dim=5", "fp8_e4m3", "fp8_e5m2"]:
            check_codec(qcomm.load_codec(spec), lengths=[0, 1, 7, 64, 1003])
    finally:
        _fbgemm._load.cache_clear()


def test_disable_env_turns_fbgemm_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm_builtin import _fbgemm

    monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    assert _fbgemm.fbgemm_ops() is None


# -- CUDA ---------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_wire_equals_cpu_wire() -> None:
    x = torch.randn(100_003, generator=_gen(10))
    for spec in SPECS:
        codec = qcomm.load_codec(spec)
        cpu = codec.encode(x)
        gpu = codec.encode(x.cuda())
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu), spec
        back = codec.decode(gpu)
        assert back.is_cuda, spec
        bound = _declared_bound(codec.info, x)
        assert bool(((back.cpu()[: x.numel()].double() - x.double()).abs() <= bound).all()), spec
        check_codec(codec, device="cuda", lengths=[0, 1, 97, 4096])
