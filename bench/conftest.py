r"""
pytest setup of the micro-benchmarks (pytest-benchmark timings of single
calls): collects ``bench_*.py`` files and prints the codec speed ratios
(qcomm against fbgemm-gpu, same run) after pytest-benchmark's tables.

Run: ``pytest bench/ --benchmark-only``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

# (codec, op) -> {"qcomm" | "fbgemm": (min seconds, median seconds)}
Results = dict[tuple[str, str], dict[str, tuple[float, float]]]
_RESULTS = pytest.StashKey[Results]()
_NOTES = pytest.StashKey[list[str]]()

# The speed-ups the codecs are held to (issue 3), by codec name.
TARGETS = {"fp16": 2.0, "bf16": 2.0, "mx4": 10.0}


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # A file named on the command line is collected by pytest itself already.
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def bench_results(request: pytest.FixtureRequest) -> Results:
    """Where the codec benchmarks record their timings for the ratio summary."""
    return request.config.stash.setdefault(_RESULTS, {})


@pytest.fixture(scope="session")
def bench_notes(request: pytest.FixtureRequest) -> list[str]:
    """Lines printed under the ratio summary (what was measured against what)."""
    return request.config.stash.setdefault(_NOTES, [])


def _ratio(base: float, ours: float) -> str:
    return f"{base / ours:6.2f}x" if ours > 0 and math.isfinite(base) else "   n/a"


@pytest.fixture(scope="session")
def bench_measuring(request: pytest.FixtureRequest) -> dict[tuple[str, str], float]:
    """
    Where bench_measure records its medians: (codec, "measure", "round trip"
    or "call") -> seconds.
    """
    return request.config.stash.setdefault(_MEASURING, {})


_MEASURING = pytest.StashKey[dict[tuple[str, str], float]]()


def _measuring_summary(tr: Any, times: dict[tuple[str, str], float]) -> None:
    names = [c for c, what in times if what == "measure" and (c, "call") in times]
    if not names:
        return
    tr.section("measuring a call's error, beside encoding and decoding a 1 MiB call (medians)")
    for name in names:
        measure, call = times[(name, "measure")], times[(name, "call")]
        trip = times.get((name, "round trip"), math.nan)
        tr.write_line(
            f"{name:<10} measure {measure * 1e6:7.1f} us (by encoding and decoding "
            f"{trip * 1e6:5.1f} us)   1 MiB encode+decode {call * 1e6:8.1f} us   "
            f"({measure / call:.1%})"
        )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _measuring_summary(terminalreporter, config.stash.get(_MEASURING, {}))
    results = config.stash.get(_RESULTS, {})
    if not results:
        return
    tr = terminalreporter
    tr.section("qcomm codecs vs fbgemm-gpu (speed-up = fbgemm time / qcomm time)")
    tr.write_line(
        f"{'codec':<10}{'op':<8}{'qcomm min ms':>14}{'fbgemm min ms':>15}"
        f"{'speed-up (min)':>16}{'(median)':>10}{'target':>8}  verdict"
    )
    for (codec, op), by_impl in sorted(results.items()):
        ours, base = by_impl.get("qcomm"), by_impl.get("fbgemm")
        if ours is None:
            continue
        if base is None:
            tr.write_line(f"{codec:<10}{op:<8}{ours[0] * 1e3:14.2f}{'-':>15}  (no fbgemm CPU path)")
            continue
        target = TARGETS.get(codec, 1.0)
        met = base[0] / ours[0] >= target if ours[0] > 0 else False
        tr.write_line(
            f"{codec:<10}{op:<8}{ours[0] * 1e3:14.2f}{base[0] * 1e3:15.2f}"
            f"{_ratio(base[0], ours[0]):>16}{_ratio(base[1], ours[1]):>10}"
            f"{target:7.1f}x  {'met' if met else 'MISSED'}"
        )
    for note in config.stash.get(_NOTES, []):
        tr.write_line(note)
