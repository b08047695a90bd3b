"""The spawn that test_arguments, test_agreement and test_failures share, and
what their cases share.

Each of those modules holds the multi-rank cases of one subject, functions
of the rank and the world size, and a test per case named after the
behaviour it checks, parametrized by transport, marked with the case it runs
(:func:`runs`) and calling :func:`check`::

    @pytest.mark.parametrize("transport", TRANSPORTS)
    @runs(case_disagreement)
    def test_ranks_that_make_different_calls_all_raise(transport, request):
        check(request, transport)

The cases of all three run on one
spawn of :data:`WORLD` gloo ranks per transport (forced with
``QCOMM_TRANSPORT``: gloo's point-to-point, and the all-to-all NCCL takes),
started by the first test that asks and running only the cases of the tests
the session selected. Each test also checks that its case opened the
transport it names and no other.

The process group's timeout is :data:`PG_TIMEOUT`: a peer that waited for a
failing rank would take that long, so every error must come well before it
(:func:`raises`). Each case ends with a valid exact call (:func:`in_step`),
which shows the ranks are in step. A rank that did not raise as a case
expects is out of step with the others, so a failed check stops the spawn
too, the later cases reported as not run.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from collective_checks import POOLED, ForeignIdentityCodec, check_pooled, expect
from dist_utils import Outcome, check_case, run_outcomes, transport_env

import qcomm
import qcomm.collectives._agreement as qverify
from qcomm import CodecInfo, QuantizedCommCodecs, config

#: the modules whose cases the spawn runs
MODULES = ("test_agreement", "test_arguments", "test_failures")
WORLD = 3
PG_TIMEOUT = 30.0
#: seconds within which a peer told of a failure raises (a peer left waiting
#: would raise only at the process group's timeout)
PROMPT = 8.0


# --------------------------------------------------------------------------
# The spawn.


def runs(case: Callable[[int, int], None]) -> pytest.MarkDecorator:
    """Marks a test of one of :data:`MODULES` as the check of ``case`` on the spawn."""
    # with_args: a lone callable given to a mark would be taken for the test it marks.
    return pytest.mark.three_ranks.with_args(case)


def run_case(case: str, rank: int, world: int) -> None:
    """Runs ``case``, ``module:name`` with ``module`` one of :data:`MODULES`."""
    module, name = case.split(":")
    getattr(importlib.import_module(module), name)(rank, world)


def _case_of(item: pytest.Item) -> str | None:
    """The case (``module:name``) a test runs, or None for a test not marked by :func:`runs`."""
    marker = item.get_closest_marker("three_ranks")
    if marker is None:
        return None
    case = marker.args[0]
    return f"{case.__module__}:{case.__name__}"


def _selected(session: pytest.Session, transport: str) -> list[str]:
    """The cases of the session's tests (marked by :func:`runs`) on ``transport``,
    in the session's order."""
    cases: list[str] = []
    for item in session.items:
        if not isinstance(item, pytest.Function) or (case := _case_of(item)) is None:
            continue
        if item.callspec.params["transport"] == transport and case not in cases:
            cases.append(case)
    return cases


# Each transport's outcomes, or the error its spawn raised.
_spawned: dict[str, dict[str, Outcome] | BaseException] = {}


def check(request: pytest.FixtureRequest, transport: str) -> None:
    """Fails the calling test (the check of its case, :func:`runs`, on
    ``transport``) with the case's tracebacks, or unless every rank opened
    that transport only; spawns the ranks on first use."""
    case = _case_of(request.node)
    assert case is not None, f"{request.node.name} is not marked with the case it runs"
    assert case.split(":")[0] in MODULES, f"{case} is not a case of MODULES"
    if transport not in _spawned:
        try:
            _spawned[transport] = run_outcomes(
                run_case,
                WORLD,
                _selected(request.session, transport),
                env=transport_env(transport),
                stop_on_failed_check=True,
                timeout=600.0,
                pg_timeout=PG_TIMEOUT,
            )
        except BaseException as err:
            _spawned[transport] = err
    outcomes = _spawned[transport]
    if isinstance(outcomes, BaseException):
        raise outcomes
    check_case(outcomes[case], f"{case} on {WORLD} ranks, {transport}", transport)


# --------------------------------------------------------------------------
# What the cases share (run inside a rank).


def in_step(rank: int, world: int, tag: str) -> None:
    """A valid exact call: fails unless every rank is at the same point."""
    batches, dims = POOLED[world][0]
    check_pooled(rank, world, batches, dims, tag, None)


def exact_on(group: Any, rank: int, world: int) -> None:
    """A valid exact call on ``group``: the next call after a failure works."""
    x = torch.full((2 * world, 3), float(rank + 1))
    out = qcomm.all_to_all_pooled(x, [2] * world, [3] * world, group=group).wait()
    expected = torch.cat([torch.full((2, 3), float(k + 1)) for k in range(world)], dim=1)
    assert torch.equal(out, expected), f"the call after a failure gave {out.tolist()}"


VERIFY = config.VARIABLES["verify"]


def with_env(value: str | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``QCOMM_VERIFY`` set to ``value`` (unset for None)."""
    old = os.environ.get(VERIFY)
    if value is None:
        os.environ.pop(VERIFY, None)
    else:
        os.environ[VERIFY] = value
    # qcomm reads its settings once: read again, with and after the change.
    config._reread()
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(VERIFY, None)
        else:
            os.environ[VERIFY] = old
        config._reread()


def raises(error: type[Exception], words: tuple[str, ...], fn: Callable[[], Any]) -> float:
    """:func:`~collective_checks.expect`, within :data:`PROMPT` seconds; returns the seconds taken."""
    start = time.monotonic()
    expect(error, words, fn)
    took = time.monotonic() - start
    assert took < PROMPT, f"{error.__name__} naming {words} raised after {took:.1f} s"
    return took


@contextlib.contextmanager
def agreement_exchanges() -> Iterator[list[str]]:
    """Counts the agreement check's exchanges (by collective) while in the block."""
    seen: list[str] = []
    real = qverify.Agreement._exchange

    def counting(self: qverify.Agreement, failed: BaseException | None) -> None:
        seen.append(self.collective)
        real(self, failed)

    qverify.Agreement._exchange = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        qverify.Agreement._exchange = real  # type: ignore[method-assign]


def both(codec: Any) -> QuantizedCommCodecs:
    """``codec`` both ways."""
    return QuantizedCommCodecs(forward=codec, backward=codec)


class NaNRefusingCodec(ForeignIdentityCodec):
    """Raises on NaN, as the plugin docs allow; counts its encodes (in a list,
    which its description shows by type only: alike on every rank)."""

    def __init__(self) -> None:
        self.info = CodecInfo(name="nan_refusing", bits_per_element=32, error_block=1)
        self.encodes: list[int] = []

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self.encodes.append(input_tensor.numel())
        if torch.isnan(input_tensor).any():
            raise ValueError("NaN in the input")
        return input_tensor.reshape(-1)
