"""A misspelt operation in a registry string is named as an operation, with
the known names, before any codec is looked at: it is never read as an
option of the codec before it (issue: ``'fp16,reduce_scatter=fp16'`` was
called an unknown codec)."""

from __future__ import annotations

import pytest

import qcomm
from qcomm import CodecError, CommOp

OPS = ", ".join(m.value for m in CommOp)

CASES = [
    # (registry string, the op named, its closest real name)
    (
        "pooled_embeddings_all_to_all=int8/fp16,reduce_scatter=fp16",
        "reduce_scatter",
        "pooled_embeddings_reduce_scatter",
    ),
    (
        "pooled_embeddings_all_to_all=int8/fp16,pooled_embedings_reduce_scatter=fp16",
        "pooled_embedings_reduce_scatter",
        "pooled_embeddings_reduce_scatter",
    ),
    # After a codec with options too: named like an operation, not an option.
    (
        "pooled_embeddings_all_to_all=int8:row_dim=64,sequence_embedings_all_to_all=fp16",
        "sequence_embedings_all_to_all",
        "sequence_embeddings_all_to_all",
    ),
    ("pooled_all_to_all=int8", "pooled_all_to_all", "pooled_embeddings_all_to_all"),
    (
        "pooled_embeddings_all_to_all=same_host=noop+other_host=int8,sequnce_embeddings_all_to_all=bf16",
        "sequnce_embeddings_all_to_all",
        "sequence_embeddings_all_to_all",
    ),
]


@pytest.mark.parametrize(("text", "op", "close"), CASES)
def test_a_misspelt_op_is_named_as_an_op(text: str, op: str, close: str) -> None:
    with pytest.raises(CodecError) as raised:
        qcomm.build_registry(text, allow_unsummable_reduce_scatter=True)
    message = str(raised.value)
    assert f"unknown CommOp {op!r}" in message
    assert f"did you mean {close!r}" in message and OPS in message
    assert "unknown codec" not in message


@pytest.mark.parametrize(("text", "op", "close"), CASES[:2])
def test_the_environment_says_the_same(
    monkeypatch: pytest.MonkeyPatch, text: str, op: str, close: str
) -> None:
    monkeypatch.setenv("QCOMM_CODECS", text)
    with pytest.raises(CodecError, match=f"QCOMM_CODECS.*unknown CommOp '{op}'"):
        qcomm.build_registry(allow_unsummable_reduce_scatter=True)


def test_an_option_after_a_codec_without_a_colon_is_refused() -> None:
    # 'fp16,row_dim=3' is neither an op nor fp16's option: it says how to write one.
    with pytest.raises(CodecError, match=r"'fp16' before it has no colon .*'fp16:row_dim=3'"):
        qcomm.build_registry("fp16,row_dim=3")


@pytest.mark.parametrize(
    "text",
    [
        "pooled_embeddings_all_to_all=int8:row_dim=64/fp16,sequence_embeddings_all_to_all=fp16",
        "pooled_embeddings_all_to_all=int8:row_dim=64,sequence_embeddings_all_to_all=fp16",
        "int8:row_dim=16/bf16",
        "pooled_embeddings_all_to_all=same_host=noop+other_host=int8:row_dim=64",
    ],
)
def test_real_options_and_ops_still_parse(text: str) -> None:
    registry = qcomm.build_registry(text, allow_unsummable_reduce_scatter=True)
    assert set(registry) <= {m.name for m in CommOp} and registry
