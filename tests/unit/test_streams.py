"""CUDA stream order of a call (``qcomm/collectives/_streams.py``), without a GPU:
fake streams and events stand in for CUDA's and record what was asked of them.
On a GPU, ``tools/gpu_check.py`` runs the real thing (a call waited for on
another stream)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qcomm.collectives import _streams


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.device = torch.device("cuda", 0)
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream


class FakeTensor:
    def __init__(self) -> None:
        self.recorded: list[FakeStream] = []

    def record_stream(self, stream: FakeStream) -> None:
        self.recorded.append(stream)


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeStream]:
    state = {"issue": FakeStream("issue"), "side": FakeStream("side")}
    state["current"] = state["issue"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return state


def test_no_op_off_cuda() -> None:
    assert _streams.issued(torch.device("cpu")) is None
    _streams.join(None)
    _streams.keep(None, torch.ones(1))
    _streams.use_here(torch.ones(1))  # a CPU tensor: nothing to record


def test_wait_on_the_issuing_stream_adds_nothing(streams: dict[str, FakeStream]) -> None:
    mark = _streams.issued(torch.device("cuda", 0))
    assert mark is not None and mark[1].recorded_on is streams["issue"]
    out = FakeTensor()
    _streams.join(mark)
    _streams.keep(mark, out)  # type: ignore[arg-type]
    assert streams["issue"].waited == [] and out.recorded == []


def test_wait_on_another_stream_orders_it_after_the_call(streams: dict[str, FakeStream]) -> None:
    mark = _streams.issued(torch.device("cuda", 0))
    assert mark is not None
    streams["current"] = streams["side"]
    out = FakeTensor()
    _streams.join(mark)
    _streams.keep(mark, out)  # type: ignore[arg-type]
    assert streams["side"].waited == [mark[1]], "the waiting stream must wait on the call's event"
    assert out.recorded == [streams["side"]], "the output must be recorded on the waiting stream"
