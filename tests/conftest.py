"""Fixtures every suite shares, unit and multi-rank alike (the helper modules
they import are in ``support/``)."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
from counting import counting


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

