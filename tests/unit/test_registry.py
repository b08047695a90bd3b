"""build_registry in every form (keywords, mapping, string, QCOMM_CODECS), its reduce-scatter
refusals, and the core types it hands out (CommOp, the no-op pair, codec_info, Awaitable)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qcomm
from qcomm import CodecError, CommOp, NoOpQuantizedCommCodec, QuantizedCommCodecs

ALL_OPS = sorted(op.name for op in CommOp)


# build_registry, in every form


def _kinds(registry):
    return {op: (type(p.forward).__name__, type(p.backward).__name__) for op, p in registry.items()}


def test_build_registry_keywords(plugins):
    registry = qcomm.build_registry(forward="good:scale=2", backward="noop")
    assert sorted(registry) == ALL_OPS
    assert all(isinstance(pair, QuantizedCommCodecs) for pair in registry.values())
    assert _kinds(registry) == {op: ("Codec", "NoOpQuantizedCommCodec") for op in ALL_OPS}
    # Each op gets its own instance: stateful codecs never share state.
    forwards = [pair.forward for pair in registry.values()]
    assert len({id(c) for c in forwards}) == 3
    assert all(c.scale == 2 for c in forwards)


def test_build_registry_keyword_omitted_side_is_noop(plugins):
    registry = qcomm.build_registry(backward="good")
    assert _kinds(registry)["POOLED_EMBEDDINGS_ALL_TO_ALL"] == ("NoOpQuantizedCommCodec", "Codec")


def test_build_registry_mapping_forms(plugins):
    custom = qcomm.load_codec("good:scale=3")
    registry = qcomm.build_registry(
        {
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL: ("good", "noop"),
            "pooled_embeddings_reduce_scatter": "noop/good:scale=5",
            "SEQUENCE_EMBEDDINGS_ALL_TO_ALL": custom,
        }
    )
    assert sorted(registry) == ALL_OPS
    a2a = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert type(a2a.forward).__name__ == "Codec" and isinstance(
        a2a.backward, NoOpQuantizedCommCodec
    )
    assert registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"].backward.scale == 5
    seq = registry["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"]
    assert seq.forward is custom and seq.backward is custom


def test_build_registry_mapping_accepts_codecs_pair_object(plugins):
    pair = QuantizedCommCodecs(forward=qcomm.load_codec("good"))
    registry = qcomm.build_registry({"pooled_embeddings_all_to_all": pair})
    assert registry == {"POOLED_EMBEDDINGS_ALL_TO_ALL": pair}


def test_build_registry_string_form_with_options(plugins):
    registry = qcomm.build_registry(
        "pooled_embeddings_all_to_all=good:scale=2,tag=x/noop, POOLED_EMBEDDINGS_REDUCE_SCATTER=good"
    )
    assert sorted(registry) == ["POOLED_EMBEDDINGS_ALL_TO_ALL", "POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    fwd = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward
    assert (fwd.scale, fwd.tag) == (2, "x")
    rs = registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    # A single spec serves both directions, as two instances.
    assert type(rs.backward).__name__ == "Codec" and rs.forward is not rs.backward


def test_build_registry_reads_environment(plugins, monkeypatch):
    assert qcomm.build_registry() == {}
    monkeypatch.setenv("QCOMM_CODECS", "sequence_embeddings_all_to_all=good/good:scale=7")
    registry = qcomm.build_registry()
    assert list(registry) == ["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"]
    assert registry["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"].backward.scale == 7
    # An explicit argument wins over the environment.
    assert list(qcomm.build_registry({"pooled_embeddings_all_to_all": "noop"})) == [
        "POOLED_EMBEDDINGS_ALL_TO_ALL"
    ]


class _Unsummable(NoOpQuantizedCommCodec):
    """Stands for a scaled format: a codec whose wire cannot be summed."""

    def __init__(self) -> None:
        super().__init__()
        self.info = qcomm.CodecInfo(name="scaled", bits_per_element=8.5, summable=False)


class _Foreign:
    """A codec of someone else's with no ``info``: assumed not summable."""

    encode = NoOpQuantizedCommCodec.encode
    decode = NoOpQuantizedCommCodec.decode
    calc_quantized_size = NoOpQuantizedCommCodec.calc_quantized_size
    create_context = NoOpQuantizedCommCodec.create_context
    padded_size = NoOpQuantizedCommCodec.padded_size
    quantized_dtype = torch.float16


@pytest.mark.parametrize("codec", [_Unsummable(), _Foreign()])
def test_unsummable_reduce_scatter_codec_is_refused(codec, torchrecs_transport):
    rs = "POOLED_EMBEDDINGS_REDUCE_SCATTER"
    for build in (
        lambda **kw: qcomm.build_registry(forward=codec, **kw),
        lambda **kw: qcomm.build_registry({rs: (codec, "noop")}, **kw),
    ):
        with pytest.raises(
            CodecError, match="cannot be the forward codec of POOLED_EMBEDDINGS_REDUCE_SCATTER"
        ):
            build()
        assert build(allow_unsummable_reduce_scatter=True)[rs].forward is codec
    # Anywhere else, and as the reduce-scatter's backward when it keeps the size, it is fine.
    registry = qcomm.build_registry({"pooled_embeddings_all_to_all": codec, rs: ("noop", codec)})
    assert registry[rs].backward is codec


class _Shrinking(_Unsummable):
    """Stands for a block codec whose wire has fewer elements than its input."""

    def calc_quantized_size(self, input_len, ctx=None):
        return (input_len + 1) // 2 + 4


def test_size_changing_reduce_scatter_backward_is_refused(torchrecs_transport):
    rs = "POOLED_EMBEDDINGS_REDUCE_SCATTER"
    with pytest.raises(
        CodecError, match="cannot be the backward codec of POOLED_EMBEDDINGS_REDUCE_SCATTER"
    ):
        qcomm.build_registry({rs: ("noop", _Shrinking())})
    registry = qcomm.build_registry(
        {rs: ("noop", _Shrinking())}, allow_unsummable_reduce_scatter=True
    )
    assert isinstance(registry[rs].backward, _Shrinking)
    # On the all-to-all ops the backward is an all-to-all of wire splits: any size is fine.
    assert qcomm.build_registry({"pooled_embeddings_all_to_all": ("noop", _Shrinking())})


# A refused reduce-scatter codec: the fix is written as the caller wrote the registry

_INT8_FIX = (
    "pooled_embeddings_all_to_all=int8,sequence_embeddings_all_to_all=int8,"
    "pooled_embeddings_reduce_scatter=bf16"
)


def _refusal(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(CodecError, match="POOLED_EMBEDDINGS_REDUCE_SCATTER") as err:
        qcomm.build_registry(*args, **kwargs)
    return str(err.value)


def _suggested(msg: str, prefix: str) -> str:
    """The fix the message suggests after ``e.g. <prefix>``, without a closing bracket."""
    assert f"e.g. {prefix}" in msg, msg
    fix = msg.split(f"e.g. {prefix}", 1)[1].split(". On qcomm's exchange", 1)[0]
    return fix[:-1] if prefix.endswith("(") else fix


def test_unsummable_reduce_scatter_from_qcomm_codecs_is_fixed_in_its_own_form(
    monkeypatch, torchrecs_transport
):
    monkeypatch.setenv("QCOMM_CODECS", "int8")
    msg = _refusal()
    assert msg.startswith("QCOMM_CODECS: codec 'int8' cannot be the forward codec of "), msg
    assert f"e.g. QCOMM_CODECS='{_INT8_FIX}'. On qcomm's exchange" in msg, msg
    assert "allow_unsummable_reduce_scatter=True) (which still reads QCOMM_CODECS)" in msg, msg
    assert "build_registry({" not in msg and "build_registry('" not in msg, msg
    assert "build_registry(allow_unsummable_reduce_scatter=True)" in msg, msg
    # The fix, pasted into the variable, is taken.
    monkeypatch.setenv("QCOMM_CODECS", _suggested(msg, "QCOMM_CODECS=").strip("'"))
    registry = qcomm.build_registry()
    assert type(registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"].forward).__name__ == "BF16Codec"
    assert type(registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward).__name__ == "Int8Codec"
    # Per-op items keep the caller's specs (options, a good backward) and order.
    monkeypatch.setenv(
        "QCOMM_CODECS",
        "pooled_embeddings_reduce_scatter=int8:row_dim=64/fp16,"
        "pooled_embeddings_all_to_all=int8:row_dim=64/fp16",
    )
    msg = _refusal()
    assert (
        "e.g. QCOMM_CODECS='pooled_embeddings_all_to_all=int8:row_dim=64/fp16,"
        "pooled_embeddings_reduce_scatter=bf16/fp16'. On qcomm's exchange" in msg
    ), msg
    # A size-changing backward is refused with the variable's name and a fix too.
    monkeypatch.setenv("QCOMM_CODECS", "pooled_embeddings_reduce_scatter=fp16/int8")
    msg = _refusal()
    assert msg.startswith("QCOMM_CODECS: codec 'int8' cannot be the backward codec of "), msg
    assert "e.g. QCOMM_CODECS='pooled_embeddings_reduce_scatter=fp16/bf16'. On qcomm's" in msg, msg


def test_unsummable_reduce_scatter_from_a_string_or_a_mapping_is_fixed_in_its_own_form(
    monkeypatch, torchrecs_transport
):
    import ast

    monkeypatch.delenv("QCOMM_CODECS", raising=False)
    msg = _refusal("int8")
    assert msg.startswith("build_registry: codec 'int8' cannot be the forward codec"), msg
    assert f"e.g. build_registry({_INT8_FIX!r}). On qcomm's exchange" in msg, msg
    assert "QCOMM_CODECS" not in msg, msg
    assert qcomm.build_registry(ast.literal_eval(_suggested(msg, "build_registry(")))

    given = {
        "pooled_embeddings_all_to_all": "int8",
        "POOLED_EMBEDDINGS_REDUCE_SCATTER": ("int8", "fp16"),
    }
    msg = _refusal(given)
    fix = (
        "{'pooled_embeddings_all_to_all': 'int8', "
        "'POOLED_EMBEDDINGS_REDUCE_SCATTER': ('bf16', 'fp16')}"
    )
    assert f"e.g. build_registry({fix}). On qcomm's exchange" in msg, msg
    assert qcomm.build_registry(ast.literal_eval(_suggested(msg, "build_registry(")))

    # Keywords give every op the same pair: the fix is a mapping.
    msg = _refusal(forward="int8")
    fix = (
        "{'pooled_embeddings_all_to_all': 'int8/noop', "
        "'sequence_embeddings_all_to_all': 'int8/noop', "
        "'pooled_embeddings_reduce_scatter': 'bf16/noop'}"
    )
    assert f"e.g. build_registry({fix}). On qcomm's exchange" in msg, msg
    # Codec objects have no literal: the fix names them or says what changes.
    msg = _refusal(forward=_Unsummable())
    assert "'pooled_embeddings_all_to_all': (forward, 'noop')" in msg, msg
    msg = _refusal({CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER: _Unsummable()})
    assert (
        "e.g. build_registry({...}) with CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER: 'bf16' "
        "and the other entries as before. On qcomm's exchange" in msg
    ), msg


def test_commop_names_and_values():
    assert [op.name for op in CommOp] == [
        "POOLED_EMBEDDINGS_ALL_TO_ALL",
        "POOLED_EMBEDDINGS_REDUCE_SCATTER",
        "SEQUENCE_EMBEDDINGS_ALL_TO_ALL",
    ]
    assert all(op.value == op.name.lower() for op in CommOp)
    assert (
        CommOp.parse(" Pooled_Embeddings_Reduce_Scatter ")
        is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
    )


def test_noop_codec_and_default_pair():
    pair = QuantizedCommCodecs()
    assert isinstance(pair.forward, NoOpQuantizedCommCodec) and pair.forward is not pair.backward
    codec = pair.forward
    assert isinstance(codec, qcomm.QuantizedCommCodec)
    assert codec.quantized_dtype == torch.float32  # an attribute, not a method
    assert codec.padded_size(torch.zeros(2, 3), [3, 5], 1, None) == (5, 0)
    info = qcomm.codec_info(codec)
    assert (info.summable, info.rel_error_bound, info.bits_per_element) == (True, 0.0, 32.0)


def test_codec_info_defaults_for_foreign_codecs():
    class Foreign:
        def quantized_dtype(self):  # TorchRec's no-op codec has it as a method
            return torch.bfloat16

    info = qcomm.codec_info(Foreign())
    assert info.name == "Foreign" and info.bits_per_element == 16.0
    assert not info.summable and info.stateful and info.rel_error_bound == float("inf")


def test_awaitable_callbacks_run_once():
    calls = []

    def record(x: int) -> int:
        calls.append(x)
        return x * 10

    waiting = qcomm.NoWait(2)
    waiting.callbacks.append(record)
    assert waiting.wait() == 20 and waiting.wait() == 20
    assert calls == [2]


# QCOMM_CODECS and the string form take what the CLI takes


@pytest.mark.parametrize(
    "text, forward, backward",
    [
        ("fp16", "FP16Codec", "FP16Codec"),
        ("fp16/bf16", "FP16Codec", "BF16Codec"),
        (" good:scale=2,tag=x / noop ", "Codec", "NoOpQuantizedCommCodec"),
    ],
)
def test_qcomm_codecs_takes_a_spec_or_a_pair_for_every_op(
    plugins, monkeypatch, text, forward, backward
):
    monkeypatch.setenv("QCOMM_CODECS", text)
    for registry in (qcomm.build_registry(), qcomm.build_registry(text)):
        assert _kinds(registry) == {op: (forward, backward) for op in ALL_OPS}
    if forward == "Codec":
        assert registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward.tag == "x"


def test_qcomm_codecs_specs_split_like_the_cli(plugins, monkeypatch):
    from qcomm.benchmark.options import split_codec_list

    text = "good:scale=2,tag=x,noop"
    assert split_codec_list(text) == ["good:scale=2,tag=x", "noop"]
    # The CLI measures both codecs; a registry has one pair per op, so two
    # codecs in QCOMM_CODECS are one too many, said with the variable's name.
    monkeypatch.setenv("QCOMM_CODECS", text)
    with pytest.raises(CodecError, match=r"QCOMM_CODECS: .*2 codecs"):
        qcomm.build_registry()
    monkeypatch.setenv("QCOMM_CODECS", "pooled_embeddings_all_2_all=fp16")
    with pytest.raises(CodecError, match=r"QCOMM_CODECS: unknown CommOp"):
        qcomm.build_registry()
