"""World size 1 does no communication: the three collectives, forward and
backward, and the all-reduce, on both transports, call no backend operation
(each is counted)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist

import qcomm
from qcomm.collectives.all_reduce import all_reduce


def counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts every backend operation qcomm could issue."""
    calls: list[str] = []
    for name in ("all_to_all_single", "all_to_all", "all_gather", "barrier", "send", "recv"):
        real = getattr(dist, name)

        def wrapped(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapped)
    for name in ("send", "recv", "alltoall_base", "alltoall"):
        real = getattr(dist.ProcessGroup, name)

        def method(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(f"ProcessGroup.{_name}")
            return _real(self, *args, **kw)

        monkeypatch.setattr(dist.ProcessGroup, name, method)
    return calls


@pytest.mark.parametrize("transport", ["point_to_point", "all_to_all"])
@pytest.mark.parametrize("verify", [None, "1"])
def test_no_communication_at_world_size_one(
    one_rank: None,
    transports_opened: collections.Counter[str],
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
    verify: str | None,
) -> None:
    monkeypatch.setenv("QCOMM_TRANSPORT", transport)
    if verify:
        monkeypatch.setenv("QCOMM_VERIFY", verify)
    calls = counting(monkeypatch)
    int8 = qcomm.QuantizedCommCodecs(
        forward=qcomm.load_codec("int8"), backward=qcomm.load_codec("int8")
    )
    x = torch.randn(4, 32, requires_grad=True)
    for codecs in (None, int8):
        out = qcomm.all_to_all_pooled(x, [4], [32], codecs=codecs).wait()
        out.sum().backward()
        out = qcomm.reduce_scatter_pooled(x, codecs=codecs).wait()
        out.sum().backward()
        out = qcomm.all_to_all_sequence(
            x, input_splits=[4], output_splits=[4], codecs=codecs
        ).wait()
        out.sum().backward()
    buffer = torch.arange(64.0)
    all_reduce(buffer, reduce_codec=qcomm.load_codec("int8"), average=True)
    assert buffer.equal(torch.arange(64.0)), "one rank's all-reduce is the identity"
    kind = "PointToPoint" if transport == "point_to_point" else "OneAllToAll"
    opened = transports_opened
    assert opened[kind] >= 12 and len(opened) == 1, f"calls did not take {kind}: {opened}"
    assert calls == [], f"world size 1 communicated: {calls}"


def test_what_a_call_asks_once_is_asked_again_where_it_changed(one_rank: None) -> None:
    # A group's rank and size are kept after its first call: a group destroyed
    # since is still refused, as torch refuses it.
    x = torch.randn(4, 32)
    group = dist.new_group([0])
    assert qcomm.all_to_all_pooled(x, [4], [32], group=group).wait().equal(x)
    dist.destroy_process_group(group)
    with pytest.raises(ValueError, match="not registered"):
        qcomm.all_to_all_pooled(x, [4], [32], group=group)
    # A codec's contract check is kept after its first call: a codec changed
    # in place to a wire the backend cannot carry is still refused.
    codec = qcomm.load_codec("fp16")
    codecs = qcomm.QuantizedCommCodecs(forward=codec, backward=codec)
    qcomm.all_to_all_pooled(x, [4], [32], codecs=codecs).wait()
    type(codec).quantized_dtype = property(lambda self: torch.int16)  # type: ignore[assignment]
    try:
        with pytest.raises(qcomm.CodecError, match="cannot carry"):
            qcomm.all_to_all_pooled(x, [4], [32], codecs=codecs)
    finally:
        del type(codec).quantized_dtype
