"""The one parser of pair specs, ``forward/backward``."""

import pytest

from qcomm.errors import CodecError
from qcomm.specs import parse_pair_spec


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
