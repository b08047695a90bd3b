"""The example plugin's own tests, as a codec author would write them.

The ``qcomm_check_codec`` fixture comes from qcomm's pytest plugin; nothing is
imported for it. qcomm's suite runs this file (tests/multi_rank/test_conformance.py).
"""

from __future__ import annotations

import pytest
import torch
from qcomm_example_codec import ScaledFP16Codec

import qcomm


@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_conforms(qcomm_check_codec, block_size):
    report = qcomm_check_codec(ScaledFP16Codec(block_size=block_size))
    # The bound is tight: rounding at the top of a block's range reaches it.
    assert 0.5 < report.worst_error <= 1.0


def test_loads_through_its_entry_point(qcomm_check_codec):
    codec = qcomm.load_codec("example_fp16_scaled:block_size=32")
    assert isinstance(codec, ScaledFP16Codec) and codec.block_size == 32
    qcomm_check_codec(codec)


def test_wire_format():
    codec = ScaledFP16Codec(block_size=2)
    x = torch.tensor([3.0, -1.0, 2.0**20, 0.0, 0.75])
    wire = codec.encode(x)
    # Block maxima 3, 2**20, 0.75 are scaled into [2**14, 2**15); the last
    # block is padded with a zero, and decoded whole.
    expected = [-13.0, 3 * 2**13, -(2**13), 6.0, 2**14, 0.0, -15.0, 0.75 * 2**15, 0.0]
    assert wire.tolist() == expected
    assert torch.equal(codec.decode(wire), torch.cat([x, torch.zeros(1)]))


def test_keeps_the_float32_range_that_plain_fp16_loses():
    x = torch.tensor([1e38, -3e-39, 1e-45, 7e4, -65504.0, 1e-7])
    codec = ScaledFP16Codec(block_size=1)
    y = codec.decode(codec.encode(x)).double()
    x = x.double()  # so that the bound of 1e-45 does not underflow
    assert torch.all((y - x).abs() <= 2.0**-11 * x.abs())
    plain = x.float().half().double()
    assert not torch.all((plain - x).abs() <= 2.0**-11 * x.abs())


def test_non_finite_values_propagate_and_spare_their_block():
    x = torch.tensor([float("nan"), 1.5, float("inf"), -2.0, float("-inf"), 0.25])
    y = ScaledFP16Codec(block_size=3).decode(ScaledFP16Codec(block_size=3).encode(x))
    assert y[0].isnan() and y[2] == float("inf") and y[4] == float("-inf")
    assert y[[1, 3, 5]].tolist() == [1.5, -2.0, 0.25]


def test_errors_name_the_argument():
    # The base class checks the arguments and names them.
    codec = ScaledFP16Codec(block_size=4)
    with pytest.raises(ValueError, match="block_size must be an int from 1 to 65536, got 0"):
        ScaledFP16Codec(block_size=0)
    with pytest.raises(
        ValueError, match="block_size must be an int from 1 to 65536, got 4294967296"
    ):
        ScaledFP16Codec(block_size=2**32)
    with pytest.raises(TypeError, match="block_size must be a positive int, got float 2.0"):
        ScaledFP16Codec(block_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_tensor must be a floating-point tensor"):
        codec.encode(torch.arange(3))
    with pytest.raises(ValueError, match="input_grad must have dtype torch.float16"):
        codec.decode(torch.zeros(5))
    with pytest.raises(ValueError, match="length must be a multiple of 5"):
        codec.decode(torch.zeros(6, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"must be \[batch, 4\]"):
        codec.padded_size(torch.zeros(2, 3), [4, 4], 0, codec.create_context())
