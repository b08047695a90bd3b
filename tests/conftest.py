"""Fixtures every suite shares, unit and multi-rank alike (the helper modules
they import are in ``support/``).

qcomm reads its settings from the environment once per process
(:mod:`qcomm.config`); a test that sets a variable in-process has it read
again: each test starts from the environment as it is, and ``monkeypatch``'s
``setenv`` and ``delenv`` take effect at once.
"""

from __future__ import annotations

import collections
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from counting import counting
from fake_dists import GOOD_CODEC, activate, make_dist
from kernel_copies import KERNELS, MISSING

from qcomm import config, torchrec_exchange


def _qcomm_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("QCOMM_")}


@pytest.fixture(autouse=True)
def _settings_read_anew() -> Iterator[None]:
    # Autouse: set up before, and torn down after, monkeypatch's undo; a
    # variable a test leaves behind would change every later suite's ranks.
    before = _qcomm_variables()
    config._reread()
    yield
    after = _qcomm_variables()
    assert after == before, f"the test left qcomm's variables changed: {before} -> {after}"


@pytest.fixture(autouse=True)
def _torchrec_door_as_found() -> Iterator[None]:
    # Autouse: a test that installs or uninstalls qcomm's exchange in
    # TorchRec (or holds its automatic install off) leaves the next tests the
    # door as it found it, whatever order the tests run in.
    was, held = torchrec_exchange.installed(), torchrec_exchange._held_off
    finders = [f for f in sys.meta_path if isinstance(f, torchrec_exchange._AfterImport)]
    yield
    if was and not torchrec_exchange.installed():
        torchrec_exchange.install()
    elif not was and torchrec_exchange.installed():
        torchrec_exchange.uninstall()
    torchrec_exchange._held_off = held
    sys.meta_path[:0] = [f for f in finders if f not in sys.meta_path]


@pytest.fixture
def monkeypatch(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def set_and_read(*args: Any, **kwargs: Any) -> None:
        setenv(*args, **kwargs)
        config._reread()

    def delete_and_read(*args: Any, **kwargs: Any) -> None:
        delenv(*args, **kwargs)
        config._reread()

    monkeypatch.setenv = set_and_read  # type: ignore[method-assign]
    monkeypatch.delenv = delete_and_read  # type: ignore[method-assign]
    yield monkeypatch
    # Its undo comes after this: the next test's _settings_read_anew reads it.


@pytest.fixture
def torchrecs_transport() -> Iterator[None]:
    """TorchRec's own transport chosen for qcomm codecs, where registries keep its rules."""
    with config.configured(torchrec_collectives="torchrec"):
        yield


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A default process group of one gloo rank for the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["fbgemm", "torch"])
def int8_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with fbgemm's kernels allowed and with qcomm's torch fallback forced."""
    if request.param == "torch":
        monkeypatch.setenv("QCOMM_DISABLE_FBGEMM", "1")
    return str(request.param)


@pytest.fixture
def transports_opened() -> Iterator[collections.Counter[str]]:
    """The transports the test's calls opened, by class name (a live count)."""
    with counting("transport_opened") as opened:
        yield opened


@pytest.fixture
def plugins(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Four throw-away distributions on ``sys.path``: a good one, one with a
    factory that returns no codec, a broken one, and one whose factory fails;
    their modules record that they were imported."""
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


def _kernel_copies() -> list[str]:
    if KERNELS is None:
        return ["none"]
    return ["baseline"] + (["avx2"] if KERNELS.isa() == "avx2" else [])


@pytest.fixture(params=_kernel_copies())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    r"""Runs a test with each compiled copy of the kernels this CPU can run."""
    if KERNELS is None:
        pytest.skip(MISSING)
    before = KERNELS.isa()
    KERNELS.isa(request.param)
    yield request.param
    KERNELS.isa(before)
