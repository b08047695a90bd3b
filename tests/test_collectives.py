"""The three collectives on 2 and 3 gloo ranks, on both transports, against
references computed without qcomm.

Every rank generates every rank's inputs and output gradients from fixed seeds,
so each rank computes its expected output and input gradient with plain local
torch and checks its own. One spawn per world size and transport (forced with
``QCOMM_TRANSPORT``: gloo's point-to-point, and the all-to-all NCCL takes) runs
every case; each case is reported as its own test, which also checks that its
calls opened the transport it names and no other.

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
  per-tensor header, a foreign codec without ``info``, and codecs that lie.

The last tests check the multi-rank helper itself (``dist_utils.run_ranks``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from codec_names import suite_codecs
from dist_utils import (
    TRANSPORTS,
    Outcome,
    RankFailure,
    check_case,
    outcomes_per_world_size,
    run_ranks,
    transport_env,
    wrong_transport,
)

import qcomm
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives import all_gather_pooled

WORLD_SIZES = (2, 3)
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


class LyingCodec(ForeignIdentityCodec):
    """Breaks one promise, chosen by ``lie``."""

    def __init__(self, lie: str) -> None:
        self.lie = lie
        self.info = CodecInfo(name=f"liar_{lie}", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        x = input_tensor.reshape(-1)
        if self.lie == "size":
            return torch.cat([x, x.new_zeros(1)])
        if self.lie == "dtype":
            return x.double()
        return x

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad[1:] if self.lie == "decode" and input_grad.numel() else input_grad

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return -1 if self.lie == "calc" else input_len


class CudaOnlyCodec(ForeignIdentityCodec):
    def __init__(self) -> None:
        self.info = CodecInfo(name="cuda_only", bits_per_element=32, devices=("cuda",))


LOCAL_CODECS: dict[str, Callable[[], Any]] = {
    "test_fp16": CastFP16Codec,
    "test_row_int8": RowInt8Codec,
    "test_tensor_int8": TensorInt8Codec,
}
# The built-in codecs and the example plugin's (tests/codec_names.py; other
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


def case_noop(rank: int, world: int) -> None:
    run_all(
        [
            *(
                functools.partial(check_pooled, rank, world, b, d, f"np{i}", None)
                for i, (b, d) in enumerate(POOLED[world])
            ),
            *(
                functools.partial(check_reduce_scatter, rank, world, sp, rest, f"nr{i}", None)
                for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
            ),
            *(
                functools.partial(check_sequence, rank, world, m, rest, f"ns{i}", None)
                for i, (m, rest) in enumerate(SEQUENCE[world])
            ),
        ]
    )


def case_noop_dtypes_and_division(rank: int, world: int) -> None:
    # Without codecs a float16 tensor travels as float16 and comes back as is.
    batches, dims = POOLED[world][0]
    splits, rest = REDUCE_SCATTER[world][0]
    matrix, width = SEQUENCE[world][0]
    run_all(
        [
            functools.partial(check_pooled, rank, world, batches, dims, "nh", None, torch.float16),
            functools.partial(check_pooled, rank, world, batches, dims, "nd", None, division=True),
            functools.partial(
                check_reduce_scatter, rank, world, splits, rest, "rh", None, None, torch.float16
            ),
            functools.partial(
                check_reduce_scatter, rank, world, splits, rest, "rd", None, division=True
            ),
            functools.partial(
                check_sequence, rank, world, matrix, width, "sh", None, None, torch.bfloat16
            ),
        ]
    )


def case_foreign_identity(rank: int, world: int) -> None:
    # No info: reduce-scatter goes through the all-to-all and a float32 sum,
    # every block is encoded on its own; still exact.
    codecs = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=ForeignIdentityCodec())
    run_all(
        [
            *(
                functools.partial(
                    check_reduce_scatter, rank, world, sp, rest, f"fr{i}", None, codecs
                )
                for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
            ),
            *(
                functools.partial(check_sequence, rank, world, m, rest, f"fs{i}", None, codecs)
                for i, (m, rest) in enumerate(SEQUENCE[world])
            ),
        ]
    )


def case_codec_pooled(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_pooled, rank, world, b, d, f"cp{i}", codec)
            for i, (b, d) in enumerate(POOLED[world])
        ]
    )


def case_codec_reduce_scatter(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_reduce_scatter, rank, world, sp, rest, f"cr{i}", codec)
            for i, (sp, rest) in enumerate(REDUCE_SCATTER[world])
        ]
    )


def case_codec_all_gather(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_all_gather, rank, world, sp, rest, f"ca{i}", codec)
            for i, (sp, rest) in enumerate(ALL_GATHER[world])
        ]
    )


def case_all_gather_exact_and_checked(rank: int, world: int) -> None:
    # The first call on the group is checked: ranks that disagree on the
    # blocks raise, naming what differs, like on any collective.
    mine = 1 if rank == 0 else 2  # rank 0 sees its own block as one row
    with pytest.raises(CodecError, match="output_splits"):
        all_gather_pooled(torch.ones(mine, 3), output_splits=[mine] + [2] * (world - 1)).wait()
    with pytest.raises(
        ValueError, match=r"output_splits: this rank's block is input.shape\[0\] = 4"
    ):
        all_gather_pooled(torch.ones(4, 3), output_splits=[1] * world)
    # Without codecs: exact both ways; equal blocks by default.
    for i, (splits, rest) in enumerate(ALL_GATHER[world]):
        check_all_gather(rank, world, splits, rest, f"ae{i}", None)
    x = gen("ae:eq", (2, 3), True)
    out = all_gather_pooled(x).wait()
    assert out.shape == (2 * world, 3) and torch.equal(out[2 * rank : 2 * rank + 2], x)


def case_codec_sequence(rank: int, world: int, codec: str) -> None:
    run_all(
        [
            functools.partial(check_sequence, rank, world, m, rest, f"cs{i}", codec)
            for i, (m, rest) in enumerate(SEQUENCE[world])
        ]
    )


def overlapped_calls(world: int) -> list[tuple[str, str | None, int]]:
    ops = ("pooled", "reduce_scatter", "sequence")
    codecs = (None, "test_fp16", "test_row_int8", "test_tensor_int8")
    return [(ops[i % 3], codecs[i % 4], i) for i in range(20)]


def start_call(
    rank: int, world: int, op: str, codec: str | None, i: int
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    codecs = pair(codec) if codec else None
    if op == "pooled":
        batches, dims = POOLED[world][i % len(POOLED[world])]
        x = gen(f"o{i}:{rank}", (sum(batches), dims[rank]), False).requires_grad_(True)
        pending = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs)
        g = gen(f"og{i}:{rank}", (batches[rank], sum(dims)), False)
    elif op == "reduce_scatter":
        splits, rest = REDUCE_SCATTER[world][i % len(REDUCE_SCATTER[world])]
        sizes = splits if splits is not None else [2] * world
        x = gen(f"o{i}:{rank}", (sum(sizes), *rest), False).requires_grad_(True)
        pending = qcomm.reduce_scatter_pooled(x, input_splits=splits, codecs=codecs)
        g = gen(f"og{i}:{rank}", (sizes[rank], *rest), False)
    else:
        matrix, rest = SEQUENCE[world][i % len(SEQUENCE[world])]
        received = sum(matrix[k][rank] for k in range(world))
        x = gen(f"o{i}:{rank}", (sum(matrix[rank]), *rest), False).requires_grad_(True)
        pending = qcomm.all_to_all_sequence(
            x,
            input_splits=matrix[rank],
            output_splits=[matrix[k][rank] for k in range(world)],
            codecs=codecs,
        )
        g = gen(f"og{i}:{rank}", (received, *rest), False)
    return x, pending, g


def case_overlapped(rank: int, world: int) -> None:
    calls = overlapped_calls(world)
    sequential = []
    for op, codec, i in calls:
        x, pending, g = start_call(rank, world, op, codec, i)
        out = pending.wait()
        (out * g).sum().backward()
        assert x.grad is not None
        sequential.append((out.detach(), x.grad))
    started = [start_call(rank, world, op, codec, i) for op, codec, i in calls]
    # Waited for in reverse order, while all 20 are in flight.
    outs = [pending.wait() for _, pending, _ in reversed(started)][::-1]
    loss = sum((out * g).sum() for out, (_, _, g) in zip(outs, started))
    loss.backward()  # type: ignore[union-attr]
    assert outs[0] is started[0][1].wait(), "a second wait() must return the same tensor"
    for (op, codec, i), out, (x, _, _), (ref_out, ref_grad) in zip(
        calls, outs, started, sequential
    ):
        assert_equal(f"call {i} ({op}, {codec}) output", out.detach(), ref_out)
        assert x.grad is not None
        assert_equal(f"call {i} ({op}, {codec}) input gradient", x.grad, ref_grad)


def case_buffer_reuse(rank: int, world: int) -> None:
    # Receive buffers of 1 MiB and more are kept and reused between calls:
    # calls that size, one after the other and several in flight at once,
    # must not see each other's data.
    batches = [300 + k for k in range(world)]
    dims = [520 + 8 * k for k in range(world)]
    matrix = [[150 + 7 * k + r for r in range(world)] for k in range(world)]
    foreign = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=ForeignIdentityCodec())
    checks: list[Callable[[], None]] = []
    for i in range(2):
        checks += [
            functools.partial(check_pooled, rank, world, batches, dims, f"bp{i}", None),
            functools.partial(
                check_reduce_scatter, rank, world, batches, (520,), f"br{i}", None, foreign
            ),
            functools.partial(check_sequence, rank, world, matrix, (520,), f"bs{i}", None, foreign),
            functools.partial(
                check_reduce_scatter, rank, world, batches, (520,), f"bf{i}", "test_fp16"
            ),
        ]
    run_all(checks)
    xs = [
        [gen(f"bf{i}:{k}", (sum(batches), dims[k]), True) for k in range(world)] for i in range(4)
    ]
    pending = [qcomm.all_to_all_pooled(x[rank], batches, dims) for x in xs]
    outs = [p.wait() for p in reversed(pending)][::-1]
    rows = offsets(batches)
    for i, (x, out) in enumerate(zip(xs, outs)):
        ref = torch.cat([xk[rows[rank] : rows[rank + 1]] for xk in x], dim=1)
        assert_equal(f"call {i} in flight", out, ref)
    # Without codecs a sequence all-to-all returns its receive buffer itself:
    # that one must never be reused while the caller holds it.
    column = [matrix[k][rank] for k in range(world)]
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(3):
        x = [gen(f"bh{i}:{k}", (sum(matrix[k]), 1040), True) for k in range(world)]
        call = qcomm.all_to_all_sequence(x[rank], input_splits=matrix[rank], output_splits=column)
        sent = [offsets(matrix[k]) for k in range(world)]
        ref = torch.cat([x[k][sent[k][rank] : sent[k][rank + 1]] for k in range(world)])
        held.append((call.wait(), ref))
    for i, (out, ref) in enumerate(held):
        assert_equal(f"held output {i}", out, ref)


def expect(error: type[Exception], words: tuple[str, ...], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except error as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"{error.__name__} message {str(err)!r} lacks {missing}"
        return
    except Exception as err:
        raise AssertionError(f"expected {error.__name__} naming {words}, got {err!r}") from err
    raise AssertionError(f"expected {error.__name__} naming {words}, nothing was raised")


def case_validation(rank: int, world: int) -> None:
    batches, dims = [2] * world, [3] * world
    x = torch.zeros(sum(batches), dims[rank])
    # Typed Any: the cases call them with arguments of the wrong types on purpose.
    a2a: Any = qcomm.all_to_all_pooled
    rs: Any = qcomm.reduce_scatter_pooled
    seq: Any = qcomm.all_to_all_sequence
    ones = [1] * world
    cases: list[tuple[type[Exception], tuple[str, ...], Callable[[], Any]]] = [
        (TypeError, ("input", "Tensor"), lambda: a2a([[0.0]], batches, dims)),
        (TypeError, ("input", "int64"), lambda: a2a(x.long(), batches, dims)),
        (ValueError, ("input", "2-D"), lambda: a2a(x.view(-1), batches, dims)),
        (ValueError, ("batch_size_per_rank", f"({world})"), lambda: a2a(x, batches + [0], dims)),
        (ValueError, ("batch_size_per_rank[0]", "-1"), lambda: a2a(x, [-1] + batches[1:], dims)),
        (TypeError, ("batch_size_per_rank[0]", "float"), lambda: a2a(x, [2.0] + batches[1:], dims)),
        (TypeError, ("batch_size_per_rank[0]", "bool"), lambda: a2a(x, [True] * world, dims)),
        (TypeError, ("batch_size_per_rank", "int"), lambda: a2a(x, 2, dims)),
        (ValueError, ("batch_size_per_rank", "summing"), lambda: a2a(x, ones, dims)),
        (
            ValueError,
            (f"dim_sum_per_rank[{rank}]", "input.shape[1]"),
            lambda: a2a(x, batches, [4] * world),
        ),
        (TypeError, ("codecs", "object"), lambda: a2a(x, batches, dims, codecs=object())),
        (
            TypeError,
            ("codecs.forward", "encode"),
            lambda: a2a(x, batches, dims, codecs=QuantizedCommCodecs(forward=object())),
        ),
        (
            CodecError,
            ("cuda_only", "cpu"),
            lambda: a2a(x, batches, dims, codecs=QuantizedCommCodecs(backward=CudaOnlyCodec())),
        ),
        (TypeError, ("gradient_division",), lambda: a2a(x, batches, dims, gradient_division=1)),
        (TypeError, ("group", "str"), lambda: a2a(x, batches, dims, group="world")),
        (ValueError, ("input", "divisible", str(world)), lambda: rs(torch.zeros(world + 1, 2))),
        (ValueError, ("input_splits", "summing"), lambda: rs(x, input_splits=ones)),
        (ValueError, ("input", "0-D"), lambda: rs(torch.tensor(1.0))),
        (TypeError, ("input", "floating"), lambda: rs(torch.zeros(world, dtype=torch.int32))),
        (
            ValueError,
            ("output_splits", f"({world})"),
            lambda: seq(x, input_splits=batches, output_splits=[1]),
        ),
        (
            ValueError,
            ("input_splits", "input.shape[0]"),
            lambda: seq(x, input_splits=ones, output_splits=ones),
        ),
        (
            TypeError,
            ("output_splits[1]", "str"),
            lambda: seq(x, input_splits=batches, output_splits=[1, "1"] + [1] * (world - 2)),
        ),
    ]
    run_all([functools.partial(expect, error, words, fn) for error, words, fn in cases])
    # A CPU tensor on an NCCL group (the backend is faked: this machine has no
    # GPU). Forced point-to-point (gloo's) is refused first, by the transport.
    words: tuple[str, ...] = ("input", "nccl", "cpu")
    if os.environ.get("QCOMM_TRANSPORT") == "point_to_point":
        words = ("QCOMM_TRANSPORT=point_to_point", "gloo", "nccl", "cpu")
    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment,return-value]
    try:
        expect(ValueError, words, lambda: a2a(x, batches, dims))
    finally:
        dist.get_backend = real_get_backend
    # Nothing was sent by the failed calls: the group is still in step.
    check_pooled(rank, world, POOLED[world][0][0], POOLED[world][0][1], "after-validation", None)


def case_lying_codecs(rank: int, world: int) -> None:
    batches, dims = [2] * world, [3] * world
    x = torch.ones(sum(batches), dims[rank])
    checks: list[Callable[[], None]] = []
    for lie, words in (
        ("size", ("liar_size", "calc_quantized_size")),
        ("dtype", ("liar_dtype", "float64")),
        ("calc", ("liar_calc", "non-negative")),
    ):
        codecs = QuantizedCommCodecs(forward=LyingCodec(lie))
        # Raised when called, before anything is sent, on every op.
        calls = [
            functools.partial(qcomm.all_to_all_pooled, x, batches, dims, codecs=codecs),
            functools.partial(qcomm.reduce_scatter_pooled, x, codecs=codecs),
            functools.partial(
                qcomm.all_to_all_sequence,
                x,
                input_splits=batches,
                output_splits=batches,
                codecs=codecs,
            ),
        ]
        checks += [functools.partial(expect, CodecError, words, call) for call in calls]
    run_all(checks)
    # A decode of the wrong length is caught where it happens, on wait().
    codecs = QuantizedCommCodecs(forward=LyingCodec("decode"))
    pending = qcomm.all_to_all_sequence(
        x, input_splits=batches, output_splits=batches, codecs=codecs
    )
    expect(CodecError, ("liar_decode", "decode"), pending.wait)
    check_pooled(rank, world, POOLED[world][0][0], POOLED[world][0][1], "after-lies", None)


CASES: dict[str, Callable[[int, int], None]] = {
    "noop": case_noop,
    "noop_dtypes_and_division": case_noop_dtypes_and_division,
    "foreign_identity": case_foreign_identity,
    "overlapped": case_overlapped,
    "buffer_reuse": case_buffer_reuse,
    "validation": case_validation,
    "lying_codecs": case_lying_codecs,
    "all_gather_exact_and_checked": case_all_gather_exact_and_checked,
}
CODEC_CASES: dict[str, Callable[[int, int, str], None]] = {
    "pooled": case_codec_pooled,
    "reduce_scatter": case_codec_reduce_scatter,
    "sequence": case_codec_sequence,
    "all_gather": case_codec_all_gather,
}
CASE_IDS = [*CASES, *(f"{op}[{codec}]" for codec in CODEC_NAMES for op in CODEC_CASES)]


def run_case(case: str, rank: int, world: int) -> None:
    if case in CASES:
        CASES[case](rank, world)
        return
    op, codec = case.rstrip("]").split("[")
    CODEC_CASES[op](rank, world, codec)


@pytest.fixture(scope="module")
def spawned() -> dict[str, Callable[[int], dict[str, Outcome]]]:
    """Runs every case once per transport and world size, on first use, and remembers the outcome."""
    return {
        transport: outcomes_per_world_size(
            run_case, CASE_IDS, env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport in TRANSPORTS
    }


@pytest.mark.parametrize("case", CASE_IDS)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collectives(
    transport: str,
    world: int,
    case: str,
    spawned: dict[str, Callable[[int], dict[str, Outcome]]],
) -> None:
    outcome = spawned[transport](world)[case]
    check_case(outcome, f"{case} on {world} ranks, {transport}", transport)


# --------------------------------------------------------------------------
# The multi-rank helper itself: failures surface, nothing hangs.


def raise_on_rank_zero(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError(f"rank zero gives up ({os.environ.get('QCOMM_TEST_MARK')})")
    dist.barrier()  # waits for rank 0, which never comes


def exit_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)


def test_run_ranks_reports_the_failing_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(
            raise_on_rank_zero, 2, timeout=60.0, grace=1.0, env={"QCOMM_TEST_MARK": "env set"}
        )
    assert "rank zero gives up (env set)" in info.value.tracebacks[0]
    assert isinstance(info.value.exceptions[0], ValueError)


def test_run_ranks_reports_a_rank_that_dies() -> None:
    with pytest.raises(RankFailure, match="rank 1 exited with code 3"):
        run_ranks(exit_on_rank_one, 2, timeout=60.0)


def test_run_ranks_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        run_ranks(sleep_forever, 2, timeout=5.0)


def test_wrong_transport_names_what_each_rank_opened() -> None:
    assert wrong_transport([{"OneAllToAll": 3}, {"OneAllToAll": 1}], "all_to_all") is None
    assert wrong_transport([{"PointToPoint": 2}] * 2, "point_to_point") is None
    for opened, said in (
        ([{"OneAllToAll": 3}, {"PointToPoint": 3}], "rank 1 opened {'PointToPoint': 3}"),
        ([{"OneAllToAll": 3, "PointToPoint": 1}], "rank 0 opened {'OneAllToAll': 3, 'Point"),
        ([{"OneAllToAll": 3}, {}], "rank 1 opened no transport"),
    ):
        problem = wrong_transport(opened, "all_to_all")
        assert problem is not None and said in problem, problem
        assert "expected only OneAllToAll (QCOMM_TRANSPORT=all_to_all)" in problem
