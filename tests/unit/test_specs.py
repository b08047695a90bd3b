"""The spec language: codec specs (``name:option=value,...``) and pair specs (``forward/backward``)."""

from __future__ import annotations

import pytest
from fake_dists import load_good

import qcomm
from qcomm import CodecError
from qcomm.specs import parse_pair_spec

_OP = "POOLED_EMBEDDINGS_ALL_TO_ALL"


def test_load_codec_keyword_options_override_spec(plugins):
    assert load_good("good:scale=2", scale=4.0).scale == 4.0


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("int8", ("int8", {})),
        ("int8:row_dim=64", ("int8", {"row_dim": 64})),
        (" mx4 : group_size=32 , rounding=even ", ("mx4", {"group_size": 32, "rounding": "even"})),
        (
            "fp16:loss_scale=0.5,flag=TRUE,off=false",
            ("fp16", {"loss_scale": 0.5, "flag": True, "off": False}),
        ),
        ("x:neg=-3,exp=1e-3", ("x", {"neg": -3, "exp": 1e-3})),
    ],
)
def test_parse_codec_spec(spec, expected):
    assert qcomm.parse_codec_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "  ", ":row_dim=3", "int8:row_dim", "int8:=3"])
def test_parse_codec_spec_rejects_malformed(spec):
    with pytest.raises(CodecError, match="spec|option"):
        qcomm.parse_codec_spec(spec)


@pytest.mark.parametrize(
    "call",
    [
        lambda: qcomm.parse_codec_spec("int8:row_dim=4,row_dim=8"),
        lambda: qcomm.load_codec("int8:row_dim=4, row_dim =8"),
        lambda: qcomm.build_registry(f"{_OP}=int8:row_dim=4,row_dim=8/fp16"),
    ],
)
def test_an_option_given_twice_is_refused(call):
    with pytest.raises(CodecError, match=r"option 'row_dim' is given twice"):
        call()


# Pair specs: the one parser of forward/backward


@pytest.mark.parametrize(
    "text, expected",
    [
        ("int8:row_dim=64/fp16", ("int8:row_dim=64", "fp16")),
        ("bf16", ("bf16", "bf16")),
        (" fp16 / bf16 ", ("fp16", "bf16")),
    ],
)
def test_pair_spec_splits_forward_and_backward(text: str, expected: tuple[str, str]) -> None:
    assert parse_pair_spec(text) == expected


@pytest.mark.parametrize("text", ["int8/fp16/bf16", "/fp16", "fp16/", ""])
def test_malformed_pair_spec_names_where_it_was_given(text: str) -> None:
    with pytest.raises(CodecError, match=r"^build_registry\[x\]: expected 'forward/backward'"):
        parse_pair_spec(text, "build_registry[x]")
