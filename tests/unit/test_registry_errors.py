"""Every CodecError a wrong codec, plugin or argument to load_codec / build_registry raises, naming what is wrong."""

from __future__ import annotations

import importlib

import pytest

import qcomm
from qcomm import CodecError, NoOpQuantizedCommCodec, QuantizedCommCodecs


def test_unknown_codec_lists_available(plugins):
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("int9")
    msg = str(err.value)
    assert "'int9'" in msg and "available codecs:" in msg and "int8" in msg and "good" in msg


def test_unknown_option_lists_accepted(plugins):
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("good:scael=2")
    msg = str(err.value)
    assert "scael" in msg and "accepted options: scale, tag" in msg and "good-codecs" in msg


def test_plugin_that_fails_to_construct(plugins):
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("angry")
    msg = str(err.value)
    assert "angry-codecs" in msg and "could not be built" in msg and "no GPU found" in msg


def test_plugin_returning_a_non_codec(plugins):
    with pytest.raises(
        CodecError, match=r"'notacodec'.*other-codecs.*lacks codec member\(s\) encode"
    ):
        qcomm.load_codec("notacodec")


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (
            ({"pooled_embeddings_all_2_all": "noop"},),
            {},
            "unknown CommOp 'pooled_embeddings_all_2_all'",
        ),
        (("pooled_embeddings_all_2_all=noop",), {}, "unknown CommOp 'pooled_embeddings_all_2_all'"),
        (("noop,fp16",), {}, "one codec or 'forward/backward' pair for every op, got 2"),
        (("fp16,pooled_embeddings_all_to_all=noop",), {}, "not both"),
        (
            ("pooled_embeddings_all_to_all=noop,pooled_embeddings_all_to_all=noop",),
            {},
            "given twice",
        ),
        (({"pooled_embeddings_all_to_all": "noop/noop/noop"},), {}, "expected 'forward/backward'"),
        (({"pooled_embeddings_all_to_all": ("noop",)},), {}, r"\(forward, backward\) pair"),
        (({"pooled_embeddings_all_to_all": 42},), {}, "codec spec string or a codec object"),
        (({"pooled_embeddings_all_to_all": "int9"},), {}, "unknown codec 'int9'"),
        ((42,), {}, "must be a mapping or a string"),
        (({},), {"forward": "noop"}, "not both"),
    ],
)
def test_build_registry_errors(plugins, args, kwargs, match):
    with pytest.raises(CodecError, match=match):
        qcomm.build_registry(*args, **kwargs)


# Arguments that are not codecs


class _NotADtype(NoOpQuantizedCommCodec):
    quantized_dtype = "float16"  # type: ignore[assignment]


_OP = "POOLED_EMBEDDINGS_ALL_TO_ALL"


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: qcomm.build_registry(forward=NoOpQuantizedCommCodec), r"forward: .*class"),
        (lambda: qcomm.build_registry(backward=3), r"backward: .*got int"),
        (lambda: qcomm.build_registry(forward=True), r"forward: .*got bool"),
        (lambda: qcomm.build_registry(forward=_NotADtype()), r"forward: .*quantized_dtype"),
        (lambda: qcomm.build_registry({_OP: None}), rf"build_registry\[{_OP}\]: .*None"),
        (lambda: qcomm.build_registry({_OP: NoOpQuantizedCommCodec}), r"class"),
        (lambda: qcomm.build_registry({_OP: (None, "noop")}), rf"\[{_OP}\]\.forward: .*None"),
        (lambda: qcomm.build_registry({_OP: ("noop", 3)}), rf"\[{_OP}\]\.backward: .*int"),
        (
            lambda: qcomm.build_registry({_OP: QuantizedCommCodecs(forward="fp16")}),
            rf"\[{_OP}\]\.forward: .*got str",
        ),
        (
            lambda: qcomm.build_registry({_OP: QuantizedCommCodecs(backward=None)}),
            rf"\[{_OP}\]\.backward: .*None",
        ),
        (
            lambda: qcomm.build_registry(
                {_OP: QuantizedCommCodecs(forward=NoOpQuantizedCommCodec)}
            ),
            rf"\[{_OP}\]\.forward: .*class",
        ),
        (lambda: qcomm.load_codec(3), r"spec: expected a codec spec string.*got int"),  # type: ignore[arg-type]
        (lambda: qcomm.load_codec(None), r"spec: expected a codec spec string.*got NoneType"),  # type: ignore[arg-type]
        (
            lambda: qcomm.load_codec(NoOpQuantizedCommCodec),  # type: ignore[arg-type]
            r"spec: .*got the class NoOpQuantizedCommCodec\b",
        ),
    ],
)
def test_what_is_not_a_codec_is_refused_naming_the_argument(build, match):
    with pytest.raises(CodecError, match=match):
        build()


def test_plugin_factory_returning_a_class_is_refused(plugins):
    with (plugins / "other_mod.py").open("a") as f:
        f.write("\ndef make_class():\n    return Codec\n")
    with (plugins / "other_codecs-2.5.dist-info" / "entry_points.txt").open("a") as f:
        f.write("classy = other_mod:make_class\n")
    importlib.invalidate_caches()
    with pytest.raises(CodecError, match=r"'classy'.*returned the class Codec"):
        qcomm.load_codec("classy")
