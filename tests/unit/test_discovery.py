"""Entry-point discovery: which codecs are listed and loaded, from which distribution,
QCOMM_PLUGINS, plugins that break, conflict, are upgraded or share a namespace package."""

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
from fake_dists import GOOD_CODEC, activate, load_good, make_dist
from stevedore import ExtensionManager

import qcomm
from qcomm import CodecError, NoOpQuantizedCommCodec
from qcomm.cli import main as cli_main


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
    codec = load_good("good:scale=2.5,tag=abc")
    assert (codec.scale, codec.tag) == (2.5, "abc")
    assert "good_mod" in sys.modules
    assert "other_mod" not in sys.modules
    assert "broken_mod" not in sys.modules
    x = torch.arange(5.0)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_broken_plugin_names_itself_and_others_stay_usable(plugins):
    with pytest.raises(CodecError) as err:
        qcomm.load_codec("broken")
    msg = str(err.value)
    assert "'broken'" in msg and "broken-codecs 1.0" in msg
    assert "failed to import" in msg and "no_such_dependency_xyz" in msg
    # One broken distribution spoils nothing else.
    assert load_good("good").scale == 1.0
    assert isinstance(qcomm.load_codec("noop"), NoOpQuantizedCommCodec)
    assert "broken" in qcomm.available_codecs()


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


def test_loading_leaves_stevedores_own_listing_alone(tmp_path, monkeypatch):
    # stevedore's listing is a class attribute, shared by every user of
    # stevedore in the process: qcomm's load lists through its own manager
    # and writes nothing there.
    monkeypatch.delenv("QCOMM_PLUGINS", raising=False)
    make_dist(tmp_path, "good-codecs", "good_mod", GOOD_CODEC, {"good": "Codec"})
    activate(tmp_path, monkeypatch)
    theirs = importlib.metadata.EntryPoint("theirs", "their_mod:Thing", "qcomm.codecs")
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {"other.group": []})
    assert type(qcomm.load_codec("good")).__module__ == "good_mod"
    assert ExtensionManager.ENTRY_POINT_CACHE == {"other.group": []}
    ExtensionManager.ENTRY_POINT_CACHE["qcomm.codecs"] = [theirs]
    assert type(qcomm.load_codec("fp16")).__name__ == "FP16Codec"
    assert ExtensionManager.ENTRY_POINT_CACHE == {"other.group": [], "qcomm.codecs": [theirs]}
