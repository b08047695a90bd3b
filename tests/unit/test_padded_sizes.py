r"""
Sizes after ``padded_size``: where a caller declared column padding through
``padded_size`` and then encodes the unpadded rows, a block codec pads them
and counts padded rows, in ``calc_quantized_size`` and in what ``decode``
returns, as fbgemm's codecs do. Two upstream tests call the codecs so:

- TorchRec's ``test_mx4_comm_codec``: ``padded_size`` of a ``[rows, cols]``
  input, ``encode`` of that unpadded input, ``decode`` viewed as ``[rows,
  padded_dim_sum_per_rank[rank]]`` and cut back to ``cols``.
- fbgemm's ``test_quantized_comm_codec``: the same, then ``calc_quantized_size``
  of the padded element count must be the wire's length, and ``decode``
  (viewed as rows, padding columns dropped) must have the input's shape.

Their steps are written here again and run on qcomm's codecs (held to their
declared error bounds) and on fbgemm's own codecs, the reference, where they
run on CPU. Without ``padded_size`` (TorchRec's sequence path) rows are
padded and unpadded by the codec, as before: test_codecs_builtin.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qcomm

SHAPES = [(4, 4), (5, 5), (3, 31), (7, 33), (4, 256), (256, 4), (16, 100), (9, 128), (1, 5)]
QCOMM_SPECS = [
    "noop",
    "fp16",
    "fp16:loss_scale=4.0",
    "bf16",
    "bf16:loss_scale=2.0",
    "fp8_e4m3_tensor",
    "fp8_e4m3",
    "fp8_e4m3:row_dim=4",
    "fp8_e5m2:row_dim=16",
    "int8",
    "int8:row_dim=8",
    "int4",
    "mx4",
    "mx4:group_size=8",
]
# fbgemm's SparseType name and loss scale, as in its test; row-wise FP8 has
# no CPU kernel, so FP8 is its tensor-wise codec there too.
FBGEMM_CASES = [
    ("FP32", None),
    ("FP16", None),
    ("FP16", 4.0),
    ("BF16", None),
    ("BF16", 2.0),
    ("FP8", None),
    ("FP8", 3.0),
    ("INT8", None),
    ("MX4", None),
]
# fbgemm's test's own tolerances for its codecs.
FBGEMM_TOLERANCE = {"FP8": 0.05, "MX4": 0.3}


def _input(shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    return torch.rand(shape, generator=g) * 2 - 1


def _declared_bound(info: qcomm.CodecInfo, rows: torch.Tensor) -> torch.Tensor:
    # |x_hat - x| <= rel * s + abs per element of the rows, s = |x| or the
    # max-abs of the element's block; blocks lie inside rows padded to whole
    # blocks (with zeros here: the edge padding of int4 and int8 repeats an
    # element of the same block, so the max-abs is the same).
    mag = rows.double().abs()
    b = max(1, info.error_block)
    if b > 1:
        r, c = mag.shape
        width = -(-c // b) * b
        padded = torch.nn.functional.pad(mag, (0, width - c)).view(r, width // b, b)
        mag = padded.amax(dim=2, keepdim=True).expand(-1, -1, b).reshape(r, width)[:, :c]
    return info.rel_error_bound * mag + info.abs_error_bound


def _assert_within_bound(codec: Any, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    # x: the rows the codec was given (a 1-D input is one row), y: decoded.
    rows = x if x.dim() == 2 else x.view(1, -1)
    err = (y.double().reshape(rows.shape) - rows.double()).abs()
    bound = _declared_bound(qcomm.codec_info(codec), rows)
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.4g} beyond the bound"


def _torchrec_mx4_steps(codec: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # TorchRec's test_mx4_comm_codec: pad through padded_size, encode the
    # unpadded input, view the decoded rows at the padded width.
    rows, cols = x.shape
    ctx = codec.create_context()
    codec.padded_size(x, [cols], 0, ctx)
    wire = codec.encode(x, ctx)
    out = codec.decode(wire, ctx)
    return wire, out.view(rows, ctx.padded_dim_sum_per_rank[0])[:, :cols]


def _fbgemm_test_steps(codec: Any, x: torch.Tensor) -> torch.Tensor:
    # fbgemm's test_quantized_comm_codec: the decoded input, after checking
    # that calc_quantized_size of the padded element count is the wire's length.
    cols = x.shape[1] if x.dim() == 2 else x.numel()
    ctx = codec.create_context()
    if ctx is not None:
        padded, padding = codec.padded_size(x, [cols], 0, ctx)
    else:
        padded, padding = cols, 0
    wire = codec.encode(x, ctx)
    padded_numel = padded if x.dim() == 1 else padded * x.shape[0]
    size = codec.calc_quantized_size(padded_numel, ctx)
    assert wire.numel() == size, (
        f"calc_quantized_size({padded_numel}) = {size}, the wire holds {wire.numel()}"
    )
    out = codec.decode(wire, ctx)
    if x.dim() == 2 and out.dim() == 1:  # block codecs return 1-D
        out = out.view(x.shape[0], -1)
    if padding:
        out = out[:, :-padding]
    assert out.shape == x.shape
    return out


def _fbgemm_codec(precision: str, loss_scale: float | None = None) -> Any:
    # fbgemm's codec as TorchRec builds it (FbgemmQuantizedCommCodec is
    # fbgemm's QuantizedCommCodec).
    pytest.importorskip("torchrec")
    try:
        from fbgemm_gpu.quantize_comm import QuantizedCommCodec
        from fbgemm_gpu.split_embedding_configs import SparseType
    except Exception as err:  # fbgemm missing or broken
        pytest.skip(f"fbgemm_gpu unavailable: {type(err).__name__}: {err}")
    from torchrec.distributed.fbgemm_qcomm_codec import FbgemmQuantizedCommCodec

    assert FbgemmQuantizedCommCodec is QuantizedCommCodec
    return FbgemmQuantizedCommCodec(getattr(SparseType, precision), loss_scale)


# -- TorchRec's test_mx4_comm_codec ---------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec", ["mx4", "mx4:group_size=8,rounding=floor"])
def test_mx4_decode_after_padded_size_gives_padded_rows(spec: str, shape: tuple[int, int]) -> None:
    codec = qcomm.load_codec(spec)
    x = _input(shape)
    wire, y = _torchrec_mx4_steps(codec, x)
    _assert_within_bound(codec, x, y, f"{spec} {shape}")


@pytest.mark.parametrize("shape", SHAPES)
def test_mx4_after_padded_size_gives_fbgemms_wire_and_values(shape: tuple[int, int]) -> None:
    x = _input(shape)
    ours_wire, ours = _torchrec_mx4_steps(qcomm.load_codec("mx4"), x)
    theirs_wire, theirs = _torchrec_mx4_steps(_fbgemm_codec("MX4"), x)
    assert torch.equal(ours_wire, theirs_wire)
    assert torch.equal(ours, theirs)


# -- fbgemm's test_quantized_comm_codec -----------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec", QCOMM_SPECS)
def test_sizes_and_decode_count_padded_rows_after_padded_size(
    spec: str, shape: tuple[int, int]
) -> None:
    codec = qcomm.load_codec(spec)
    x = _input(shape)
    y = _fbgemm_test_steps(codec, x)
    _assert_within_bound(codec, x, y, f"{spec} {shape}")
    # As fbgemm's test hands int8 its input: flat, whole rows.
    if x.numel() % getattr(codec, "block", 1) == 0:
        flat = x.reshape(-1)
        _assert_within_bound(codec, flat, _fbgemm_test_steps(codec, flat), f"{spec} {shape} 1-D")


def _fbgemm_takes(precision: str, shape: tuple[int, int]) -> bool:
    # fbgemm's test's assumptions: FP8 takes a multiple of 4 columns, INT8 a
    # flat input of whole rows of 32.
    rows, cols = shape
    return not (precision == "FP8" and cols % 4) and not (precision == "INT8" and rows * cols % 32)


@pytest.mark.parametrize(
    "precision, loss_scale, shape",
    [(p, s, shape) for p, s in FBGEMM_CASES for shape in SHAPES if _fbgemm_takes(p, shape)],
)
def test_fbgemm_codecs_pass_the_same_steps(
    precision: str, loss_scale: float | None, shape: tuple[int, int]
) -> None:
    # The reference: fbgemm's codecs on CPU.
    codec = _fbgemm_codec(precision, loss_scale)
    x = _input(shape)
    if precision == "INT8":
        x = x.reshape(-1)
    y = _fbgemm_test_steps(codec, x)
    tol = FBGEMM_TOLERANCE.get(precision, 0.005)
    torch.testing.assert_close(y.reshape(shape), x.reshape(shape), rtol=tol, atol=tol)


# -- TorchRec's pooled all-to-all, encoding unpadded rows ----------------------------


@pytest.mark.parametrize("spec", ["mx4", "int8:row_dim=8", "fp8_e5m2", "int4:row_dim=5"])
def test_splits_by_batch_add_up_when_unpadded_rows_are_encoded(spec: str) -> None:
    # The sender of TorchRec's pooled all-to-all sizes each destination's
    # share as batch x padded width; a caller that leaves the padding to the
    # codec must get the same wire and shares as one that pads itself.
    codec: Any = qcomm.load_codec(spec)  # a BlockCodec: edge_pad, decode_into
    dims, batches = [5, 40, 3], [2, 0, 3]
    for me, width in enumerate(dims):
        x = _input((sum(batches), width))
        ctx = codec.create_context()
        padded, padding = codec.padded_size(x, dims, me, ctx)
        wire = codec.encode(x, ctx)
        if not codec.edge_pad:  # int4 and int8 pad with the row's last element
            padded_ctx = codec.create_context()
            codec.padded_size(x, dims, me, padded_ctx)
            zeros = torch.nn.functional.pad(x, (0, padding))
            assert torch.equal(wire, codec.encode(zeros, padded_ctx))
        splits = [codec.calc_quantized_size(padded * b, ctx) for b in batches]
        assert sum(splits) == wire.numel()
        start = 0
        for b, part in zip(batches, wire.split(splits)):
            rows = codec.decode(part, codec.create_context()).view(b, padded)[:, :width]
            if b:
                _assert_within_bound(codec, x[start : start + b], rows, f"{spec} rank {me}")
            start += b
        # decode_into writes what decode returns: the padded rows.
        out = torch.empty(sum(batches), padded)
        codec.decode_into(wire, out, ctx)
        assert torch.equal(out.view(-1), codec.decode(wire, ctx))
