r"""
The built-in codecs fp16, bf16, int4, int8, fp8_e4m3, fp8_e5m2 and fp8_e4m3_tensor,
reached through their entry points: the codec contract, the conformance kit,
the declared error bounds against float64 references, the wire formats,
non-finite input, bad options and malformed wire (mx4: test_codec_mx4.py).

Bit-for-bit comparisons with fbgemm-gpu live in test_codecs_fbgemm_exact.py.
"""

from __future__ import annotations

import doctest
import importlib
import math
import sys
from typing import Any

import pytest
import torch

import qcomm
from qcomm.testing import check_codec


def _load(spec: str, **options: Any) -> Any:
    # load_codec is typed with the contract's protocol; these tests also read
    # the members a codec class adds (info, row_dim, block, decode_into, ...).
    return qcomm.load_codec(spec, **options)


SPECS = [
    "fp16",
    "fp16:loss_scale=1024",
    "fp16:loss_scale=0.125",
    "bf16",
    "bf16:loss_scale=3.5",
    "int4",
    "int4:row_dim=1",
    "int4:row_dim=5",
    "int4:row_dim=64",
    "int8",
    "int8:row_dim=1",
    "int8:row_dim=5",
    "int8:row_dim=64",
    "fp8_e4m3",
    "fp8_e4m3:row_dim=7",
    "fp8_e5m2",
    "fp8_e5m2:row_dim=128",
    "fp8_e4m3_tensor",
]
BLOCK_SPECS = [s for s in SPECS if s.startswith(("int", "fp8")) and not s.endswith("_tensor")]
MODULES = ["qcomm_builtin._fbgemm", "qcomm_builtin.int4"]
MODULES += ["qcomm_builtin.half", "qcomm_builtin.int8", "qcomm_builtin.fp8"]
MODULES += ["qcomm_builtin._native", "qcomm_builtin.fp8_tensor"]


FLOAT32_MAX = torch.finfo(torch.float32).max


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
        ("int4", "Int4Codec"),
        ("int8", "Int8Codec"),
        ("fp8_e4m3", "FP8E4M3Codec"),
        ("fp8_e5m2", "FP8E5M2Codec"),
        ("fp8_e4m3_tensor", "FP8E4M3TensorCodec"),
    ],
)
def test_entry_point_loads_the_class(name: str, cls: str) -> None:
    codec = _load(name)
    assert type(codec).__name__ == cls
    assert codec.info.name == name
    assert isinstance(codec, qcomm.QuantizedCommCodec)


@pytest.mark.parametrize("spec", SPECS)
def test_passes_conformance_kit(spec: str) -> None:
    report = check_codec(_load(spec))
    assert report.worst_error <= 1.0
    assert "round_trip" in report.rules and "padded_size" in report.rules


@pytest.mark.parametrize("spec", [s for s in SPECS if s.startswith("int8")])
def test_int8_torch_fallback_passes_conformance_kit(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    assert check_codec(_load(spec)).worst_error <= 1.0


def test_docstring_examples_run() -> None:
    for name in MODULES:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
        assert result.attempted > 0, name


# -- the declared bound, against float64 --------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_within_declared_bound(spec: str) -> None:
    codec = _load(spec)
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


@pytest.mark.parametrize(
    "spec", ["fp16", "bf16", "int4", "int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_tensor"]
)
def test_declared_bound_is_not_loose(spec: str) -> None:
    # The relative part must be reached to within a factor of 2 on normal data:
    # a bound declared far too wide would make the round-trip tests vacuous.
    codec = _load(spec)
    x = torch.randn(1 << 16, generator=_gen(2)).clamp(
        -codec.info.max_abs_input, codec.info.max_abs_input
    )
    err = (codec.decode(codec.encode(x))[: x.numel()].double() - x.double()).abs()
    ratio = (err / _declared_bound(codec.info, x)).max().item()
    assert 0.5 < ratio <= 1.0


# -- sizes, padding, context ----------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_calc_quantized_size_matches_encode(spec: str) -> None:
    codec = _load(spec)
    for n in [0, 1, 2, 3, 31, 97, 1009, 65537, 1_000_003]:
        x = torch.randn(n, generator=_gen(n))
        for ctx in (None, codec.create_context()):
            wire = codec.encode(x, ctx)
            assert wire.dim() == 1 and wire.dtype == codec.quantized_dtype
            assert codec.calc_quantized_size(n, ctx) == wire.numel(), (spec, n)


@pytest.mark.parametrize("spec", BLOCK_SPECS)
def test_sizes_add_up_for_aligned_lengths_and_split_wire_decodes(spec: str) -> None:
    codec = _load(spec)
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
    codec = _load(spec)
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
    codec = _load(spec)
    with pytest.raises(ValueError, match="dim_per_rank"):
        codec.padded_size(torch.zeros(2, 5), [4, 4], 0, codec.create_context())
    with pytest.raises(ValueError, match="my_rank"):
        codec.padded_size(torch.zeros(2, 4), [4, 4], 2, codec.create_context())


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3_tensor"])
def test_casts_need_no_context_nor_padding(name: str) -> None:
    codec = _load(name)
    assert codec.create_context() is None
    assert codec.padded_size(torch.zeros(3, 7), [7, 9], 0, None) == (7, 0)


@pytest.mark.parametrize(
    "spec", ["int4:row_dim=5", "int8", "int8:row_dim=5", "fp8_e4m3", "fp8_e5m2:row_dim=7"]
)
def test_rows_not_whole_blocks_are_padded_row_by_row(spec: str) -> None:
    # As fbgemm pads MX4 rows: no block straddles two rows, so TorchRec may
    # cut the wire between any two rows. int4 and int8 pad with the row's
    # last element (keeping its minimum and maximum), fp8 with zeros.
    codec = _load(spec)
    d = codec.row_dim
    x = torch.randn(9, 2 * d + 3, generator=_gen(5))
    width = 3 * d
    fill = x[:, -1:].expand(9, width - x.shape[1]) if spec.startswith("int") else 0.0
    padded = torch.cat([x, torch.zeros(9, width - x.shape[1]) + fill], dim=1)
    wire = codec.encode(x)
    assert torch.equal(wire, codec.encode(padded.reshape(-1)))
    assert torch.equal(codec.encode(x.view(3, 3, -1)), wire)
    # Without a context decode returns the padded rows, with the context of
    # the encode the rows themselves; sizes count whole rows.
    assert torch.equal(codec.decode(wire), codec.decode(codec.encode(padded.reshape(-1))))
    ctx = codec.create_context()
    assert torch.equal(codec.encode(x, ctx), wire)
    y = codec.decode(wire, ctx)
    assert torch.equal(y, codec.decode(wire).view(9, width)[:, : x.shape[1]].reshape(-1))
    sizes = [codec.calc_quantized_size(r * x.shape[1], ctx) for r in (2, 0, 7)]
    assert sizes == [r * wire.numel() // 9 for r in (2, 0, 7)]
    parts = wire.split(sizes)
    assert torch.equal(torch.cat([codec.decode(p, ctx) for p in parts]), y)
    out = torch.empty(9, x.shape[1])
    codec.decode_into(wire, out, ctx)
    assert torch.equal(out.view(-1), y)


@pytest.mark.parametrize("spec", ["int4", "int8", "fp8_e4m3", "mx4:group_size=8"])
def test_a_cut_inside_a_block_or_row_is_refused_before_sending(spec: str) -> None:
    # TorchRec encodes once and cuts the wire by calc_quantized_size of each
    # destination's share; a share that is not whole blocks (whole rows)
    # would send one block to two ranks.
    codec = _load(spec)
    b = codec.info.error_block
    flat = codec.create_context()
    codec.encode(torch.randn(5 * b + 3), flat)
    assert codec.calc_quantized_size(2 * b, flat) == 2 * codec.calc_quantized_size(b)
    assert codec.calc_quantized_size(5 * b + 3, flat) == codec.calc_quantized_size(5 * b + 3)
    with pytest.raises(
        qcomm.CodecError, match=f"{codec.info.name}.*calc_quantized_size\\({b + 1}\\)"
    ):
        codec.calc_quantized_size(b + 1, flat)
    rows = codec.create_context()
    codec.encode(torch.randn(4, b + 1), rows)
    assert codec.calc_quantized_size(3 * (b + 1), rows) == 3 * codec.calc_quantized_size(2 * b)
    with pytest.raises(qcomm.CodecError, match="inside a row"):
        codec.calc_quantized_size(b, rows)
    # Before any encode (qcomm's collectives size their receives first), or
    # without a context, any length is counted in blocks.
    assert codec.calc_quantized_size(b + 1, codec.create_context()) == 2 * codec.wire_per_block
    assert codec.calc_quantized_size(b + 1) == 2 * codec.wire_per_block


def test_input_of_any_shape_layout_and_float_dtype_is_read_flat() -> None:
    base = torch.randn(64, 64, generator=_gen(3))
    for spec in ["fp16", "bf16", "int4", "int8", "fp8_e4m3", "fp8_e4m3_tensor"]:
        codec = _load(spec)
        flat = codec.encode(base.reshape(-1))
        # Element-wise casts keep the input's shape (TorchRec's reduce-scatter
        # reads it); block codecs return a flat wire, reading rows of whole
        # blocks as one flat input.
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
        wire = _load(name, loss_scale=8.0).encode(x)
        assert torch.equal(wire.view(torch.int16), ref.view(torch.int16))
        back = _load(name, loss_scale=8.0).decode(wire)
        assert torch.equal(back, ref.float() / 8.0)


def test_half_codecs_are_summable() -> None:
    a, b = torch.randn(1000, generator=_gen(5)), torch.randn(1000, generator=_gen(6))
    for name in ["fp16", "bf16"]:
        codec = _load(name)
        assert codec.info.summable
        total = codec.decode(codec.encode(a) + codec.encode(b))
        bound = 3 * (_declared_bound(codec.info, a) + _declared_bound(codec.info, b))
        assert bool(((total.double() - (a + b).double()).abs() <= bound).all())


def test_int8_wire_layout() -> None:
    codec = _load("int8:row_dim=4")
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


def test_int4_wire_layout() -> None:
    # Per row: codes two per byte (element 2i in the low nibble), then the
    # float16 scale and bias; the bias rounds down and the scale up, so no
    # code saturates.
    codec = _load("int4:row_dim=5")
    x = torch.tensor([0.0, 1.0, 7.5, 15.0, 3.0, 0.1, 0.1, 0.1, 0.1, 0.2])
    rows = codec.encode(x).view(2, 7)
    assert rows[0, :3].tolist() == [0 | 1 << 4, 8 | 15 << 4, 3]
    meta = rows[:, 3:].clone().view(torch.float16).float()
    assert meta[0].tolist() == [1.0, 0.0]
    scale, bias = meta[1].tolist()
    assert bias <= 0.1 < bias + 2**-13 and scale * 15 >= 0.2 - bias
    assert scale < torch.tensor((0.2 - bias) / 15).half().float().item() * (1 + 2**-9)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_wire_layout(name: str) -> None:
    codec = _load(name, row_dim=5)  # values padded to 8 bytes
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
        ("int4", 4 + 32 / 32),
        ("int4:row_dim=5", 8 * 7 / 5),
        ("int8", 8 + 64 / 32),
        ("int8:row_dim=5", 8 + 64 / 5),
        ("fp8_e4m3", 8 * 40 / 32),
        ("fp8_e5m2:row_dim=7", 8 * 16 / 7),
        ("fp8_e4m3_tensor", 8.0),
    ],
)
def test_info_declares_true_bits_and_summability(spec: str, bits: float) -> None:
    codec = _load(spec)
    assert codec.info.bits_per_element == pytest.approx(bits)
    assert codec.info.summable == spec.startswith(("fp16", "bf16"))
    assert not codec.info.stochastic and not codec.info.stateful
    n = 1120 * 4  # a multiple of every row_dim above
    wire_bits = 16 if codec.quantized_dtype in (torch.float16, torch.bfloat16) else 8
    assert codec.calc_quantized_size(n) * wire_bits / n == pytest.approx(bits)


def test_default_row_dim_is_fbgemms() -> None:
    assert _load("int4").row_dim == 32
    assert _load("int8").row_dim == 32
    assert _load("fp8_e4m3").row_dim == 32
    assert _load("fp8_e5m2").row_dim == 32


def test_fp8_tensor_is_an_unscaled_clamped_cast() -> None:
    # TorchRec's default FP8: fbgemm's 1-4-3 format with exponent bias 15,
    # no scale, values clamped to its largest, 0.9375; one byte per element,
    # in the input's shape (TorchRec's reduce-scatter backward all-gathers it
    # into a buffer of the gradient's shape).
    codec = _load("fp8_e4m3_tensor")
    info = codec.info
    assert (info.bits_per_element, info.summable, info.error_block) == (8.0, False, 1)
    assert (info.rel_error_bound, info.abs_error_bound, info.max_abs_input) == (
        2.0**-4,
        2.0**-18,
        0.9375,
    )
    x = torch.tensor([[0.5, -0.25, 0.9375, 2.0**-17], [1.0, -7.0, math.inf, -math.inf]])
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 and wire.shape == x.shape
    y = codec.decode(wire)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert y.tolist() == [[0.5, -0.25, 0.9375, 2.0**-17], [0.9375, -0.9375, 0.9375, -0.9375]]
    # NaN stays NaN (fbgemm's kernel would send 0.9375); -0.0 keeps its sign.
    z = codec.decode(codec.encode(torch.tensor([math.nan, -0.0, -(2.0**-19)])))
    assert z[0].isnan() and str(z[1].item()) == "-0.0" and str(z[2].item()) == "-0.0"
    out = torch.empty(4, 2).t()
    codec.decode_into(wire, out)
    assert torch.equal(out.reshape(-1), y.reshape(-1))


def test_fp8_tensor_may_be_the_reduce_scatter_backward(torchrecs_transport: None) -> None:
    # It keeps the element count, as TorchRec's all-gather needs, but its
    # bytes cannot be summed (where TorchRec's transport is chosen).
    op = "pooled_embeddings_reduce_scatter"
    pair = qcomm.build_registry({op: "fp16/fp8_e4m3_tensor"})[op.upper()]
    assert pair.backward.info.name == "fp8_e4m3_tensor"
    with pytest.raises(qcomm.CodecError, match="summable"):
        qcomm.build_registry({op: "fp8_e4m3_tensor/fp16"})


# -- non-finite input ---------------------------------------------------------


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_codecs_keep_nan_and_saturate_inf(name: str, dtype: torch.dtype) -> None:
    hi = torch.finfo(dtype).max
    codec = _load(name)
    x = torch.tensor([math.nan, math.inf, -math.inf, 3e38, -3.4e38, 1.0])
    y = codec.decode(codec.encode(x))
    assert math.isnan(y[0].item())
    big = torch.tensor(3e38).clamp(-hi, hi).to(dtype).item()  # fp16: hi; bf16: rounded
    assert y[1:5].tolist() == [hi, -hi, big, -hi]
    assert y[5].item() == 1.0


def _check_non_finite_rows(spec: str) -> None:
    codec = _load(spec)
    d = codec.row_dim
    rows = 6
    x = torch.randn(rows * d, generator=_gen(8))
    x[0] = math.nan  # row 0
    x[2 * d + d - 1] = math.inf  # row 2
    x[3 * d] = -math.inf  # row 3
    overflow = spec.startswith("int4") or (spec.startswith("int8") and d > 1)
    if spec.startswith("int4"):
        x[4 * d] = -1e5  # row 4: its bias is beyond float16
    elif overflow:
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


@pytest.mark.parametrize("spec", [s for s in BLOCK_SPECS if s.startswith("int4")])
def test_int4_turns_a_non_finite_or_too_wide_row_into_nan(spec: str) -> None:
    _check_non_finite_rows(spec)


# -- bad options, bad input, malformed wire ---------------------------------------


@pytest.mark.parametrize("name", ["int4", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_bad_row_dim_is_refused(name: str) -> None:
    cls = type(_load(name))
    for bad, err in [(0, ValueError), (-4, ValueError), (2.5, TypeError), ("32", TypeError)]:
        with pytest.raises(err, match="row_dim"):
            cls(row_dim=bad)
    with pytest.raises(TypeError, match="row_dim"):
        cls(row_dim=True)
    with pytest.raises(qcomm.CodecError, match="row_dim"):
        _load(f"{name}:row_dim=0")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_bad_loss_scale_is_refused(name: str) -> None:
    cls = type(_load(name))
    for bad in [0.0, -1.0, math.nan, math.inf]:
        with pytest.raises(ValueError, match="loss_scale"):
            cls(loss_scale=bad)
    for bad_type in ["2", True, [1.0]]:
        with pytest.raises(TypeError, match="loss_scale"):
            cls(loss_scale=bad_type)
    with pytest.raises(qcomm.CodecError, match="loss_scale"):
        _load(f"{name}:loss_scale=-2")
    assert cls(loss_scale=4).loss_scale == 4.0


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "bad",
    [1e39, 3.5e38, 1e-320, 1e-40, 2.0**-127, 10**400],
    ids=["1e39", "3.5e38", "1e-320", "1e-40", "2**-127", "10**400"],
)
def test_loss_scale_outside_float32_is_refused(name: str, bad: float) -> None:
    # The scale is applied in float32: beyond its largest value it becomes
    # inf (1.0 came back as 0.0, 0.0 as NaN), below its smallest normal value
    # it becomes 0 or loses precision.
    with pytest.raises(ValueError, match="loss_scale.*float32"):
        type(_load(name))(loss_scale=bad)
    with pytest.raises(qcomm.CodecError, match="loss_scale"):
        _load(f"{name}:loss_scale={bad!r}")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [2.0**-126, FLOAT32_MAX])
def test_extreme_loss_scales_keep_their_declared_bound(name: str, scale: float) -> None:
    codec = _load(name, loss_scale=scale)
    x = torch.tensor([0.0, -0.0, 1.0, -3.0, 1e-30, 2.0**-149, 1e30, FLOAT32_MAX])
    y = codec.decode(codec.encode(x))
    assert not bool(y.isnan().any())
    inside = x.abs() <= codec.info.max_abs_input
    err = (y.double() - x.double()).abs()[inside]
    assert bool((err <= _declared_bound(codec.info, x)[inside]).all())


@pytest.mark.parametrize("name", ["int4", "int8", "fp8_e4m3", "fp8_e5m2", "mx4"])
def test_block_size_beyond_the_limit_is_refused(name: str) -> None:
    # A partial block is padded to a whole one: a block of 2**32 made a
    # one-element tensor cost 16 GiB.
    option = "group_size" if name == "mx4" else "row_dim"
    cls = type(_load(name))
    assert getattr(cls(**{option: 1 << 16}), option) == 1 << 16
    for bad in [(1 << 16) + 2, 1 << 32]:
        with pytest.raises(ValueError, match=f"{option}.*65536"):
            cls(**{option: bad})
    with pytest.raises(qcomm.CodecError, match=option):
        _load(f"{name}:{option}=4294967296")


@pytest.mark.parametrize("spec", SPECS)
def test_encode_refuses_non_float_input(spec: str) -> None:
    codec = _load(spec)
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.arange(8))
    with pytest.raises(TypeError, match="Tensor"):
        codec.encode([1.0, 2.0])


@pytest.mark.parametrize("spec", SPECS)
def test_decode_refuses_malformed_wire(spec: str) -> None:
    codec = _load(spec)
    wire = codec.encode(torch.randn(256, generator=_gen(9)))
    wrong = torch.float32 if wire.dtype != torch.float32 else torch.float16
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(wire.to(wrong))
    with pytest.raises(ValueError):
        codec.decode([0, 1])
    if codec.info.error_block > 1:
        with pytest.raises(ValueError, match="multiple"):
            codec.decode(wire[:-1])
        with pytest.raises(ValueError, match="multiple"):
            codec.decode(wire[1:])


@pytest.mark.parametrize("spec", SPECS)
def test_calc_quantized_size_refuses_a_negative_length(spec: str) -> None:
    with pytest.raises(ValueError, match="input_len"):
        _load(spec).calc_quantized_size(-1)


# -- without fbgemm -----------------------------------------------------------


def test_every_codec_works_when_fbgemm_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm_builtin import _fbgemm

    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # import now raises
    _fbgemm._load.cache_clear()
    try:
        assert _fbgemm.fbgemm_ops() is None
        for spec in [
            "fp16",
            "bf16",
            "int4",
            "int8",
            "int8:row_dim=5",
            "fp8_e4m3",
            "fp8_e5m2",
            "fp8_e4m3_tensor",
        ]:
            check_codec(_load(spec), lengths=[0, 1, 7, 64, 1003])
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
        codec = _load(spec)
        cpu = codec.encode(x)
        gpu = codec.encode(x.cuda())
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu), spec
        back = codec.decode(gpu)
        assert back.is_cuda, spec
        bound = _declared_bound(codec.info, x)
        assert bool(((back.cpu()[: x.numel()].double() - x.double()).abs() <= bound).all()), spec
        check_codec(codec, device="cuda", lengths=[0, 1, 97, 4096])
