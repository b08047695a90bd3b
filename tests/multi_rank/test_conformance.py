"""The conformance kit: it passes correct codecs and names the rule a broken one breaks."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import pickle
import textwrap
import types
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from fake_dists import activate, make_dist

import qcomm
from qcomm import CodecError, CodecInfo, NoOpQuantizedCommCodec
from qcomm.cli import main as cli_main
from qcomm.testing import RULES, CodecReport, ConformanceError, check_codec

pytest_plugins = ["pytester"]

EXAMPLE_TESTS = pathlib.Path(__file__).parents[2] / "plugins" / "example_codec" / "tests"


class HalfCodec:
    """A correct codec to break in one place at a time: float16 with saturation.

    Round to nearest keeps 11 significant bits (error <= 2**-11 |x|); below
    float16's normal range the absolute error is at most half its smallest
    subnormal, 2**-25; above 65504 it saturates.
    """

    def __init__(self) -> None:
        self.info = CodecInfo(
            name=type(self).__name__,
            bits_per_element=16.0,
            summable=True,
            rel_error_bound=2.0**-11,
            abs_error_bound=2.0**-25,
            max_abs_input=65504.0,
        )

    @property
    def quantized_dtype(self):
        return torch.float16

    def encode(self, input_tensor, ctx=None):
        return input_tensor.reshape(-1).float().clamp(-65504.0, 65504.0).half()

    def decode(self, input_grad, ctx=None):
        return input_grad.float()

    def decode_into(self, input_grad, out, ctx=None):
        out.copy_(input_grad.view(out.shape))

    def calc_quantized_size(self, input_len, ctx=None):
        return input_len

    def create_context(self):
        return None

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
        return dim_per_rank[my_rank], 0

    def round_trip_error(self, input_tensor):
        x = input_tensor.reshape(-1).double()
        lost = self.decode(self.encode(input_tensor)).double() - x
        return float(lost.norm() / x.norm()), float(lost.abs().max() / x.abs().max())


class DecodeIntoIgnoresStrides(HalfCodec):
    # reshape(-1) of a band of columns is a copy: the values never arrive.
    def decode_into(self, input_grad, out, ctx=None):
        out.reshape(-1).copy_(input_grad)


class DecodeIntoSpills(HalfCodec):
    # Clears one column too many: the one right of a band.
    def decode_into(self, input_grad, out, ctx=None):
        if out.dim() == 2 and out.stride(1) == 1 and out.stride(0) > out.shape[1]:
            wider = out.as_strided((out.shape[0], out.shape[1] + 1), out.stride())
            wider.zero_()
        out.copy_(input_grad.view(out.shape))


class RoundTripErrorOfRowsOnly(HalfCodec):
    # Measures the first row of a 2-D input alone.
    def round_trip_error(self, input_tensor):
        return super().round_trip_error(
            input_tensor[0] if input_tensor.dim() == 2 else input_tensor
        )


class RoundTripErrorNotAPair(HalfCodec):
    def round_trip_error(self, input_tensor):
        return [0.0, 0.0]


class LyingSize(HalfCodec):
    def calc_quantized_size(self, input_len, ctx=None):
        return input_len + input_len % 2


class WrongDtype(HalfCodec):
    def encode(self, input_tensor, ctx=None):
        return input_tensor.reshape(-1).bfloat16()


class MethodDtype(HalfCodec):
    def quantized_dtype(self):  # as in TorchRec's own no-op codec
        return torch.float16


class BeyondBound(HalfCodec):
    def decode(self, input_grad, ctx=None):
        return input_grad.float() * (1 + 2.0**-9)


class MutatesInput(HalfCodec):
    def encode(self, input_tensor, ctx=None):
        return super().encode(input_tensor.mul_(2.0))

    def decode(self, input_grad, ctx=None):
        return input_grad.float() / 2


class Nondeterministic(HalfCodec):
    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, rel_error_bound=2.0**-9)

    def encode(self, input_tensor, ctx=None):
        x = input_tensor.reshape(-1).float()
        return (x * (1 + (torch.rand_like(x) - 0.5) * 2.0**-12)).half()


class NeedsContext(HalfCodec):
    def create_context(self):
        return types.SimpleNamespace()

    def encode(self, input_tensor, ctx=None):
        if ctx is None:
            raise AttributeError("'NoneType' object has no attribute 'row_dim'")
        return super().encode(input_tensor)


class ScaleInContext(HalfCodec):
    """Keeps the scale in the context instead of sending it: only the sender
    can decode."""

    def create_context(self):
        return types.SimpleNamespace(scale=1.0)

    def encode(self, input_tensor, ctx=None):
        x = input_tensor.reshape(-1).float()
        scale = float(x.abs().max()) if x.numel() else 1.0
        scale = scale or 1.0
        if ctx is not None:
            ctx.scale = scale
        return (x / scale).half()

    def decode(self, input_grad, ctx=None):
        return input_grad.float() * (ctx.scale if ctx is not None else 1.0)


class HeaderWord(HalfCodec):
    """One header word in front of the whole wire: sizes do not add up."""

    def encode(self, input_tensor, ctx=None):
        return torch.cat([torch.ones(1, dtype=torch.float16), super().encode(input_tensor)])

    def decode(self, input_grad, ctx=None):
        return input_grad[1:].float()

    def calc_quantized_size(self, input_len, ctx=None):
        return input_len + 1


class InconsistentPadding(HalfCodec):
    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
        return dim_per_rank[my_rank] + 3, 0


class PadsWithoutRecording(HalfCodec):
    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
        return dim_per_rank[my_rank] + 1, 1


class WrongBits(HalfCodec):
    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, bits_per_element=8.0)


class SumOverflows(HalfCodec):
    """Claims summable, but a wire of biased uint8 codes does not add up."""

    def __init__(self) -> None:
        super().__init__()
        # Steps of 0.01 on [-1, 1]: rounding is off by at most 0.005.
        self.info = CodecInfo(
            "SumOverflows",
            8.0,
            summable=True,
            rel_error_bound=0.0,
            abs_error_bound=0.005,
            max_abs_input=1.0,
        )

    @property
    def quantized_dtype(self):
        return torch.uint8

    def encode(self, input_tensor, ctx=None):
        x = input_tensor.reshape(-1).float()
        return (x.clamp(-1, 1) * 100 + 128).round().to(torch.uint8)

    def decode(self, input_grad, ctx=None):
        return (input_grad.float() - 128) / 100


class NoContext(HalfCodec):
    create_context = None  # type: ignore[assignment]  # a partial port of some other codec


class Foreign:
    """A codec from elsewhere: no ``info``, so no bound is promised."""

    @property
    def quantized_dtype(self):
        return torch.bfloat16

    def encode(self, input_tensor, ctx=None):
        return input_tensor.reshape(-1).bfloat16()

    def decode(self, input_grad, ctx=None):
        return input_grad.float()

    def calc_quantized_size(self, input_len, ctx=None):
        return input_len

    def create_context(self):
        return None

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
        return dim_per_rank[my_rank], 0


class ForeignMakesNaN(Foreign):
    def decode(self, input_grad, ctx=None):
        y = input_grad.float()
        return torch.where(y.abs() > 1e20, math.nan, y)


BROKEN = [
    (LyingSize, "size", r"calc_quantized_size\(1\) is 2 .* but encode of 1 elements returned 1"),
    (WrongDtype, "dtype", r"returned dtype torch.bfloat16, but quantized_dtype is torch.float16"),
    (MethodDtype, "dtype", "quantized_dtype is a method"),
    (BeyondBound, "round_trip", r"element \d+ is .* but decodes to .* declared bound there is"),
    (MutatesInput, "no_mutation", r"encode\(<normal data, \d+ x float32>.* changed its input"),
    (Nondeterministic, "determinism", "gave different wire bytes"),
    (
        NeedsContext,
        "ctx",
        r"encode\(<normal data, 128 x float32>, ctx=None\) raised AttributeError",
    ),
    (ScaleInContext, "ctx", "must travel in-band"),
    (HeaderWord, "additive", r"gives \[2, 3, 1, 4, 2\], summing to 12, but 8"),
    (InconsistentPadding, "padded_size", r"returned \(10, 0\) for a width of 7"),
    (PadsWithoutRecording, "padded_size", "records no ctx.padded_dim_sum_per_rank"),
    (WrongBits, "bits", "declares 8 bits per element, but .* take 16 bits each"),
    (SumOverflows, "summable", r"decode\(encode\(a\) \+ encode\(b\)\) against a \+ b"),
    (ForeignMakesNaN, "round_trip", "decodes to nan"),
    (NoContext, "dtype", r"create_context\(\) raised TypeError: 'NoneType' object is not callable"),
    (DecodeIntoIgnoresStrides, "decode_into", "columns .* wrote -12345.0 at element 0"),
    (DecodeIntoSpills, "decode_into", "wrote outside the band"),
    (RoundTripErrorOfRowsOnly, "round_trip_error", r"band of a wider matrix>\) gave the relative"),
    (RoundTripErrorNotAPair, "round_trip_error", r"returned \[0.0, 0.0\], expected two floats"),
]


def test_correct_fake_passes_every_rule():
    report = check_codec(HalfCodec())
    assert report.rules == RULES and report.skipped == ()
    assert 0.5 < report.worst_error <= 1.0  # fp16 rounding reaches its bound
    assert report.info.name == "HalfCodec" and 100_003 in report.lengths


@pytest.mark.parametrize(
    ("codec_type", "rule", "message"), BROKEN, ids=[b[0].__name__ for b in BROKEN]
)
def test_broken_codec_fails_its_rule(codec_type, rule, message):
    with pytest.raises(ConformanceError, match=message) as caught:
        check_codec(codec_type())
    assert caught.value.rule == rule
    name = codec_type.__name__
    assert str(caught.value).startswith(f"codec {name!r} breaks rule {rule!r}: ")
    assert isinstance(caught.value, CodecError)
    assert pickle.loads(pickle.dumps(caught.value)).rule == rule  # crosses process boundaries


def test_noop_passes():
    report = check_codec(qcomm.load_codec("noop"))
    assert report.codec == "noop" and report.rules == RULES[:-1]
    assert report.skipped == ("round_trip_error (no round_trip_error)",)
    assert report.worst_error == 0.0
    assert str(report).startswith("noop: 12 rules passed (dtype, ctx, ")


def test_example_plugin_is_discovered_and_passes():
    (entry,) = qcomm.codec_entries()["example_fp16_scaled"]
    assert entry.distribution == "qcomm-example-codec"
    assert entry.value == "qcomm_example_codec.codec:ScaledFP16Codec"
    codec = qcomm.load_codec("example_fp16_scaled:block_size=16")
    report = check_codec(codec)
    # The base class gives it decode_into too (and no round_trip_error).
    assert report.skipped == (
        "summable (not declared summable)",
        "round_trip_error (no round_trip_error)",
    )
    assert 0.5 < report.worst_error <= 1.0
    # Lengths around its block of 16 are among those checked.
    assert {15, 16, 17, 31, 33, 167} <= set(report.lengths)


def test_example_plugin_is_held_to_a_tighter_bound_it_does_not_keep():
    codec: Any = qcomm.load_codec("example_fp16_scaled")
    codec.info = dataclasses.replace(codec.info, rel_error_bound=2.0**-12)
    with pytest.raises(ConformanceError, match="rule 'round_trip'"):
        check_codec(codec)


def test_foreign_codec_without_info_is_held_to_finiteness():
    report = check_codec(Foreign())
    assert math.isnan(report.worst_error)
    assert "no error bound declared" in str(report)
    assert "bits (no CodecInfo declared)" in report.skipped


def test_stochastic_codec_skips_determinism_only():
    codec = Nondeterministic()
    codec.info = dataclasses.replace(codec.info, stochastic=True)
    report = check_codec(codec)
    assert "determinism" not in report.rules and "additive" in report.rules
    assert "determinism (the codec declares stochastic)" in report.skipped


def test_lengths_and_seed_are_honoured():
    report = check_codec(HalfCodec(), lengths=[0, 3, 5], seed=7)
    assert report.lengths == (0, 3, 5)
    with pytest.raises(ConformanceError, match=r"calc_quantized_size\(3\) is 4"):
        check_codec(LyingSize(), lengths=[0, 4, 3])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [3, -1]}, r"lengths must be non-negative ints, got \[-1\]"),
        ({"block": 0}, "block must be a positive int, got 0"),
        ({"device": "meta"}, "device 'meta' is not among the devices 'noop' declares"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_codec(NoOpQuantizedCommCodec(), **kwargs)


class HugeBlock(HalfCodec):
    """Declares a block of 2**32 elements (as int8 did for row_dim=2**32)."""

    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, error_block=2**32)


def test_a_block_too_large_to_test_is_a_clear_error():
    # The kit's own inputs, 128 blocks long, would take 4 TiB: refused with
    # the reason, before any is built.
    with pytest.raises(
        ValueError, match=r"block 4294967296 \(CodecInfo.error_block of 'HugeBlock'\)"
    ):
        check_codec(HugeBlock())
    with pytest.raises(ValueError, match=r"block 1099511627776 .*too large"):
        check_codec(NoOpQuantizedCommCodec(), block=2**40)
    with pytest.raises(ValueError, match=r"lengths: 10000000000000 .*too large"):
        check_codec(NoOpQuantizedCommCodec(), lengths=[3, 10**13])


def test_report_str_lists_rules_and_bound():
    report = CodecReport(
        codec="x",
        info=CodecInfo("x", 8.0),
        rules=("dtype", "size"),
        skipped=("bits (why)",),
        lengths=(1,),
        worst_error=0.25,
    )
    assert str(report) == (
        "x: 2 rules passed (dtype, size); worst round-trip error 0.25 of the declared bound; "
        "skipped: bits (why)"
    )


# -- the shell and the pytest fixture --------------------------------------------


@pytest.fixture
def broken_dist(tmp_path, monkeypatch):
    """A throw-away distribution registering a codec whose size lies."""
    source = textwrap.dedent(
        """
        import torch

        class Codec:
            quantized_dtype = property(lambda self: torch.float32)

            def encode(self, input_tensor, ctx=None):
                return input_tensor.reshape(-1)

            def decode(self, input_grad, ctx=None):
                return input_grad

            def calc_quantized_size(self, input_len, ctx=None):
                return input_len + 1

            def create_context(self):
                return None

            def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
                return dim_per_rank[my_rank], 0
        """
    )
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "liar-codecs", "liar_mod", source, {"liar": "Codec"})
    activate(tmp_path, monkeypatch)


def test_cli_check(broken_dist, capsys):
    assert cli_main(["check", "noop", "example_fp16_scaled"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok   noop: 12 rules passed")
    assert out[1].startswith("ok   example_fp16_scaled: 11 rules passed")
    assert cli_main(["check", "noop", "liar", "no_such_codec"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok   noop")
    assert out[1].startswith("FAIL liar: codec 'Codec' breaks rule 'size': calc_quantized_size(0)")
    assert out[2].startswith("FAIL no_such_codec: unknown codec 'no_such_codec'")


def test_pytest_fixture(pytester):
    pytester.makepyfile(
        test_author="""
        import torch
        from qcomm import NoOpQuantizedCommCodec

        class Liar(NoOpQuantizedCommCodec):
            def calc_quantized_size(self, input_len, ctx=None):
                return input_len + 1

        def test_good(qcomm_check_codec):
            assert qcomm_check_codec(NoOpQuantizedCommCodec()).rules[0] == "dtype"

        def test_liar(qcomm_check_codec):
            qcomm_check_codec(Liar())
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*ConformanceError: codec 'noop' breaks rule 'size'*"])


def test_example_plugin_suite_uses_the_fixture(pytester):
    result = pytester.runpytest_inprocess(str(EXAMPLE_TESTS), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8)


def _example_codec_in_torchrec(rank: int, world_size: int) -> list[float]:
    from torchrec.distributed.comm_ops import alltoall_pooled
    from torchrec.distributed.types import QuantizedCommCodecs

    codecs = QuantizedCommCodecs(
        forward=qcomm.load_codec("example_fp16_scaled:block_size=8"),
        backward=qcomm.load_codec("example_fp16_scaled:block_size=8"),
    )
    batches = [3, 2]
    ratios = []
    # Widths 5 and 11 need padding to whole blocks on the forward pass;
    # TorchRec's backward pass never pads, so there the widths are whole blocks.
    for dims, backward in (([5, 11], False), ([8, 16], True)):
        gen = torch.Generator().manual_seed(sum(dims))
        inputs = [torch.randn(sum(batches), d, generator=gen) * 100 for d in dims]
        grads = [torch.randn(b, sum(dims), generator=gen) for b in batches]
        x = inputs[rank].clone().requires_grad_()
        out = alltoall_pooled(x, batches, dims, codecs=codecs).wait()
        rows = slice(sum(batches[:rank]), sum(batches[: rank + 1]))
        expected = torch.cat([inp[rows] for inp in inputs], dim=1)
        # A block's largest magnitude is at most its sender's largest one.
        bound = torch.cat(
            [
                torch.full((batches[rank], d), 2.0**-11 * float(inp.abs().max()))
                for d, inp in zip(dims, inputs)
            ],
            dim=1,
        )
        ratios.append(float(((out.detach() - expected).abs() / bound).max()))
        if backward:
            out.backward(grads[rank])
            cols = slice(sum(dims[:rank]), sum(dims[: rank + 1]))
            # TorchRec divides gradients by the world size after decoding.
            expected = torch.cat([g[:, cols] for g in grads]) / world_size
            limit = torch.cat(
                [
                    torch.full((g.shape[0], dims[rank]), 2.0**-11 * float(g.abs().max()))
                    for g in grads
                ]
            )
            assert x.grad is not None
            ratios.append(float(((x.grad - expected).abs() / (limit / world_size)).max()))
    return ratios


def test_example_codec_runs_through_torchrec_pooled_all_to_all():
    pytest.importorskip("torchrec")
    for ratios in run_ranks(_example_codec_in_torchrec, 2):
        assert len(ratios) == 3 and max(ratios) <= 1.0
