r"""
What measuring a call's error costs (docs/adaptive.rst): for every built-in
codec, the measurement of one codec on the largest sample a call takes
(2048 elements: the codec's own ``round_trip_error``, and for comparison
an encode, a decode and the norms, as for a codec without one), beside
encoding and decoding the 1 MiB of float32 a 1 MiB call sends, in the same
run. An
adaptive codec measures each of its candidates: its cost is the sum of
theirs. The summary prints each measurement's time as a share of the
1 MiB encode and decode.

Run: ``pytest bench/bench_measure.py --benchmark-only``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qcomm
from qcomm.collectives import _measure

CODECS = ["fp16", "bf16", "fp8_e4m3", "int8", "mx4"]
CALL = 1 << 18  # 1 MiB of float32


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randn(CALL, generator=torch.Generator().manual_seed(0))


def _keep(benchmark: Any, times: dict[tuple[str, str], float], codec: str, what: str) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        times[(codec, what)] = stats.stats.median


@pytest.mark.parametrize("by", ["measure", "round trip"])
@pytest.mark.parametrize("name", CODECS)
def test_measuring_a_sample(
    benchmark: Any,
    bench_measuring: dict[tuple[str, str], float],
    data: torch.Tensor,
    name: str,
    by: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = qcomm.load_codec(name)
    if by == "round trip":  # as for a codec without round_trip_error of its own
        monkeypatch.setattr(_measure, "_quick", lambda codec, x: None)
    sample = data[: _measure.SAMPLE].clone()
    rms, _ = benchmark(_measure._error, codec, sample, torch.float32)
    assert 0 < rms < 0.2
    _keep(benchmark, bench_measuring, name, by)


@pytest.mark.parametrize("name", CODECS)
def test_encoding_and_decoding_a_call(
    benchmark: Any, bench_measuring: dict[tuple[str, str], float], data: torch.Tensor, name: str
) -> None:
    codec = qcomm.load_codec(name)

    def both() -> torch.Tensor:
        ctx = codec.create_context()
        return codec.decode(codec.encode(data, ctx), ctx)

    assert benchmark(both).numel() == CALL
    _keep(benchmark, bench_measuring, name, "call")
