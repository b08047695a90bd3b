"""The ``mx4`` codec: fbgemm's MX4 bytes bit for bit, its declared error bound,
non-finite input, sizes, padding and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from qcomm_builtin import mx4
from qcomm_builtin.mx4 import ROUNDING_MODES, MX4Codec

import qcomm
from qcomm.testing import check_codec

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FLOAT32_MAX = torch.finfo(torch.float32).max
# Above this, fbgemm's exponent pre-rounding (even, stochastic) may carry into
# NaN bits and zero the group, where the codec saturates it instead.
ROUNDING_CARRY = 2.5e38


@pytest.fixture(autouse=True)
def _seeded() -> None:
    # Test data drawn from torch's global generator is the same on every run.
    torch.manual_seed(0)


def _fbgemm():
    return pytest.importorskip("fbgemm_gpu.quantize_utils")


def _fbgemm_encode(x: torch.Tensor, group_size: int, rounding: str, seed: int = 0) -> torch.Tensor:
    # fbgemm's CPU path of fp32_to_mx4 is its pure-Python reference; its
    # stochastic mode draws from torch's global generator, as the codec does.
    torch.manual_seed(seed)
    mode = ROUNDING_MODES.index(rounding)
    return _fbgemm().fp32_to_mx4(x, group_size, rounding_mode=mode).view(-1)


def _encode(codec: MX4Codec, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return codec.encode(x)


def _group_max(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Largest magnitude of each element's group, in float64 (zero padded)."""
    n = x.numel()
    groups = -(-n // group_size)
    padded = torch.nn.functional.pad(x.double().abs(), (0, groups * group_size - n))
    return padded.view(groups, group_size).amax(dim=1).repeat_interleave(group_size)[:n]


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(exponents.shape, dtype=torch.float64), exponents).float()


def _datasets(group_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    sets = {"normal": torch.randn(8192, generator=gen)}
    spread = torch.empty(8192, dtype=torch.float64).uniform_(-44, 38, generator=gen)
    wide = torch.randn(8192, generator=gen, dtype=torch.float64) * 10.0**spread
    sets["wide (1e-44..1e38)"] = wide.clamp(-ROUNDING_CARRY, ROUNDING_CARRY).float()
    # One group per power of two from subnormals to the top of float32.
    exps = torch.arange(-149, 128).repeat_interleave(group_size)
    sets["every exponent"] = (_pow2(exps) * (0.5 + torch.rand(exps.numel(), generator=gen))).clamp(
        max=ROUNDING_CARRY
    )
    # Element ties of E2M1, and one ulp either side: a group maximum of 4 * 2**k
    # gives E = k in every rounding mode, so elements t * 2**k scale to t.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 4.0])
    scales = _pow2(torch.arange(-129, 126, 2))[:, None]
    picks = ties[torch.randint(len(ties), (scales.numel(), group_size), generator=gen)] * scales
    nudge = torch.randint(-1, 2, picks.shape, dtype=torch.int32, generator=gen)
    picks = (picks.view(torch.int32) + nudge).view(torch.float32)
    picks[:, 0] = 4 * scales[:, 0]
    signs = torch.randint(0, 2, picks.shape, generator=gen) * 2 - 1
    sets["element ties"] = (picks * signs).reshape(-1)
    # Group maxima at ties of the exponent rounding and of saturation (5 -> 6,
    # 7 -> 8 saturating), with smaller elements.
    tops = torch.tensor([5.0, 7.0, 7.99, 6.0, 2.5, 1.75 * 4, 2**0.5 * 4, 2**0.5 * 2])
    top_groups = (tops[:, None] * _pow2(torch.arange(-131, 126, 3))[None, :]).reshape(-1, 1)
    rest = torch.rand(top_groups.shape[0], group_size - 1, generator=gen) * top_groups
    sets["maximum ties"] = torch.cat([top_groups, -rest], dim=1).reshape(-1)
    # Group maxima a few ulps around each power of two and around 1.75 * 2**k,
    # where float32 log2 and the exponent pre-rounding turn over.
    marks = torch.cat([_pow2(torch.arange(-126, 128)), 1.75 * _pow2(torch.arange(-126, 127))])
    near = torch.cat([marks.view(torch.int32) + d for d in range(-6, 7)]).view(torch.float32)
    near = near[torch.isfinite(near) & (near < ROUNDING_CARRY)]
    near_groups = torch.rand(near.numel(), group_size, generator=gen) * near[:, None]
    near_groups[:, 0] = near
    sets["near turning points"] = near_groups.reshape(-1)
    # Arbitrary finite bit patterns: NaN-free, any sign, subnormals included.
    bits = torch.randint(-(2**31), 2**31 - 1, (16384,), dtype=torch.int32, generator=gen)
    floats = bits.view(torch.float32)
    sets["random bits"] = floats[torch.isfinite(floats) & (floats.abs() < ROUNDING_CARRY)]
    sets["tiny (subnormal)"] = torch.randn(4096, generator=gen) * 1e-40
    sets["huge (1e38)"] = torch.randn(4096, generator=gen).clamp(-1.5, 1.5) * 1e38
    sets["zeros"] = torch.zeros(256)
    sets["negative zeros"] = -torch.zeros(256)
    sets["constant"] = torch.full((256,), 0.1)
    sets["negative"] = -torch.rand(4096, generator=gen) * 100
    return sets


# -- loading and declared info ------------------------------------------------


def test_loads_through_its_entry_point() -> None:
    codec = qcomm.load_codec("mx4")
    assert isinstance(codec, MX4Codec)
    assert (codec.group_size, codec.rounding) == (32, "even")
    assert codec.quantized_dtype == torch.uint8
    assert isinstance(type(codec).__dict__["quantized_dtype"], property)
    other = qcomm.load_codec("mx4:group_size=64,rounding=ceil")
    assert isinstance(other, MX4Codec)
    assert (other.group_size, other.rounding) == (64, "ceil")


@pytest.mark.parametrize("rounding", ROUNDING_MODES)
def test_info(rounding: str) -> None:
    info = MX4Codec(group_size=16, rounding=rounding).info
    assert info.name == "mx4"
    assert info.bits_per_element == 4.5
    assert not info.summable
    assert info.stochastic == (rounding == "stochastic")
    assert info.error_block == 16
    assert info.abs_error_bound == 2.0**-129
    tight = rounding in ("even", "nearest", "ceil")
    assert info.rel_error_bound == (0.2 if tight else 0.25)
    assert info.max_abs_input == (2.0**127 if tight else math.inf)


def test_fbgemm_rounding_mode_values_are_accepted() -> None:
    # fbgemm's RoundingMode is an IntEnum: nearest=0 floor=1 even=2 stochastic=3 ceil=4.
    for value, name in enumerate(ROUNDING_MODES):
        assert MX4Codec(rounding=value).rounding == name  # type: ignore[arg-type]
    assert MX4Codec(rounding=" CEIL ").rounding == "ceil"


@pytest.mark.parametrize(
    ("rounding", "group_size"),
    [("even", 32), ("nearest", 6), ("floor", 64), ("ceil", 2), ("stochastic", 16)],
)
def test_conformance_kit(rounding: str, group_size: int) -> None:
    report = check_codec(MX4Codec(group_size=group_size, rounding=rounding))
    assert "round_trip" in report.rules and "padded_size" in report.rules
    assert report.worst_error <= 1.0


# -- bit for bit against fbgemm -------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 2, 6, 64])
@pytest.mark.parametrize("rounding", ROUNDING_MODES)
def test_wire_bytes_equal_fbgemm(rounding: str, group_size: int) -> None:
    codec = MX4Codec(group_size=group_size, rounding=rounding)
    for name, x in _datasets(group_size).items():
        # Also lengths that are not whole groups: fbgemm zero-pads them too.
        for n in {x.numel(), x.numel() - 1}:
            piece = x[:n].contiguous()
            ours = _encode(codec, piece, seed=n)
            theirs = _fbgemm_encode(piece, group_size, rounding, seed=n)
            assert ours.dtype == theirs.dtype == torch.uint8
            if not torch.equal(ours, theirs):
                diff = (ours != theirs).nonzero()[:4].view(-1).tolist()
                pytest.fail(f"{name}, {n} elements: bytes {diff} differ from fbgemm's")


def test_wire_bytes_equal_fbgemm_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The element loop works in steps; a small step exercises many of them
    # and a ragged last one.
    monkeypatch.setattr(mx4, "_CHUNK_ELEMENTS", 96)
    x = torch.randn(32 * 37 + 5) * 3
    for group_size in (32, 6):
        codec = MX4Codec(group_size=group_size)
        assert torch.equal(codec.encode(x), _fbgemm_encode(x, group_size, "even"))
        wire = codec.encode(x)
        assert torch.equal(codec.decode(wire), _fbgemm().mx4_to_fp32(wire, group_size))


def test_torch_code_equals_fbgemm_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same, on the torch code that runs where the C kernels do not.
    monkeypatch.setenv("QCOMM_DISABLE_KERNELS", "1")
    test_wire_bytes_equal_fbgemm_across_chunks(monkeypatch)


def test_large_input_equals_its_pieces() -> None:
    # 12 MiB in and out: several loop steps, and buffers large enough to be
    # asked for huge pages; pieces of whole groups encode and decode alone.
    codec = MX4Codec(group_size=32)
    x = torch.randn(3 * (1 << 20) + 32 * 5, generator=torch.Generator().manual_seed(3)) * 100
    wire = codec.encode(x)
    pieces = x.split(1 << 19)
    assert torch.equal(wire, torch.cat([codec.encode(p) for p in pieces]))
    sizes = [codec.calc_quantized_size(p.numel()) for p in pieces]
    decoded = torch.cat([codec.decode(part) for part in wire.split(sizes)])
    assert torch.equal(codec.decode(wire), decoded)


@pytest.mark.parametrize("group_size", [32, 2, 6])
def test_decode_equals_fbgemm_on_any_wire(group_size: int) -> None:
    # Every element byte and every exponent byte fbgemm understands (0..254;
    # it writes only 0..252), compared bit for bit, -0.0 and subnormals included.
    gen = torch.Generator().manual_seed(7)
    groups = 4096
    wire = torch.randint(0, 256, (groups, group_size // 2 + 1), dtype=torch.uint8, generator=gen)
    wire[:, -1] = torch.arange(groups) % 255
    wire = wire.view(-1)
    ours = MX4Codec(group_size=group_size).decode(wire)
    theirs = _fbgemm().mx4_to_fp32(wire, group_size)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_fbgemm_codec_reads_our_wire_and_we_read_its_wire() -> None:
    quantize_comm = pytest.importorskip("fbgemm_gpu.quantize_comm")
    sparse_type = pytest.importorskip("fbgemm_gpu.split_embedding_configs").SparseType
    theirs = quantize_comm.QuantizedCommCodec(sparse_type.MX4)
    ours = MX4Codec()
    x = torch.randn(32 * 100) * 7
    ctx = theirs.create_context()
    assert torch.equal(ours.encode(x), theirs.encode(x, ctx))
    assert torch.equal(theirs.decode(ours.encode(x), ctx), ours.decode(theirs.encode(x, ctx)))
    for n in (0, 32, 3200):
        assert ours.calc_quantized_size(n) == theirs.calc_quantized_size(n, ctx)


def test_stochastic_depends_on_the_generator_only() -> None:
    codec = MX4Codec(rounding="stochastic")
    x = torch.rand(32 * 256) * 1.9 + 0.05  # many maxima in (1.5, 2): both outcomes likely
    assert torch.equal(_encode(codec, x, seed=1), _encode(codec, x, seed=1))
    assert not torch.equal(_encode(codec, x, seed=1), _encode(codec, x, seed=2))


def test_known_bytes() -> None:
    # Hand-worked: max 6 -> E = 0; codes 1.0 -> 2, -0.5 -> 9, 6 -> 7, 0 -> 0;
    # element 2i in the low nibble, then E + 127. Second group: max 2.5 -> E = -1,
    # 2.5 / 0.5 = 5 is a tie and rounds away to 6 (code 7), 0.1 / 0.5 -> 0.
    wire = MX4Codec(group_size=4).encode(torch.tensor([1.0, -0.5, 6.0, 0.0, 2.5, 0.1]))
    assert wire.tolist() == [2 | 9 << 4, 7, 127, 7, 0, 126]


# -- error bound ------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDING_MODES)
def test_round_trip_within_declared_bound(rounding: str) -> None:
    group_size = 32
    codec = MX4Codec(group_size=group_size, rounding=rounding)
    info = codec.info
    worst = 0.0
    for name, x in _datasets(group_size).items():
        y = codec.decode(codec.encode(x))[: x.numel()].double()
        err = (y - x.double()).abs()
        bound = info.rel_error_bound * _group_max(x, group_size) + info.abs_error_bound
        covered = x.abs() <= info.max_abs_input
        bad = covered & ~(err <= bound)
        assert not bool(bad.any()), f"{name}: element {int(bad.nonzero()[0])} beyond the bound"
        # Above max_abs_input elements may saturate, but never beyond 0.25.
        loose = 0.25 * _group_max(x, group_size) + info.abs_error_bound
        assert bool((err <= loose).all()), name
        worst = max(worst, float((err[covered] / bound[covered]).max()))
    # The bound is not loose: the tie cases reach it (the stochastic exponent
    # rounds these maxima up, away from the worst case, most of the time).
    assert worst > (0.99 if rounding != "stochastic" else 0.5)


def test_bound_is_reached_where_the_derivation_says() -> None:
    # even: max 5 -> E = 0 and 5 rounds away to 6: error 1 = 0.2 * 5.
    y = MX4Codec(group_size=2).decode(MX4Codec(group_size=2).encode(torch.tensor([5.0, 0.0])))
    assert y.tolist() == [6.0, 0.0]
    # floor: max 7.9 -> E = 0 and 7.9 saturates to 6: error 1.9 <= 0.25 * 7.9.
    codec = MX4Codec(group_size=2, rounding="floor")
    assert codec.decode(codec.encode(torch.tensor([7.9, -7.9]))).tolist() == [6.0, -6.0]


def test_huge_groups_saturate_instead_of_vanishing() -> None:
    # fbgemm's two-bit pre-rounding of a maximum above ~2.98e38 carries into
    # NaN and it writes the group as zeros; here the group saturates.
    for rounding in ROUNDING_MODES:
        codec = MX4Codec(group_size=4, rounding=rounding)
        x = torch.tensor([FLOAT32_MAX, -3.0e38, 1.0e38, 0.0])
        y = codec.decode(codec.encode(x)).double()
        assert bool(((y - x.double()).abs() <= 0.25 * FLOAT32_MAX).all()), rounding
        assert y[0] > 2.5e38 and y[1] < -2.5e38


def test_tiny_groups_flush_below_the_absolute_bound() -> None:
    codec = MX4Codec(group_size=4)
    x = torch.tensor([1e-45, -3e-39, 2.0**-129, 2.0**-130])
    wire = codec.encode(x)
    assert wire[-1] == 0  # exponent clamped at -127
    y = codec.decode(wire).double()
    assert bool(((y - x.double()).abs() <= codec.info.abs_error_bound).all())


# -- non-finite input ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_group_decodes_to_nan_and_spares_the_others(bad: float) -> None:
    group_size = 8
    codec = MX4Codec(group_size=group_size)
    x = torch.randn(5 * group_size)
    clean = codec.encode(x)
    x[2 * group_size + 3] = bad
    wire = codec.encode(x).view(5, -1)
    assert wire[2].tolist() == [0] * (group_size // 2) + [255]
    others = [0, 1, 3, 4]
    assert torch.equal(wire[others], clean.view(5, -1)[others])
    y = codec.decode(wire.view(-1)).view(5, group_size)
    assert bool(y[2].isnan().all())
    assert bool(y[others].isfinite().all())
    # fbgemm writes such a group as zeros (it decodes to zeros); all the other
    # bytes agree with it.
    theirs = _fbgemm_encode(x, group_size, "even").view(5, -1)
    assert theirs[2].tolist() == [0] * (group_size // 2 + 1)
    assert torch.equal(wire[others], theirs[others])


def test_nan_exponent_byte_decodes_to_nan_whatever_the_elements() -> None:
    wire = torch.tensor([0x71, 0x00, 255], dtype=torch.uint8)
    assert bool(MX4Codec(group_size=4).decode(wire).isnan().all())


# -- sizes, shapes, contexts ------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 2, 6])
def test_calc_quantized_size_equals_encoded_size(group_size: int) -> None:
    codec = MX4Codec(group_size=group_size)
    for n in [0, 1, 2, 3, 5, 7, 11, 31, 32, 33, 63, 64, 65, 97, 1009, 100003, (1 << 20) + 7]:
        x = torch.randn(n)
        wire = codec.encode(x)
        assert wire.dim() == 1 and wire.dtype == torch.uint8
        assert wire.numel() == codec.calc_quantized_size(n) == codec.calc_quantized_size(n, None)
        assert codec.calc_quantized_size(n, codec.create_context()) == wire.numel()
        y = codec.decode(wire)
        assert y.dtype == torch.float32 and y.numel() == -(-n // group_size) * group_size


def test_sizes_add_up_and_pieces_decode_alone() -> None:
    codec = MX4Codec(group_size=32)
    pieces = [torch.randn(32 * k) for k in (3, 1, 7, 0, 2)]
    whole = torch.cat(pieces)
    sizes = [codec.calc_quantized_size(p.numel()) for p in pieces]
    assert sum(sizes) == codec.calc_quantized_size(whole.numel())
    wire = codec.encode(whole)
    for piece, part in zip(pieces, wire.split(sizes)):
        assert torch.equal(part, codec.encode(piece))
        assert torch.equal(codec.decode(part), codec.decode(codec.encode(piece)))


@pytest.mark.parametrize("shape", [(6, 33), (5, 7), (3, 2, 48), (4, 1), (1, 100), (0, 5)])
@pytest.mark.parametrize("rounding", ["even", "floor"])
def test_rows_not_whole_groups_are_padded_row_by_row_like_fbgemm(
    shape: tuple[int, ...], rounding: str
) -> None:
    # fbgemm pads the last dimension of an N-D input to whole groups, row by
    # row: the wire and the decoded layout (padding inside every row) are its.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 5
    codec = MX4Codec(group_size=32, rounding=rounding)
    wire = codec.encode(x)
    assert torch.equal(wire, _fbgemm_encode(x, 32, rounding))
    theirs = _fbgemm().mx4_to_fp32(wire, 32)
    assert torch.equal(codec.decode(wire).view(torch.int32), theirs.reshape(-1).view(torch.int32))
    assert torch.equal(codec.encode(x.transpose(0, -1).contiguous().transpose(0, -1)), wire)


def test_input_of_any_float_dtype_and_shape_is_read_flat_and_left_alone() -> None:
    codec = MX4Codec()
    x = torch.randn(6, 32)
    before = x.clone()
    assert torch.equal(codec.encode(x), codec.encode(x.reshape(-1)))
    assert torch.equal(codec.encode(x.t().t()), codec.encode(x.reshape(-1)))
    assert torch.equal(x, before)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert torch.equal(codec.encode(x.to(dtype)), codec.encode(x.to(dtype).float()))
    wire = codec.encode(x)
    wire_before = wire.clone()
    codec.decode(wire)
    assert torch.equal(wire, wire_before)
    assert codec.encode(torch.empty(0)).numel() == 0
    assert codec.decode(torch.empty(0, dtype=torch.uint8)).numel() == 0


def test_context_of_a_flat_input_changes_nothing() -> None:
    codec = MX4Codec()
    ctx = codec.create_context()
    assert ctx.padded_dim_sum_per_rank is None
    x = torch.randn(96)
    assert torch.equal(codec.encode(x, ctx), codec.encode(x, None))
    assert torch.equal(codec.decode(codec.encode(x), ctx), codec.decode(codec.encode(x)))
    assert codec.create_context() is not ctx


def test_padded_size_like_torchrec() -> None:
    codec = MX4Codec(group_size=32)
    ctx = codec.create_context()
    dims = [40, 64, 1, 0]
    assert codec.padded_size(torch.zeros(3, 64), dims, 1, ctx) == (64, 0)
    assert ctx.padded_dim_sum_per_rank == [64, 64, 32, 0]
    assert codec.padded_size(torch.zeros(3, 40), dims, 0, ctx) == (64, 24)
    assert codec.padded_size(torch.zeros(3, 1), dims, 2, None) == (32, 31)
    assert codec.padded_size(torch.zeros(100), dims, 0, ctx) == (100, 0)
    with pytest.raises(ValueError, match="dim_per_rank"):
        codec.padded_size(torch.zeros(3, 41), dims, 0, ctx)


def test_padded_size_matches_fbgemm() -> None:
    quantize_comm = pytest.importorskip("fbgemm_gpu.quantize_comm")
    sparse_type = pytest.importorskip("fbgemm_gpu.split_embedding_configs").SparseType
    theirs = quantize_comm.QuantizedCommCodec(sparse_type.MX4, row_dim=16)
    ours = MX4Codec(group_size=16)
    dims = [7, 16, 33, 48]
    for rank, d in enumerate(dims):
        their_ctx, our_ctx = theirs.create_context(), ours.create_context()
        x = torch.zeros(2, d)
        assert ours.padded_size(x, dims, rank, our_ctx) == theirs.padded_size(
            x, dims, rank, their_ctx
        )
        assert our_ctx.padded_dim_sum_per_rank == their_ctx.padded_dim_sum_per_rank


def test_pooled_all_to_all_as_torchrec_runs_it() -> None:
    # Rank 0's side of TorchRec's pooled all-to-all with two ranks: pad its
    # columns, encode once, split the wire per destination by
    # calc_quantized_size; each destination decodes and strips the padding.
    codec = MX4Codec(group_size=32)
    dims, batch = [40, 70], [3, 5]
    x = torch.randn(sum(batch), dims[0])
    ctx = codec.create_context()
    padded, padding = codec.padded_size(x, dims, 0, ctx)
    wire = codec.encode(torch.nn.functional.pad(x, (0, padding)), ctx)
    sizes = [codec.calc_quantized_size(padded * b, ctx) for b in batch]
    assert sum(sizes) == wire.numel()
    for rows, part in zip(x.split(batch), wire.split(sizes)):
        y = codec.decode(part, codec.create_context()).view(rows.shape[0], padded)[:, : dims[0]]
        bound = codec.info.rel_error_bound * rows.abs().amax() + codec.info.abs_error_bound
        assert bool(((y - rows).abs() <= bound).all())


# -- bad arguments ------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [0, -2, 3, 33])
def test_bad_group_size_raises_value_error(group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        MX4Codec(group_size=group_size)


def test_non_int_group_size_raises_type_error() -> None:
    with pytest.raises(TypeError, match="group_size"):
        MX4Codec(group_size="32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group_size"):
        MX4Codec(group_size=32.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("rounding", ["banker", "", 5, -1, True, None])
def test_unknown_rounding_lists_the_modes(rounding: object) -> None:
    with pytest.raises(ValueError, match="rounding must be one of nearest, floor, even"):
        MX4Codec(rounding=rounding)  # type: ignore[arg-type]


def test_bad_option_through_load_codec_names_it() -> None:
    with pytest.raises(qcomm.CodecError, match="rounding"):
        qcomm.load_codec("mx4:rounding=sideways")


def test_encode_rejects_non_float_input() -> None:
    with pytest.raises(TypeError, match="input_tensor"):
        MX4Codec().encode(torch.arange(32))


@pytest.mark.parametrize(
    "wire",
    [
        torch.zeros(17, dtype=torch.int8),
        torch.zeros(17, dtype=torch.float32),
        torch.zeros(16, dtype=torch.uint8),
        torch.zeros(18, dtype=torch.uint8),
        torch.zeros(1, dtype=torch.uint8),
    ],
)
def test_malformed_wire_raises_value_error(wire: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="input_grad"):
        MX4Codec(group_size=32).decode(wire)


def test_repr() -> None:
    assert (
        repr(MX4Codec(group_size=8, rounding="floor")) == "MX4Codec(group_size=8, rounding='floor')"
    )
