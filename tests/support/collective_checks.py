"""What the collective suites share: test-local codecs, data every rank can
regenerate, references computed without qcomm and the bound a codec's
:class:`~qcomm.CodecInfo` declares, and the check of one call of each
collective against them (run inside a rank).

- The no-op path (``codecs=None``, and a foreign identity codec without
  ``info``) must be exact: the inputs are small integers, so even sums do not
  round.
- A real codec must stay within its declared :class:`~qcomm.CodecInfo` bound,
  ``rel_error_bound * s + abs_error_bound``. A collective encodes each
  destination's block on its own, so ``s`` is taken as ``|x|`` for
  ``error_block == 1`` and otherwise as the largest magnitude of the block a
  value travels in (an upper bound of the largest magnitude of its scale block).
  For reduce-scatter the bound accumulates over the summed ranks (see
  :func:`sum_bound`).
- Test-local codecs cover every code path whatever plugins are installed:
  a summable cast, a row-wise block codec that needs padding, a codec with a
  per-tensor header and a foreign codec without ``info``.

Every rank generates every rank's inputs and output gradients from fixed
seeds (:func:`gen`), so each rank computes its expected output and input
gradient with plain local torch and checks its own.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from codec_names import suite_codecs

import qcomm
from qcomm import CodecInfo, QuantizedCommCodecs
from qcomm.collectives import all_gather_pooled

# float32's unit roundoff: the error of one rounded addition, relative to the sum.
U32 = 2.0**-24


# --------------------------------------------------------------------------
# Test-local codecs: one per code path, independent of the built-in plugins.


class CastFP16Codec:
    """float16 cast, declared summable: reduce-scatter sums it in the backend."""

    def __init__(self) -> None:
        # Round to nearest keeps 11 significant bits; below the normal range
        # the absolute error is at most half the smallest subnormal.
        self.info = CodecInfo(
            name="test_fp16",
            bits_per_element=16,
            summable=True,
            rel_error_bound=2.0**-11,
            abs_error_bound=2.0**-25,
            max_abs_input=65504.0,
        )

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1).clamp(-65504.0, 65504.0).to(torch.float16)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad.to(torch.float32)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float16

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return dim_per_rank[my_rank], 0


@dataclasses.dataclass
class RowContext:
    padded_dim_sum_per_rank: list[int] | None = None


class RowInt8Codec:
    """Symmetric int8 per row of 8 elements, scale in-band; needs padding to whole rows."""

    ROW = 8

    def __init__(self) -> None:
        # |round(x / scale) * scale - x| <= scale / 2 = max|row| / 254, plus
        # float32 rounding of the division and product (a few ulps, covered
        # by 2**-21 of max|row|).
        self.info = CodecInfo(
            name="test_row_int8",
            bits_per_element=12,
            error_block=self.ROW,
            rel_error_bound=0.5 / 127 + 2.0**-21,
        )

    def _rows(self, n: int) -> int:
        if n % self.ROW:
            raise ValueError(f"test_row_int8: length {n} is not a multiple of {self.ROW}")
        return n // self.ROW

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        x = input_tensor.reshape(-1).float()
        rows = x.view(self._rows(x.numel()), self.ROW)
        scale = rows.abs().amax(dim=1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return torch.cat([q, scale.view(torch.uint8)], dim=1).reshape(-1)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        wire = input_grad.view(-1, self.ROW + 4)
        q = wire[:, : self.ROW].contiguous().view(torch.int8).float()
        scale = wire[:, self.ROW :].contiguous().view(torch.float32)
        return (q * scale).reshape(-1)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return self._rows(input_len) * (self.ROW + 4)

    def create_context(self) -> RowContext:
        return RowContext()

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        padded = [-(-d // self.ROW) * self.ROW for d in dim_per_rank]
        qcomm_ctx.padded_dim_sum_per_rank = padded
        return padded[my_rank], padded[my_rank] - dim_per_rank[my_rank]


class TensorInt8Codec:
    """Symmetric int8 with one scale per encoded tensor in a 4-byte header:
    the wire of an empty input is not empty, and sizes do not add up."""

    def __init__(self) -> None:
        self.info = CodecInfo(
            name="test_tensor_int8",
            bits_per_element=8,
            error_block=0,
            rel_error_bound=0.5 / 127 + 2.0**-21,
        )

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        x = input_tensor.reshape(-1).float()
        top = x.abs().max() / 127 if x.numel() else torch.zeros(())
        scale = torch.where(top > 0, top, torch.ones_like(top)).reshape(1)
        q = torch.round(x / scale).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return torch.cat([scale.view(torch.uint8), q])

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        scale = input_grad[:4].contiguous().view(torch.float32)
        return input_grad[4:].contiguous().view(torch.int8).float() * scale

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len + 4

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return dim_per_rank[my_rank], 0


class ForeignIdentityCodec:
    """A codec from elsewhere without ``info``: qcomm must assume the least
    (not summable, not element-wise) and still be exact for it."""

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float32

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return dim_per_rank[my_rank], 0


LOCAL_CODECS: dict[str, Callable[[], Any]] = {
    "test_fp16": CastFP16Codec,
    "test_row_int8": RowInt8Codec,
    "test_tensor_int8": TensorInt8Codec,
}
# The built-in codecs and the example plugin's (tests/support/codec_names.py; other
# installed plugins with QCOMM_TEST_PLUGINS=1): one that fails to load fails
# its cases instead of being left out.
CODEC_NAMES = [*LOCAL_CODECS, *suite_codecs()]


def make_codec(name: str) -> Any:
    return LOCAL_CODECS[name]() if name in LOCAL_CODECS else qcomm.load_codec(name)


def pair(name: str) -> QuantizedCommCodecs:
    return QuantizedCommCodecs(forward=make_codec(name), backward=make_codec(name))


# --------------------------------------------------------------------------
# Data, references and bounds.


def gen(tag: str, shape: tuple[int, ...], ints: bool) -> torch.Tensor:
    """The same tensor on every rank for the same tag."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    if ints:
        return torch.randint(-8, 9, shape, generator=g).float()
    x = torch.randn(shape, generator=g)
    if x.dim() and x.shape[0]:
        # Rows of different magnitudes, so that a scale applied to the wrong
        # block shows.
        x = x * (torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), generator=g) * 4 + 0.1)
    return x


def offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def magnitude(block: torch.Tensor, info: CodecInfo) -> torch.Tensor:
    """``s`` of every element of a block encoded on its own."""
    if info.error_block == 1:
        return block.abs()
    top = block.abs().max().item() if block.numel() else 0.0
    return torch.full_like(block, top)


def finite_info(codec: Any) -> CodecInfo:
    info = qcomm.codec_info(codec)
    assert math.isfinite(info.rel_error_bound), f"codec {info.name} declares no error bound"
    return info


def in_range(xs: list[torch.Tensor], codecs: Any) -> list[torch.Tensor]:
    """The data scaled into the codecs' declared input range (a clamping
    codec such as fp8_e4m3_tensor holds its bound only there)."""
    if codecs is None:
        return xs
    limit = min(qcomm.codec_info(c).max_abs_input for c in (codecs.forward, codecs.backward))
    if not math.isfinite(limit):
        return xs
    worst = max((float(x.abs().max()) for x in xs if x.numel()), default=0.0)
    return [x * (limit / worst) for x in xs] if worst > limit else xs


def assert_within(what: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    err = (got.double() - ref.double()).abs()
    bad = ~(err <= bound.double())  # a NaN is bad too
    if bad.any():
        worst = int((err - bound.double()).nan_to_num(math.inf).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements beyond the declared bound; "
            f"worst: got {got.reshape(-1)[worst].item()}, expected {ref.reshape(-1)[worst].item()}, "
            f"bound {bound.reshape(-1)[worst].item()}"
        )


def assert_equal(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype}, expected {ref.dtype}"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if not torch.equal(got, ref):
        diff = (got.double() - ref.double()).abs().max().item()
        raise AssertionError(f"{what}: not exact, max difference {diff}")


def sum_bound(xs: list[torch.Tensor], ss: list[torch.Tensor], info: CodecInfo, native: bool) -> Any:
    r"""Error bound of a reduce-scatter output element, from the codec's bound.

    Each rank's value is encoded with error :math:`e_k \le r s_k + a` (``r``,
    ``a``: the declared bounds), so the decoded values sum to within
    :math:`E = \sum_k (r s_k + a)` of the exact sum, and every partial sum is
    at most :math:`P = \sum_k (|x_k| + r s_k + a)` in magnitude.

    - Summed locally in float32 (non-summable codecs): each of the
      :math:`W - 1` additions rounds by at most :math:`u P`, :math:`u = 2^{-24}`.
    - Summed by the backend in the wire format (summable codecs): each
      addition rounds to the wire format, an error of the codec's own kind,
      :math:`r |p| + a`, where a partial sum :math:`|p|` is at most
      :math:`(1 + r)^W (P + W a)` once earlier roundings are counted.
    """
    world = len(xs)
    r, a = info.rel_error_bound, info.abs_error_bound
    enc = sum(r * s + a for s in ss)
    partial = sum(x.abs() + r * s + a for x, s in zip(xs, ss))
    if native:
        return enc + (world - 1) * (r * (1 + r) ** world * (partial + world * a) + a)
    return enc + (world - 1) * U32 * partial


# --------------------------------------------------------------------------
# The checks of each collective (run inside a rank).


def check_pooled(
    rank: int,
    world: int,
    batches: list[int],
    dims: list[int],
    tag: str,
    codec: str | None,
    dtype: torch.dtype = torch.float32,
    division: bool = False,
) -> None:
    exact = codec is None
    xs = [gen(f"{tag}:x{k}", (sum(batches), dims[k]), exact).to(dtype) for k in range(world)]
    gs = [gen(f"{tag}:g{r}", (batches[r], sum(dims)), exact).to(dtype) for r in range(world)]
    codecs = pair(codec) if codec else None
    xs, gs = in_range(xs, codecs), in_range(gs, codecs)
    x = xs[rank].clone().requires_grad_(True)
    out = qcomm.all_to_all_pooled(
        x, batches, dims, codecs=codecs, gradient_division=division
    ).wait()
    (out * gs[rank]).sum().backward()
    rows, cols = offsets(batches), offsets(dims)
    mine = slice(rows[rank], rows[rank + 1])
    ref = torch.cat([xs[k][mine] for k in range(world)], dim=1)
    my_cols = slice(cols[rank], cols[rank + 1])
    ref_grad = torch.cat([gs[r][:, my_cols] for r in range(world)], dim=0)
    if division:
        ref_grad = ref_grad / world
    assert x.grad is not None
    if codecs is None:
        assert_equal("output", out, ref)
        assert_equal("input gradient", x.grad, ref_grad)
        return
    fwd, bwd = finite_info(codecs.forward), finite_info(codecs.backward)
    s = torch.cat([magnitude(xs[k][mine], fwd) for k in range(world)], dim=1)
    assert_within("output", out, ref, fwd.rel_error_bound * s + fwd.abs_error_bound)
    s = torch.cat([magnitude(gs[r][:, my_cols], bwd) for r in range(world)], dim=0)
    assert_within("input gradient", x.grad, ref_grad, bwd.rel_error_bound * s + bwd.abs_error_bound)


def check_reduce_scatter(
    rank: int,
    world: int,
    splits: list[int] | None,
    rest: tuple[int, ...],
    tag: str,
    codec: str | None,
    exact_codec: Any = None,
    dtype: torch.dtype = torch.float32,
    division: bool = False,
) -> None:
    exact = codec is None
    sizes = splits if splits is not None else [2] * world
    xs = [gen(f"{tag}:x{k}", (sum(sizes), *rest), exact).to(dtype) for k in range(world)]
    gs = [gen(f"{tag}:g{r}", (sizes[r], *rest), exact).to(dtype) for r in range(world)]
    codecs = pair(codec) if codec else exact_codec
    xs, gs = in_range(xs, codecs), in_range(gs, codecs)
    x = xs[rank].clone().requires_grad_(True)
    out = qcomm.reduce_scatter_pooled(
        x, input_splits=splits, codecs=codecs, gradient_division=division
    ).wait()
    (out * gs[rank]).sum().backward()
    o = offsets(sizes)
    blocks = [xk[o[rank] : o[rank + 1]] for xk in xs]
    ref = torch.stack(blocks).double().sum(0).to(dtype)
    ref_grad = torch.cat(gs, dim=0)
    if division:
        ref_grad = ref_grad / world
    assert x.grad is not None
    if codec is None:
        assert_equal("output", out, ref)
        assert_equal("input gradient", x.grad, ref_grad)
        return
    assert codecs is not None
    fwd, bwd = finite_info(codecs.forward), finite_info(codecs.backward)
    ss = [magnitude(b, fwd) for b in blocks]
    assert_within("output", out, ref, sum_bound(blocks, ss, fwd, native=fwd.summable))
    s = torch.cat([magnitude(g, bwd) for g in gs], dim=0)
    assert_within("input gradient", x.grad, ref_grad, bwd.rel_error_bound * s + bwd.abs_error_bound)


def check_all_gather(
    rank: int,
    world: int,
    splits: list[int],
    rest: tuple[int, ...],
    tag: str,
    codec: str | None,
) -> None:
    # The reduce-scatter's adjoint: every rank's block to all, and back the
    # sum of every rank's gradient of this rank's block.
    exact = codec is None
    xs = [gen(f"{tag}:x{k}", (splits[k], *rest), exact) for k in range(world)]
    gs = [gen(f"{tag}:g{r}", (sum(splits), *rest), exact) for r in range(world)]
    codecs = pair(codec) if codec else None
    xs, gs = in_range(xs, codecs), in_range(gs, codecs)
    x = xs[rank].clone().requires_grad_(True)
    out = all_gather_pooled(x, output_splits=splits, codecs=codecs).wait()
    (out * gs[rank]).sum().backward()
    o = offsets(splits)
    ref = torch.cat(xs, dim=0)
    blocks = [g[o[rank] : o[rank + 1]] for g in gs]
    ref_grad = torch.stack(blocks).double().sum(0).float()
    assert x.grad is not None
    if codecs is None:
        assert_equal("output", out, ref)
        assert_equal("input gradient", x.grad, ref_grad)
        return
    fwd, bwd = finite_info(codecs.forward), finite_info(codecs.backward)
    s = torch.cat([magnitude(xk, fwd) for xk in xs], dim=0)
    assert_within("output", out, ref, fwd.rel_error_bound * s + fwd.abs_error_bound)
    assert_equal("own block", out[o[rank] : o[rank + 1]], xs[rank])  # never encoded
    ss = [magnitude(b, bwd) for b in blocks]
    assert_within("input gradient", x.grad, ref_grad, sum_bound(blocks, ss, bwd, native=False))


def check_sequence(
    rank: int,
    world: int,
    matrix: list[list[int]],
    rest: tuple[int, ...],
    tag: str,
    codec: str | None,
    exact_codec: Any = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    # matrix[k][r]: rows rank k sends to rank r.
    exact = codec is None
    column = [[matrix[k][r] for k in range(world)] for r in range(world)]
    xs = [gen(f"{tag}:x{k}", (sum(matrix[k]), *rest), exact).to(dtype) for k in range(world)]
    gs = [gen(f"{tag}:g{r}", (sum(column[r]), *rest), exact).to(dtype) for r in range(world)]
    codecs = pair(codec) if codec else exact_codec
    xs, gs = in_range(xs, codecs), in_range(gs, codecs)
    x = xs[rank].clone().requires_grad_(True)
    out = qcomm.all_to_all_sequence(
        x, input_splits=matrix[rank], output_splits=column[rank], codecs=codecs
    ).wait()
    (out * gs[rank]).sum().backward()
    send = [offsets(matrix[k]) for k in range(world)]
    recv = [offsets(column[r]) for r in range(world)]
    pieces = [xs[k][send[k][rank] : send[k][rank + 1]] for k in range(world)]
    grads = [gs[r][recv[r][rank] : recv[r][rank + 1]] for r in range(world)]
    ref, ref_grad = torch.cat(pieces), torch.cat(grads)
    assert x.grad is not None
    if codec is None:
        assert_equal("output", out, ref)
        assert_equal("input gradient", x.grad, ref_grad)
        return
    assert codecs is not None
    fwd, bwd = finite_info(codecs.forward), finite_info(codecs.backward)
    s = torch.cat([magnitude(p, fwd) for p in pieces])
    assert_within("output", out, ref, fwd.rel_error_bound * s + fwd.abs_error_bound)
    s = torch.cat([magnitude(g, bwd) for g in grads])
    assert_within("input gradient", x.grad, ref_grad, bwd.rel_error_bound * s + bwd.abs_error_bound)


# Uneven splits with zeros: ranks with no batch, no columns, no rows to send
# or receive; widths that are not multiples of any codec's block.
POOLED: dict[int, list[tuple[list[int], list[int]]]] = {
    2: [([3, 0], [2, 5]), ([2, 4], [0, 3]), ([1, 2], [9, 33]), ([0, 0], [3, 1])],
    3: [([3, 0, 2], [2, 5, 0]), ([0, 2, 1], [4, 0, 7]), ([2, 2, 2], [33, 1, 8])],
}
REDUCE_SCATTER: dict[int, list[tuple[list[int] | None, tuple[int, ...]]]] = {
    2: [([3, 0], (5,)), (None, (4,)), ([1, 4], ()), ([2, 1], (3, 2))],
    3: [([2, 0, 3], (5,)), (None, (7,)), ([0, 4, 1], ()), ([1, 1, 2], (2, 3))],
}
ALL_GATHER: dict[int, list[tuple[list[int], tuple[int, ...]]]] = {
    2: [([3, 0], (5,)), ([2, 2], (4,)), ([1, 4], ()), ([2, 1], (3, 2))],
    3: [([2, 0, 3], (5,)), ([0, 4, 1], ()), ([1, 1, 2], (2, 33))],
}
SEQUENCE: dict[int, list[tuple[list[list[int]], tuple[int, ...]]]] = {
    2: [([[2, 0], [3, 1]], (5,)), ([[0, 0], [4, 2]], (3,)), ([[1, 2], [2, 1]], (2, 3))],
    3: [([[2, 0, 1], [0, 0, 3], [1, 2, 0]], (5,)), ([[1, 1, 1], [2, 0, 2], [0, 3, 1]], (33,))],
}


# --------------------------------------------------------------------------
# Many checks in one spawn.


def run_all(checks: Sequence[Callable[[], object]]) -> None:
    """Runs every check, then raises one AssertionError naming all that failed.

    Stopping at the first failed check would skip collectives that the other
    ranks (whose checks passed) do run, and the group would fall out of step.
    """
    failures = []
    for i, check in enumerate(checks):
        try:
            check()
        except AssertionError as err:
            failures.append(f"check {i}: {err}")
    if failures:
        raise AssertionError("\n".join(failures))


def expect(error: type[Exception], words: tuple[str, ...], fn: Callable[[], Any]) -> None:
    """Runs ``fn``, expecting ``error`` with every one of ``words`` in its message."""
    try:
        fn()
    except error as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"{error.__name__} message {str(err)!r} lacks {missing}"
        return
    except Exception as err:
        raise AssertionError(f"expected {error.__name__} naming {words}, got {err!r}") from err
    raise AssertionError(f"expected {error.__name__} naming {words}, nothing was raised")
