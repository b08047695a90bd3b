"""
qcomm reads its settings from the environment once per process
(:mod:`qcomm.config`); a test that sets a variable in-process has it read
again: each test starts from the environment as it is, and ``monkeypatch``'s
``setenv`` and ``delenv`` take effect at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from qcomm import config


@pytest.fixture(autouse=True)
def _settings_read_anew() -> None:
    config._reread()


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
