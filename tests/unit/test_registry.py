"""Entry-point discovery, codec specs, build_registry and every CodecError of the core."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from codec_names import BUILTIN
from fake_dists import GOOD_CODEC, activate, make_dist
from stevedore import ExtensionManager

import qcomm
from qcomm import CodecError, CommOp, NoOpQuantizedCommCodec, QuantizedCommCodecs
from qcomm.cli import main as cli_main

ALL_OPS = sorted(op.name for op in CommOp)


def _good(spec: str, **options: Any) -> Any:
    """``load_codec`` for the fake plugin's codec, whose ``scale`` and ``tag`` mypy cannot see."""
    return qcomm.load_codec(spec, **options)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Three throw-away distributions: a good one, a broken one, and one whose
    factory fails; their modules record that they were imported."""
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    monkeypatch.delenv("QCOMM_CODECS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    make_dist(
        tmp_path,
        "other-codecs",
        "other_mod",
        GOOD_CODEC,
        {"other": "Codec", "notacodec": "make_plain"},
        version="2.5",
    )
    with (tmp_path / "other_mod.py").open("a") as f:
        f.write("\ndef make_plain():\n    return object()\n")
    make_dist(
        tmp_path,
        "broken-codecs",
        "broken_mod",
        "import no_such_dependency_xyz\n",
        {"broken": "Codec"},
    )
    make_dist(
        tmp_path,
        "angry-codecs",
        "angry_mod",
        "def Codec(**kw):\n    raise RuntimeError('no GPU found')\n",
        {"angry": "Codec"},
    )
    activate(tmp_path, monkeypatch)
    return tmp_path


def test_the_suites_list_of_builtin_codecs_is_what_qcomm_registers():
    registered = [
        name
        for name, entries in qcomm.codec_entries().items()
        if any(e.distribution == "qcomm" for e in entries)
    ]
    assert sorted(registered) == sorted(["noop", *BUILTIN])


def test_available_codecs_lists_builtins_and_plugins(plugins):
    names = qcomm.available_codecs()
    for name in ["noop", *BUILTIN]:
        assert name in names
    for name in ["good", "other", "broken", "angry", "notacodec"]:
        assert name in names
    assert names == sorted(names)
    entry = qcomm.codec_entries()["other"][0]
    assert (entry.distribution, entry.version, entry.value) == (
        "other-codecs",
        "2.5",
        "other_mod:Codec",
    )


def test_available_codecs_imports_no_plugin(tmp_path):
    # A fresh interpreter, so that no earlier test has imported a plugin.
    make_dist(tmp_path, "loud-codecs", "loud_mod", "raise SystemExit('imported!')\n", {"loud": "X"})
    code = textwrap.dedent(
        """
        import sys, qcomm
        before = set(sys.modules)
        names = qcomm.available_codecs()
        entries = qcomm.codec_entries()
        assert "loud" in names and "int8" in names, names
        new = sorted(m for m in set(sys.modules) - before
                     if m.startswith(("qcomm_builtin", "loud_mod", "fbgemm")))
        print("NEW:", new)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "NEW: []" in out.stdout


def test_load_codec_imports_only_the_named_plugin(plugins):
    codec = _good("good:scale=2.5,tag=abc")
    assert (codec.scale, codec.tag) == (2.5, "abc")
    assert "good_mod" in sys.modules
    assert "other_mod" not in sys.modules
    assert "broken_mod" not in sys.modules
    x = torch.arange(5.0)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_load_codec_keyword_options_override_spec(plugins):
    assert _good("good:scale=2", scale=4.0).scale == 4.0


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


def test_broken_plugin_names_itself_and_others_stay_usable(plugins):
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("broken")
    msg = str(err.value)
    assert "'broken'" in msg and "broken-codecs 1.0" in msg
    assert "failed to import" in msg and "no_such_dependency_xyz" in msg
    # One broken distribution spoils nothing else.
    assert _good("good").scale == 1.0
    assert isinstance(qcomm.load_codec("noop"), NoOpQuantizedCommCodec)
    assert "broken" in qcomm.available_codecs()


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


def test_conflicting_distributions_are_refused(plugins, tmp_path, monkeypatch):
    second = tmp_path / "second"
    second.mkdir()
    make_dist(second, "rival-codecs", "rival_mod", GOOD_CODEC, {"good": "Codec"}, version="0.3")
    activate(second, monkeypatch)
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("good")
    msg = str(err.value)
    assert "several distributions" in msg and "good-codecs 1.0" in msg and "rival-codecs 0.3" in msg
    assert len(qcomm.codec_entries()["good"]) == 2
    # Neither implementation was imported: nothing is run before it is chosen.
    assert "good_mod" not in sys.modules and "rival_mod" not in sys.modules


def test_allow_list_restricts_distributions(plugins, monkeypatch):
    monkeypatch.setenv("QCOMM_PLUGINS", "qcomm, Good_Codecs")
    names = qcomm.available_codecs()
    assert "good" in names and "int8" in names
    assert "other" not in names and "broken" not in names
    with pytest.raises(CodecError, match=r"'other'.*QCOMM_PLUGINS leaves out other-codecs"):
        qcomm.load_codec("other")
    assert "other_mod" not in sys.modules


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
def test_unsummable_reduce_scatter_codec_is_refused(codec):
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


def test_size_changing_reduce_scatter_backward_is_refused():
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


def test_unsummable_reduce_scatter_from_qcomm_codecs_is_fixed_in_its_own_form(monkeypatch):
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
    monkeypatch,
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


def test_cli_list(plugins, capsys):
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "codec" in out and "distribution" in out
    assert any(line.split()[:3] == ["other", "other-codecs", "2.5"] for line in out.splitlines())
    assert "other_mod" not in sys.modules


def test_cli_list_details(plugins, capsys):
    assert cli_main(["list", "--details"]) == 0
    out = capsys.readouterr().out
    noop_row = next(line for line in out.splitlines() if line.startswith("noop "))
    assert noop_row.split()[3:5] == ["32", "yes"]
    broken_row = next(line for line in out.splitlines() if line.startswith("broken "))
    assert "error" in broken_row and "no_such_dependency_xyz" in broken_row


# One source of truth: what is listed is what is loaded (issue 13)


def test_upgraded_plugin_loads_the_version_listed(tmp_path, monkeypatch):
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_v1", GOOD_CODEC, {"good": "Codec"})
    activate(tmp_path, monkeypatch)
    assert type(qcomm.load_codec("good")).__module__ == "good_v1"
    # pip upgrades the distribution in place while the process runs.
    for info in tmp_path.glob("good_codecs-1.0.dist-info/*"):
        info.unlink()
    (tmp_path / "good_codecs-1.0.dist-info").rmdir()
    make_dist(tmp_path, "good-codecs", "good_v2", GOOD_CODEC, {"good": "Codec"}, version="2.0")
    importlib.invalidate_caches()
    assert [e.version for e in qcomm.codec_entries()["good"]] == ["2.0"]
    assert type(qcomm.load_codec("good")).__module__ == "good_v2"


def test_plugin_installed_while_running_is_loaded(tmp_path, monkeypatch):
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    activate(tmp_path, monkeypatch)
    qcomm.load_codec("good")  # the entry points have been read once
    make_dist(tmp_path, "late-codecs", "late_mod", GOOD_CODEC, {"late": "Codec"})
    importlib.invalidate_caches()
    assert "late" in qcomm.available_codecs()
    assert type(qcomm.load_codec("late")).__module__ == "late_mod"


def test_stevedores_own_listing_is_not_what_loads(tmp_path, monkeypatch):
    # stevedore keeps one listing per namespace for the life of the process;
    # one made before an upgrade (or by another user of stevedore) is stale.
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    (tmp_path / "stale_mod.py").write_text("raise RuntimeError('the stale entry point ran')\n")
    activate(tmp_path, monkeypatch)
    stale = importlib.metadata.EntryPoint("good", "stale_mod:Codec", "qcomm.codecs")
    monkeypatch.setitem(ExtensionManager.ENTRY_POINT_CACHE, "qcomm.codecs", [stale])
    assert type(qcomm.load_codec("good")).__module__ == "good_mod"
    assert "stale_mod" not in sys.modules


def test_stevedores_disk_cache_is_never_read(tmp_path, monkeypatch):
    # stevedore's disk cache is keyed on mtimes packed as 32-bit floats (two
    # minutes apart): an entry_points.txt rewritten within that leaves it
    # stale. qcomm's load never asks it (the listing is the scan's).
    from stevedore import _cache

    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    activate(tmp_path, monkeypatch)
    asked: list[str] = []

    def stale(group: str) -> list[importlib.metadata.EntryPoint]:
        asked.append(group)
        return []

    monkeypatch.delitem(ExtensionManager.ENTRY_POINT_CACHE, "qcomm.codecs", raising=False)
    monkeypatch.setattr(_cache, "get_group_all", stale)
    assert type(qcomm.load_codec("good")).__module__ == "good_mod"
    assert asked == []
    # The patch is the one stevedore reads without qcomm: it would miss the codec.
    monkeypatch.delitem(ExtensionManager.ENTRY_POINT_CACHE, "qcomm.codecs", raising=False)
    assert ExtensionManager("qcomm.codecs").names() == [] and asked == ["qcomm.codecs"]


def test_plugin_upgraded_under_an_imported_module_is_refused(tmp_path, monkeypatch):
    # Same module name in both versions: the process still holds the old code,
    # which must not be handed out as the new version.
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    activate(tmp_path, monkeypatch)
    qcomm.load_codec("good")
    for info in tmp_path.glob("good_codecs-1.0.dist-info/*"):
        info.unlink()
    (tmp_path / "good_codecs-1.0.dist-info").rmdir()
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"}, version="2.0")
    importlib.invalidate_caches()
    with pytest.raises(CodecError, match=r"good-codecs 2\.0.*imported.*1\.0.*restart"):
        qcomm.load_codec("good")


def test_another_module_of_an_upgraded_package_is_refused(tmp_path, monkeypatch):
    # v2 adds a codec in a new module of the package whose v1 is imported:
    # loading it would mix the old package's code with the new module's.
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    (tmp_path / "goodpkg").mkdir()
    (tmp_path / "goodpkg" / "__init__.py").write_text("")
    for name in ("a", "b"):
        (tmp_path / "goodpkg" / f"{name}.py").write_text(GOOD_CODEC)
    make_dist(tmp_path, "pkg-codecs", "unused_mod", "", {"pa": "X"})
    entry_points = tmp_path / "pkg_codecs-1.0.dist-info" / "entry_points.txt"
    entry_points.write_text("[qcomm.codecs]\npa = goodpkg.a:Codec\n")
    activate(tmp_path, monkeypatch)
    monkeypatch.delitem(sys.modules, "goodpkg", raising=False)
    monkeypatch.delitem(sys.modules, "goodpkg.a", raising=False)
    qcomm.load_codec("pa")
    info = tmp_path / "pkg_codecs-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg-codecs\nVersion: 2.0\n")
    entry_points.write_text("[qcomm.codecs]\npa = goodpkg.a:Codec\npb = goodpkg.b:Codec\n")
    info.rename(tmp_path / "pkg_codecs-2.0.dist-info")
    importlib.invalidate_caches()
    with pytest.raises(CodecError, match=r"imported goodpkg from pkg-codecs 1\.0.*restart"):
        qcomm.load_codec("pb")
    assert "goodpkg.b" not in sys.modules


# Arguments that are not codecs, specs that contradict themselves, QCOMM_PLUGINS


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


def test_a_distribution_left_out_causes_no_conflict(plugins, tmp_path, monkeypatch):
    second = tmp_path / "second"
    second.mkdir()
    make_dist(second, "rival-codecs", "rival_mod", GOOD_CODEC, {"good": "Codec"}, version="0.3")
    activate(second, monkeypatch)
    monkeypatch.setenv("QCOMM_PLUGINS", "qcomm,good-codecs")
    assert [e.distribution for e in qcomm.codec_entries()["good"]] == ["good-codecs"]
    assert type(qcomm.load_codec("good")).__module__ == "good_mod"
    assert "rival_mod" not in sys.modules


@pytest.mark.parametrize("value", ["qcom,good-codecs", "good-codecs,no-such-dist", " , "])
def test_qcomm_plugins_naming_no_codec_distribution_is_an_error(plugins, monkeypatch, value):
    monkeypatch.setenv("QCOMM_PLUGINS", value)
    for call in (
        qcomm.available_codecs,
        qcomm.codec_entries,
        lambda: qcomm.load_codec("good"),
        lambda: qcomm.build_registry(forward="fp16"),
    ):
        with pytest.raises(CodecError) as err:
            call()
        msg = str(err.value)
        assert f"QCOMM_PLUGINS={value.strip()!r}: " in msg
        assert "good-codecs" in msg and "qcomm" in msg and "other-codecs" in msg  # the known ones
    assert cli_main(["list"]) == 2


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


# Namespace packages shared by distributions; plugins the user's code imported


def _package_dist(root: Any, dist: str, package: str, codecs: dict[str, str], version: str) -> None:
    """A distribution whose codecs live in ``package`` (dotted; no ``__init__.py`` above it)."""
    folder = root.joinpath(*package.split("."))
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(GOOD_CODEC)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = [f"{name} = {package}:{attr}" for name, attr in codecs.items()]
    (info / "entry_points.txt").write_text("\n".join(["[qcomm.codecs]", *lines]) + "\n")


def _run_python(code: str, *path: Any) -> str:
    """Its stdout, running ``code`` fresh with ``path`` first on sys.path."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("QCOMM_PLUGINS", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_distributions_sharing_a_namespace_package_both_load(tmp_path):
    # acme-fp16 and acme-bf16 each install a package under the namespace `acme`,
    # one beside the other (one site-packages) or in two folders of sys.path.
    _package_dist(tmp_path / "one", "acme-fp16", "acme.qcomm_fp16", {"acme_fp16": "Codec"}, "1.0")
    _package_dist(tmp_path / "two", "acme-bf16", "acme.qcomm_bf16", {"acme_bf16": "Codec"}, "1.0")
    _package_dist(tmp_path / "one", "acme-int8", "acme.qcomm_int8", {"acme_int8": "Codec"}, "1.0")
    code = """
        import importlib, pathlib, sys
        import qcomm
        for name in ("acme_fp16", "acme_bf16", "acme_int8", "acme_fp16"):
            print(name, type(qcomm.load_codec(name)).__module__)
        # Its own package is still guarded: acme-bf16 upgraded under the process.
        info = pathlib.Path(sys.argv[2]) / "acme_bf16-1.0.dist-info"
        (info / "METADATA").write_text("Metadata-Version: 2.1\\nName: acme-bf16\\nVersion: 2.0\\n")
        info.rename(info.with_name("acme_bf16-2.0.dist-info"))
        importlib.invalidate_caches()
        try:
            qcomm.load_codec("acme_bf16")
        except qcomm.CodecError as err:
            print("refused:", err)
        print("acme_fp16", type(qcomm.load_codec("acme_fp16")).__module__)
    """
    out = _run_python(code, tmp_path / "one", tmp_path / "two").splitlines()
    assert out[:4] == [
        "acme_fp16 acme.qcomm_fp16",
        "acme_bf16 acme.qcomm_bf16",
        "acme_int8 acme.qcomm_int8",
        "acme_fp16 acme.qcomm_fp16",
    ]
    assert re.search(r"refused: .*imported acme\.qcomm_bf16 from acme-bf16 1\.0.*restart", out[4])
    assert out[5] == "acme_fp16 acme.qcomm_fp16"


def test_a_plugin_the_user_imported_then_upgraded_is_refused(tmp_path):
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    make_dist(tmp_path, "kept-codecs", "kept_mod", GOOD_CODEC, {"kept": "Codec"})
    code = """
        import importlib, pathlib, sys
        import good_mod, kept_mod  # the user's own code, before qcomm loads anything
        import qcomm
        root = pathlib.Path(sys.argv[1])
        # pip upgrades good-codecs in place: new code, new version.
        (root / "good_mod.py").write_text(pathlib.Path(good_mod.__file__).read_text() + "V2 = 1\\n")
        info = root / "good_codecs-1.0.dist-info"
        (info / "METADATA").write_text("Metadata-Version: 2.1\\nName: good-codecs\\nVersion: 2.0\\n")
        info.rename(root / "good_codecs-2.0.dist-info")
        importlib.invalidate_caches()
        try:
            codec = qcomm.load_codec("good")
            print("loaded, new code:", hasattr(sys.modules[type(codec).__module__], "V2"))
        except qcomm.CodecError as err:
            print("refused:", err)
        # What did not change since the process started loads as it is.
        print("kept:", type(qcomm.load_codec("kept")).__module__ == kept_mod.__name__)
    """
    out = _run_python(code, tmp_path).splitlines()
    assert re.search(r"refused: .*good-codecs 2\.0.*imported good_mod before.*restart", out[0]), out
    assert out[1] == "kept: True"
