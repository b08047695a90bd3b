r"""
The optional C kernels (``qcomm_builtin._kernels``) and ``decode_into``.

- With the kernels and without them (``QCOMM_DISABLE_KERNELS``) every
  built-in block codec gives the same wire and the same decoded values, bit
  for bit, for every option, on data of every kind (magnitudes, ties, zeros,
  subnormals, infinities, NaN, values near the float32 maximum, ragged
  lengths, empty input) and on wires of arbitrary bytes; on x86 for both
  compiled copies of the kernels (baseline and AVX2).
- The exponent table behind the mx4 kernel gives :func:`shared_exponents`'
  exponent for every group maximum near a turning point and on a sample of
  all others (every maximum with ``QCOMM_EXHAUSTIVE=1``).
- ``decode_into`` of every built-in codec writes what ``decode`` returns, into
  outputs of any layout, with and without the kernels.
- The extension is built wherever a C compiler is.
"""

from __future__ import annotations

import math
import os
import shutil
import sysconfig
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_copies import KERNELS, MISSING
from qcomm_builtin import _fbgemm, _native, mx4

import qcomm

needs_kernels = pytest.mark.skipif(KERNELS is None, reason=MISSING)


def _load(spec: str, **options: Any) -> Any:
    # load_codec is typed with the contract's protocol; these tests also read
    # the members a codec class adds (info, row_dim, block, decode_into, ...).
    return qcomm.load_codec(spec, **options)


INT8_SPECS = [f"int8:row_dim={d}" for d in (1, 3, 7, 32, 64)]
FP8_SPECS = [f"fp8_{f}:row_dim={d}" for f in ("e4m3", "e5m2") for d in (1, 3, 7, 32, 64)]
MX4_SPECS = [
    f"mx4:group_size={g},rounding={r}"
    for g in (2, 6, 32, 64)
    for r in ("nearest", "floor", "even", "ceil", "stochastic")
]
BLOCK_SPECS = INT8_SPECS + FP8_SPECS + MX4_SPECS
HALF_SPECS = ["fp16", "fp16:loss_scale=1024", "bf16", "bf16:loss_scale=0.375"]
FLOAT32_MAX = torch.finfo(torch.float32).max


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)


def _both(
    monkeypatch: pytest.MonkeyPatch, fn: Callable[..., torch.Tensor], *args: object, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    # fn(*args) with the torch code and with the kernels; a stochastic codec
    # draws from the global generator, so both start from the same seed.
    monkeypatch.setenv("QCOMM_DISABLE_KERNELS", "1")
    torch.manual_seed(seed)
    off = fn(*args)
    monkeypatch.setenv("QCOMM_DISABLE_KERNELS", "0")
    torch.manual_seed(seed)
    on = fn(*args)
    return off, on


def _assert_same(off: torch.Tensor, on: torch.Tensor, what: str) -> None:
    assert off.dtype == on.dtype and off.shape == on.shape, what
    if not torch.equal(_bits(off), _bits(on)):
        diff = (_bits(off) != _bits(on)).nonzero().view(-1)
        pytest.fail(f"{what}: {diff.numel()} bytes differ, first at byte {int(diff[0])}")


# -- data ---------------------------------------------------------------------------


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e).float()


def _datasets(block: int) -> dict[str, torch.Tensor]:
    g = _gen(block)
    n = 64 * block + 5  # a ragged last block
    normal = torch.randn(n, generator=g)
    sets = {"normal": normal, "empty": torch.zeros(0), "one": torch.tensor([-2.5])}
    scale = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-44, 38.5, generator=g)
    sets["wide 1e-44..3e38"] = (torch.randn(n, generator=g, dtype=torch.float64) * scale).float()
    sets["subnormal"] = normal * 1e-40
    huge = torch.randn(n, generator=g).clamp(-1.0, 1.0) * FLOAT32_MAX
    huge[::7] = FLOAT32_MAX
    huge[3::11] = -FLOAT32_MAX
    sets["huge near float32 max"] = huge
    sets["zeros"] = torch.zeros(n)
    sets["negative zeros"] = torch.full((n,), -0.0)
    sets["constant"] = torch.full((n,), 0.1)
    # Values on int8's rounding ties (0 and 1 in every row fix the range).
    ties = (torch.randint(0, 255, (n,), generator=g).float() + 0.5) / 255
    ties[::block] = 0.0
    ties[block - 1 :: block] = 1.0
    sets["int8 ties"] = ties
    # Rows whose max-abs scales by exactly 1 (fp8) and whose values sit on
    # the midpoints of the fp8 grids, and one ulp either side.
    for name, fp8, shift, top in [
        ("e4m3", torch.float8_e4m3fn, 2.0**-8, 0.9375),
        ("e5m2", torch.float8_e5m2, 2.0**-16, 0.875),
    ]:
        codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        codes = codes[codes.isfinite()].unique()  # sorted
        mids = (codes[1:] + codes[:-1]) / 2 * shift
        pick = mids[torch.randint(0, mids.numel(), (n,), generator=g)]
        nudge = torch.randint(-1, 2, (n,), dtype=torch.int32, generator=g)
        pick = (pick.view(torch.int32) + nudge).view(torch.float32)
        pick[::block] = top
        sets[f"fp8 {name} ties"] = pick
    # MX4: element ties (group maximum 4 * 2**k: E = k in every mode), group
    # maxima around every turning point of the exponent rounding.
    ties4 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 4.0])
    k = torch.randint(-129, 125, (n // block + 1, 1), generator=g)
    picks = ties4[torch.randint(0, 7, (k.shape[0], block), generator=g)] * _pow2(k)
    picks = (
        picks.view(torch.int32) + torch.randint(-1, 2, picks.shape, dtype=torch.int32, generator=g)
    ).view(torch.float32)
    picks[:, 0] = 4 * _pow2(k[:, 0])
    sets["mx4 element ties"] = picks.reshape(-1)[:n] * (
        torch.randint(0, 2, (n,), generator=g) * 2 - 1
    )
    marks = torch.cat([_pow2(torch.arange(-126, 128)), 1.75 * _pow2(torch.arange(-126, 128))])
    marks = torch.cat([marks, math.sqrt(2) * _pow2(torch.arange(-126, 127))])
    near = torch.cat([marks.view(torch.int32) + d for d in range(-40, 41, 3)]).view(torch.float32)
    near = near[near.isfinite()]
    groups = torch.rand(near.numel(), block, generator=g) * near[:, None]
    groups[:, 0] = near
    sets["mx4 turning points"] = groups.reshape(-1)
    # Arbitrary bit patterns: NaN, infinities, subnormals, everything.
    sets["random bits"] = torch.randint(
        -(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g
    ).view(torch.float32)
    # Mostly finite, a few non-finite values scattered.
    bad = torch.randn(n, generator=g)
    where = torch.randint(0, n, (6,), generator=g)
    bad[where[:2]] = math.nan
    bad[where[2:4]] = math.inf
    bad[where[4:]] = -math.inf
    bad[1] = -math.nan
    sets["nan and inf"] = bad
    return sets


def _mixed_zero_meta(codec, x: torch.Tensor) -> torch.Tensor:
    # int8 rows whose minimum or maximum is a zero while they hold both +0.0
    # and -0.0: torch's amin/amax (and fbgemm's) pick either zero depending
    # on their vectorization, so the sign of a zero scale or bias there is
    # not defined; the kernels pick -0.0 as minimum and +0.0 as maximum.
    d = codec.block
    rows = torch.nn.functional.pad(x, (0, -x.numel() % d)).view(-1, d)
    if x.numel() % d:
        rows[-1, x.numel() % d :] = x[-1]
    zero = rows == 0
    neg = zero & (rows.view(torch.int32) < 0)
    mixed = neg.any(dim=1) & (zero & ~neg).any(dim=1)
    edge = (rows.amin(dim=1) == 0) | (rows.amax(dim=1) == 0)
    return mixed & edge


# -- encode and decode, kernels on and off --------------------------------------------


def _fallbacks(spec: str) -> list[str]:
    # int8's code without the kernels: fbgemm's kernel where it is installed,
    # else (or with QCOMM_DISABLE_FBGEMM) its torch code; both are checked.
    if not spec.startswith("int8"):
        return ["torch"]
    return ["torch", "fbgemm"] if _fbgemm._load() is not None else ["torch"]


def _int8_meta_words(wire: torch.Tensor, codec, rows: torch.Tensor) -> torch.Tensor:
    meta = wire.view(-1, codec.wire_per_block)[rows][:, codec.block :]
    return meta.clone(memory_format=torch.contiguous_format).view(torch.int32)


def _check_encode(codec, spec: str, name: str, x: torch.Tensor, off, on) -> None:
    what = f"{spec} encode of {name}"
    if spec.startswith("int8"):
        # Rows holding +0.0 and -0.0 whose minimum or maximum is zero: only
        # the sign of a zero scale or bias may differ (see _mixed_zero_meta).
        mixed = _mixed_zero_meta(codec, x)
        sign_free = 0x7FFFFFFF
        assert torch.equal(
            _int8_meta_words(off, codec, mixed) & sign_free,
            _int8_meta_words(on, codec, mixed) & sign_free,
        ), what
        rows_off, rows_on = off.view(-1, codec.wire_per_block), on.view(-1, codec.wire_per_block)
        assert torch.equal(rows_off[mixed][:, : codec.block], rows_on[mixed][:, : codec.block])
        off, on = rows_off[~mixed], rows_on[~mixed]
    _assert_same(off, on, what)


@needs_kernels
@pytest.mark.parametrize("spec", BLOCK_SPECS)
def test_wire_and_values_are_the_same_with_and_without_kernels(
    spec: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    for fallback in _fallbacks(spec):
        monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1" if fallback == "torch" else "0")
        for name, x in _datasets(codec.block).items():
            label = f"[{isa}, {fallback}] {name}"
            off, on = _both(monkeypatch, codec.encode, x, seed=x.numel())
            _check_encode(codec, spec, label, x, off, on)
            off, on = _both(monkeypatch, codec.decode, codec.encode(x))
            _assert_same(off, on, f"{spec} decode of {label}")


def _arbitrary_wires(codec, seed: int) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    rows = 3000
    wires = {
        "random bytes": torch.randint(
            0, 256, (rows * codec.wire_per_block,), dtype=torch.uint8, generator=g
        )
    }
    if codec.info.name == "mx4":
        # Every element byte under every exponent byte.
        half = codec.block // 2
        body = torch.arange(256 * half, dtype=torch.int64) % 256
        every = torch.cat([body.view(256, half), torch.arange(256)[:, None]], dim=1)
        wires["every (exponent, element) byte"] = every.to(torch.uint8).reshape(-1)
        return wires
    # Every value byte, under scales (and biases) of every kind.
    specials = [0.0, -0.0, 1.0, -3.5, 1e-40, -1e-45, 3e38, math.inf, -math.inf, math.nan]
    scales = torch.tensor(specials + torch.randn(22, generator=g).tolist())
    values = torch.arange(256 * 32) % 256
    count = -(-values.numel() // codec.block)
    w = torch.randint(0, 256, (count, codec.wire_per_block), dtype=torch.uint8, generator=g)
    w[:, : codec.block] = torch.nn.functional.pad(
        values, (0, count * codec.block - values.numel())
    )[: count * codec.block].view(count, codec.block)
    meta = codec.wire_per_block - 8
    pick = scales[torch.randint(0, scales.numel(), (count, 2), generator=g)]
    w[:, meta:] = pick.view(torch.uint8).view(count, 8)
    wires["every value byte, special scales"] = w.reshape(-1)
    return wires


@needs_kernels
@pytest.mark.parametrize(
    "spec", INT8_SPECS + FP8_SPECS + [f"mx4:group_size={g}" for g in (2, 6, 32, 64)]
)
def test_decode_of_arbitrary_wire_bytes_is_the_same_with_and_without_kernels(
    spec: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = _load(spec)
    # int8's fallback when the kernels are off is the torch code here: fbgemm's
    # decoder rounds q * scale + bias twice in the columns past its vector
    # loop (row_dim not a multiple of 8), so it differs on some such wires.
    monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    for name, wire in _arbitrary_wires(codec, len(spec)).items():
        off, on = _both(monkeypatch, codec.decode, wire)
        _assert_same(off, on, f"{spec} [{isa}] decode of {name}")


@needs_kernels
@pytest.mark.parametrize("fused", [True, False])
def test_int8_decode_kernel_rounds_once_or_twice_as_asked(fused: bool) -> None:
    # int8.py asks torch whether its addcmul rounds q * scale + bias once
    # (FMA) or twice, and has the kernel do the same. Both kernel modes, on
    # any bytes, against torch rounding once (addcmul where it does) or
    # twice (a multiplication, then an addition).
    from qcomm_builtin import int8

    assert int8._rounds_once() is not None  # torch is consistent on this machine
    if fused and not int8._rounds_once():
        pytest.skip("torch's addcmul rounds twice on this machine: no reference rounding once")
    d = 7
    wire = torch.randint(0, 256, (4000 * (d + 8),), dtype=torch.uint8, generator=_gen(13))
    rows = wire.view(-1, d + 8)
    scale_bias = rows[:, d:].clone().view(torch.float32)
    q, scale, bias = rows[:, :d].float(), scale_bias[:, :1], scale_bias[:, 1:]
    expected = torch.addcmul(bias, q, scale) if fused else q * scale + bias
    got = torch.empty(q.numel())
    n = got.numel()
    KERNELS.int8_decode(wire.data_ptr(), rows.shape[0], got.data_ptr(), d, n, n, fused)
    _assert_same(expected.reshape(-1), got, f"int8 kernel, fused={fused}")


@needs_kernels
def test_mx4_decode_of_every_byte_pair_equals_fbgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    quantize_utils = pytest.importorskip("fbgemm_gpu.quantize_utils")
    codec = _load("mx4:group_size=512")
    wire = _arbitrary_wires(codec, 0)["every (exponent, element) byte"]
    wire = wire.view(256, -1)[:255].reshape(-1)  # fbgemm reads 255 as 2**128
    ours = codec.decode(wire)
    theirs = quantize_utils.mx4_to_fp32(wire, 512)
    _assert_same(theirs, ours, "mx4 decode vs fbgemm")


@needs_kernels
def test_long_input_crosses_chunks_and_pieces_encode_alone(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(3 * (1 << 20) + 17, generator=_gen(5)) * 100
    x[123_457] = math.nan
    for spec in ["int8", "fp8_e4m3", "fp8_e5m2:row_dim=100", "mx4", "mx4:rounding=floor"]:
        codec = _load(spec)
        off, on = _both(monkeypatch, codec.encode, x)
        _assert_same(off, on, f"{spec} [{isa}] encode")
        off, on = _both(monkeypatch, codec.decode, on)
        _assert_same(off, on, f"{spec} [{isa}] decode")


@needs_kernels
def test_long_rows_and_groups(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks longer than a kernel's chunk, and than its buffer of codes.
    x = torch.randn(5 * 10_000 + 3, generator=_gen(6))
    x[7] = 1e30
    for spec in ["int8:row_dim=10000", "fp8_e5m2:row_dim=5001", "mx4:group_size=5000"]:
        codec = _load(spec)
        off, on = _both(monkeypatch, codec.encode, x)
        _assert_same(off, on, f"{spec} [{isa}] encode")
        off, on = _both(monkeypatch, codec.decode, on)
        _assert_same(off, on, f"{spec} [{isa}] decode")


@needs_kernels
def test_non_contiguous_and_non_float32_input(monkeypatch: pytest.MonkeyPatch) -> None:
    base = torch.randn(96, 40, generator=_gen(7))
    for spec in ["int8", "fp8_e4m3", "mx4"]:
        codec = _load(spec)
        for x in [base.t(), base[:, ::2], base.half(), base.double()]:
            off, on = _both(monkeypatch, codec.encode, x)
            _assert_same(off, on, f"{spec} encode of a {x.dtype} {list(x.stride())} input")


# -- the mx4 exponent table ------------------------------------------------------------


def _table_bytes(rounding: str, m: torch.Tensor) -> torch.Tensor:
    # What the kernel computes from the table (see mx4_exponent in _kernels.c).
    table = mx4._exponent_table(rounding)
    assert table is not None, rounding
    bits = m.view(torch.int32).to(torch.int64).clamp(min=0x00800000)
    if rounding == "even":
        bits = (bits + (1 << 21) - 1).clamp(max=0x7F800000)
    t = table.to(torch.int64)[bits >> 23]
    mant = bits & 0x7FFFFF
    return t[:, 0] + (mant >= t[:, 1]).long() + (mant >= t[:, 2]).long()


def _torch_bytes(rounding: str, m: torch.Tensor) -> torch.Tensor:
    return mx4.shared_exponents(m, rounding).long() + 127


def _check_table(rounding: str, m: torch.Tensor) -> None:
    ours, theirs = _table_bytes(rounding, m), _torch_bytes(rounding, m)
    if not torch.equal(ours, theirs):
        i = int((ours != theirs).nonzero()[0])
        pytest.fail(
            f"{rounding}: maximum {m[i].item()!r} (bits {m.view(torch.int32)[i].item():#x}) "
            f"gets exponent byte {ours[i].item()} from the table, {theirs[i].item()} from torch"
        )


@pytest.mark.parametrize("rounding", ["nearest", "floor", "even", "ceil"])
def test_exponent_table_equals_shared_exponents_near_every_turning_point(rounding: str) -> None:
    # Every float32 within 4096 ulps (twice the window the table is built
    # from) of 2**k, sqrt(2) * 2**k and 1.75 * 2**k (where "even"'s two-bit
    # rounding turns over), for every binade: wherever float32 log2 can move
    # an exponent step.
    k = torch.arange(-126, 128)
    marks = torch.cat([_pow2(k), math.sqrt(2) * _pow2(k[:-1]), 1.75 * _pow2(k[:-1])])
    offsets = torch.arange(-4096, 4097, dtype=torch.int64)
    bits = (marks.view(torch.int32).to(torch.int64)[:, None] + offsets).reshape(-1)
    bits = bits[(bits >= 0x00800000) & (bits < 0x7F800000)]
    _check_table(rounding, bits.to(torch.int32).view(torch.float32))


@pytest.mark.parametrize("rounding", ["nearest", "floor", "even", "ceil"])
def test_exponent_table_equals_shared_exponents_on_a_sample_of_all_maxima(rounding: str) -> None:
    g = _gen(11)
    bits = torch.randint(0, 0x7F800000, (1 << 21,), dtype=torch.int32, generator=g)
    stride = torch.arange(0, 0x7F800000, 997, dtype=torch.int64).to(torch.int32)
    edge = torch.tensor([0, 1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7FFFFE], dtype=torch.int32)
    _check_table(rounding, torch.cat([bits, stride, edge]).view(torch.float32))


@pytest.mark.skipif(
    os.environ.get("QCOMM_EXHAUSTIVE", "") in ("", "0"),
    reason="checks all 2**31 maxima (minutes): set QCOMM_EXHAUSTIVE=1",
)
@pytest.mark.parametrize("rounding", ["nearest", "floor", "even", "ceil"])
def test_exponent_table_equals_shared_exponents_for_every_maximum(rounding: str) -> None:
    step = 1 << 24
    for start in range(0, 0x7F800000, step):
        bits = torch.arange(start, min(start + step, 0x7F800000), dtype=torch.int64)
        _check_table(rounding, bits.to(torch.int32).view(torch.float32))


def test_exponent_table_steps_lie_where_log2_puts_them() -> None:
    # The table's form itself: at most one step per binade, next to 2**k for
    # floor and ceil (float32 log2 rounds within ~50 ulps of an integer) and
    # next to sqrt(2) * 2**k for nearest.
    end = 1 << 23
    for rounding, centre in [("floor", end), ("ceil", 0), ("nearest", mx4._SQRT2_MANTISSA)]:
        table = mx4._exponent_table(rounding)
        assert table is not None
        assert bool((table[:, 2] == end).all())
        steps = table[1:255, 1]
        steps = steps[steps < end]
        assert steps.numel() >= 240
        assert int((steps - centre).abs().max()) < 256, rounding


@needs_kernels
def test_mx4_encodes_with_torch_where_no_table_could_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _exponent_table gives None when torch's log2 steps where the kernel's
    # form cannot follow; stochastic rounding never has a table.
    calls = []

    def recorded(*args: Any) -> torch.Tensor:
        calls.append(args[2])
        return encode_mx4(*args)

    encode_mx4 = mx4.encode_mx4
    monkeypatch.setattr(mx4, "encode_mx4", recorded)
    x = torch.randn(1000, generator=_gen(12))
    expected = _load("mx4:rounding=floor").encode(x)
    assert calls == []
    monkeypatch.setattr(mx4, "_exponent_table", lambda rounding: None)
    assert torch.equal(_load("mx4:rounding=floor").encode(x), expected)
    _load("mx4:rounding=stochastic").encode(x)
    assert calls == ["floor", "stochastic"]


# -- decode_into ----------------------------------------------------------------------


def _outs(n: int, block: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    # Every layout of out: (out, the tensor it is a view of).
    sentinel = -12345.0
    w = 4 * block if n and n % (4 * block) == 0 else max(n, 1)
    r = n // w
    flat = torch.full((n,), sentinel)
    matrix = torch.full((r, w), sentinel)
    wide = torch.full((r, 3 * w), sentinel)
    shifted = torch.full((r, w + 3), sentinel)
    spaced = torch.full((2 * n,), sentinel)
    tall = torch.full((n, 2), sentinel)
    square = torch.full((w, r), sentinel)
    cube = torch.full((r, 2, w), sentinel)
    return {
        "contiguous 1-D": (flat, flat),
        "contiguous 2-D": (matrix, matrix),
        "band of columns": (wide[:, w : 2 * w], wide),
        "band of columns, rows one float off alignment": (shifted[:, 1 : w + 1], shifted),
        "one column of a matrix": (tall[:, 1:], tall),
        "every other element": (spaced[::2], spaced),
        "transpose": (square.t(), square),
        "3-D slice": (cube[:, 1:2, :], cube),
    }


def _check_decode_into(codec, wire: torch.Tensor, label: str) -> None:
    expected = codec.decode(wire)
    n = expected.numel()
    block = getattr(codec, "block", 1)
    for where, (out, whole) in _outs(n, block).items():
        before = whole.clone()
        wire_before = wire.clone()
        assert codec.decode_into(wire, out) is None
        assert torch.equal(_bits(wire), _bits(wire_before)), f"{label}: {where}: wire changed"
        _assert_same(expected.reshape(-1), out.reshape(-1), f"{label}: decode_into {where}")
        # Nothing outside `out` was written.
        marker = torch.zeros_like(whole, dtype=torch.bool)
        marker_view = marker.as_strided(out.shape, out.stride(), out.storage_offset())
        marker_view.fill_(True)
        assert torch.equal(_bits(whole[~marker]), _bits(before[~marker])), f"{label}: {where}"


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("spec", HALF_SPECS + BLOCK_SPECS[::3] + ["int8", "fp8_e5m2", "mx4"])
def test_decode_into_writes_what_decode_returns(
    spec: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels == "on" and KERNELS is None:
        pytest.skip(needs_kernels.kwargs["reason"])
    monkeypatch.setenv("QCOMM_DISABLE_KERNELS", "1" if kernels == "off" else "0")
    codec = _load(spec)
    block = getattr(codec, "block", 1)
    for name in ["normal", "nan and inf", "wide 1e-44..3e38", "empty"]:
        x = _datasets(block)[name]
        x = x[: x.numel() // (4 * block) * (4 * block)] if x.numel() > 4 * block else x
        torch.manual_seed(0)
        _check_decode_into(codec, codec.encode(x), f"{spec} ({kernels}) {name}")
    if block > 1:
        # Any bytes, and a ragged input (decode returns whole blocks).
        _check_decode_into(codec, _arbitrary_wires(codec, 3)["random bytes"], f"{spec} bytes")
        _check_decode_into(codec, codec.encode(torch.randn(5 * block + 1)), f"{spec} ragged")


@pytest.mark.parametrize("spec", HALF_SPECS + ["int8", "fp8_e4m3", "mx4"])
def test_decode_into_refuses_a_bad_out(spec: str) -> None:
    codec = _load(spec)
    wire = codec.encode(torch.randn(256, generator=_gen(8)))
    n = codec.decode(wire).numel()
    for bad in [torch.empty(n, dtype=torch.float64), torch.empty(n + 1), torch.empty(n - 1)]:
        with pytest.raises(ValueError, match="out"):
            codec.decode_into(wire, bad)
    with pytest.raises(ValueError, match="out"):
        codec.decode_into(wire, [0.0] * n)


@pytest.mark.parametrize("spec", HALF_SPECS + ["int8:row_dim=7", "fp8_e5m2", "mx4"])
def test_decode_into_refuses_a_malformed_wire_like_decode(spec: str) -> None:
    codec = _load(spec)
    wire = codec.encode(torch.randn(224, generator=_gen(9)))
    out = torch.empty(codec.decode(wire).numel())
    bad_wires = [wire.to(torch.float32 if wire.dtype != torch.float32 else torch.float16)]
    if spec.startswith(("int8", "fp8", "mx4")):
        bad_wires.append(wire[:-1])
    for bad in bad_wires:
        with pytest.raises(ValueError) as from_decode:
            codec.decode(bad)
        with pytest.raises(ValueError) as from_into:
            codec.decode_into(bad, out)
        assert str(from_into.value) == str(from_decode.value)


# -- building, loading, switching off --------------------------------------------------


def _c_compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def test_kernels_are_built_where_a_c_compiler_is() -> None:
    if KERNELS is not None:
        return
    cc = _c_compiler()
    if cc is None:
        pytest.skip("no C compiler: qcomm_builtin._kernels cannot be built here")
    pytest.fail(
        f"qcomm_builtin._kernels is missing although a C compiler ({cc}) is available: "
        "reinstall qcomm (pip install -e .) and look for the build error in its output"
    )


def test_disable_env_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in [("1", False), ("yes", False), ("0", True), ("", True), (" 0 ", True)]:
        monkeypatch.setenv("QCOMM_DISABLE_KERNELS", value)
        assert (_native.kernels() is not None) == (on and KERNELS is not None), value
    monkeypatch.delenv("QCOMM_DISABLE_KERNELS")
    assert (_native.kernels() is not None) == (KERNELS is not None)


@needs_kernels
def test_kernels_check_their_arguments() -> None:
    k = KERNELS
    x, w, y = torch.zeros(64), torch.zeros(80, dtype=torch.uint8), torch.zeros(64)
    table = mx4._exponent_table("even")
    assert table is not None
    bad_calls = [
        (lambda: k.int8_encode(0, 64, w.data_ptr(), 32), "src"),
        (lambda: k.int8_encode(x.data_ptr(), -1, w.data_ptr(), 32), "n must be"),
        (lambda: k.int8_encode(x.data_ptr(), 64, w.data_ptr(), 0), "row_dim"),
        (lambda: k.int8_decode(w.data_ptr(), 2, y.data_ptr(), 32, 48, 64, True), "width"),
        (lambda: k.int8_decode(w.data_ptr(), 2, y.data_ptr(), 32, 64, 32, True), "stride"),
        (lambda: k.fp8_decode(w.data_ptr(), 2, 0, 32, False, 64, 64), "dst"),
        (lambda: k.mx4_encode(x.data_ptr(), 64, w.data_ptr(), 31, True, table.data_ptr()), "even"),
        (lambda: k.mx4_encode(x.data_ptr(), 64, w.data_ptr(), 32, True, 0), "table"),
        (lambda: k.mx4_decode(w.data_ptr(), 2, y.data_ptr(), 32, 96, 96), "width"),
        (lambda: k.isa("sse9"), "isa"),
    ]
    for call, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError):
        k.int8_encode(x.data_ptr(), 64)
    # Nothing to do is fine, with or without addresses.
    k.int8_encode(0, 0, 0, 32)
    k.mx4_decode(0, 0, 0, 32, 32, 32)


@needs_kernels
@pytest.mark.parametrize(
    "spec", ["int8:row_dim=7", "fp8_e4m3", "fp8_e5m2:row_dim=3", "mx4:group_size=6"]
)
def test_decode_into_writes_lines_of_whole_blocks_directly(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A contiguous out, or a band of columns whose width is whole blocks, is
    # decoded in place: no decoded temporary to copy from.
    codec = _load(spec)

    def no_copy(self: qcomm.BlockCodec, wire: torch.Tensor, out: torch.Tensor) -> None:
        raise AssertionError("decode_into decoded into a temporary")

    # The base's dequantize_into decodes and copies: the codecs' kernels
    # fall back on it where they cannot write `out` directly.
    monkeypatch.setattr(qcomm.BlockCodec, "dequantize_into", no_copy)
    wire = codec.encode(torch.randn(24 * codec.block, generator=_gen(10)))
    expected = codec.decode(wire)
    for where, (out, _) in _outs(expected.numel(), codec.block).items():
        if where in ("one column of a matrix", "every other element", "transpose"):
            with pytest.raises(AssertionError, match="temporary"):
                codec.decode_into(wire, out)
        else:
            codec.decode_into(wire, out)
            _assert_same(expected, out.reshape(-1), f"{spec}: {where}")
