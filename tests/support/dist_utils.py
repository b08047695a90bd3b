"""Run a function on N local ranks, each in its own spawned process.

    from dist_utils import run_ranks

    def check(rank: int, world_size: int, n: int) -> float:
        # a process group is initialised here: gloo over a FileStore
        x = torch.full((n,), float(rank))
        dist.all_reduce(x)
        return x[0].item()

    def test_sum() -> None:
        assert run_ranks(check, 3, 4) == [3.0, 3.0, 3.0]

``fn`` must be importable by the child processes (a module-level function of
a test module or helper, not a lambda or closure); its extra arguments and
its result are pickled. Each call spawns fresh processes, which costs a
second or two of imports, so check many things per call.

Failures never pass silently and nothing hangs:

- an exception on any rank raises :class:`RankFailure` in the caller, with
  every failing rank's traceback in the message (``.tracebacks``) and the
  original exception objects where they pickle (``.exceptions``);
- a rank that dies without reporting (crash, ``os._exit``) is a failure too;
- once one rank has failed, the others get ``grace`` seconds to report (they
  are often stuck in a collective waiting for it), then are killed;
- the whole run is killed after ``timeout`` seconds (``TimeoutError``), and
  the process group's own ``pg_timeout`` makes a stuck collective raise
  inside the ranks well before that.

The rendezvous is a :class:`torch.distributed.FileStore` in a fresh temporary
directory, so runs never collide on ports. ``env`` sets environment variables
in every rank before the process group is initialised: how a spawn forces one
of qcomm's transports (:func:`transport_env`). :func:`run_outcomes` reports,
with each case's outcome, the transports each rank opened during it, so that a
test can prove it ran on the transport it names (:func:`check_case`).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from counting import counting

from qcomm import config
from qcomm.collectives import _transport

__all__ = [
    "TRANSPORTS",
    "Outcome",
    "RankFailure",
    "check_case",
    "outcomes_per_world_size",
    "per_world_size",
    "run_cases",
    "run_outcomes",
    "run_ranks",
    "transport_env",
    "wrong_transport",
]

#: What ``QCOMM_TRANSPORT`` can force, and the class each opens.
TRANSPORTS = ("point_to_point", "all_to_all")
_CLASSES = {
    "point_to_point": _transport.PointToPoint.__name__,
    "all_to_all": _transport.OneAllToAll.__name__,
}
assert tuple(_CLASSES) == _transport.CHOICES


class RankFailure(AssertionError):
    """One or more ranks raised (or died); the message has their tracebacks."""

    def __init__(self, tracebacks: dict[int, str], exceptions: dict[int, BaseException | None]):
        self.tracebacks = tracebacks
        self.exceptions = exceptions
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items())]
        super().__init__(f"{len(tracebacks)} rank(s) failed:\n" + "\n".join(parts))


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    pg_timeout: float,
    threads: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(env)
    # Unpickling the arguments may have read qcomm's settings (a registry
    # unpickled enables qcomm's exchange): read them again, with env.
    config._reread()
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle here, with the plain pickler: the queue's own pickler would
        # hand tensors over through shared memory that dies with this process.
        results.put((rank, True, pickle.dumps(value), None))
    except BaseException as err:
        text = traceback.format_exc()
        try:
            blob: bytes | None = pickle.dumps(err)
        except Exception:
            blob = None
        results.put((rank, False, text, blob))


def _unpickle(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        err = pickle.loads(blob)
    except Exception:
        return None
    return err if isinstance(err, BaseException) else None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    grace: float = 5.0,
    backend: str = "gloo",
    threads: int = 1,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level function; runs with the default process group
            initialised (``backend`` over a FileStore).
        world_size: number of ranks (processes).
        *args: extra arguments for ``fn``, pickled.
        timeout: seconds after which every rank still running is killed and
            ``TimeoutError`` is raised.
        pg_timeout: the process group's timeout, after which a collective
            that waits for a peer raises inside the rank.
        grace: seconds the other ranks get to report after one has failed.
        backend: the ``torch.distributed`` backend.
        threads: ``torch.set_num_threads`` in each rank (keep it small: the
            ranks share the machine's cores).
        env: environment variables set in each rank before the process
            group is initialised.

    Returns:
        The values ``fn`` returned, indexed by rank.

    Raises:
        RankFailure: if any rank raised or died.
        TimeoutError: if the ranks did not all finish within ``timeout``.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    workdir = tempfile.mkdtemp(prefix="qcomm-ranks-")
    store_path = os.path.join(workdir, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                world_size,
                store_path,
                backend,
                pg_timeout,
                threads,
                dict(env or {}),
                args,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    tracebacks: dict[int, str] = {}
    exceptions: dict[int, BaseException | None] = {}
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while len(values) + len(tracebacks) < world_size:
            now = time.monotonic()
            if tracebacks and failed_at is None:
                failed_at = now
                deadline = min(deadline, now + grace)
            if now >= deadline:
                break
            try:
                rank, ok, payload, blob = results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in values or r in tracebacks or p.is_alive():
                        continue
                    # Its last message may still be in the pipe: wait a
                    # moment before declaring it dead without a word.
                    first = dead_since.setdefault(r, now)
                    if now - first > 2.0:
                        tracebacks[r] = f"rank {r} exited with code {p.exitcode} without reporting"
                        exceptions[r] = None
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                tracebacks[rank] = payload
                exceptions[rank] = _unpickle(blob)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if tracebacks:
        raise RankFailure(tracebacks, exceptions)
    if len(values) < world_size:
        missing = [r for r in range(world_size) if r not in values]
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [values[r] for r in range(world_size)]


@dataclasses.dataclass
class Outcome:
    """One case of a :func:`run_cases` spawn."""

    #: every failing rank's traceback, or None where the case passed everywhere
    failure: str | None
    #: per rank, the transports (class name: count) opened during the case
    opened: list[dict[str, int]]


def _each_case(
    rank: int, world: int, run: Callable[[str, int, int], None], cases: list[str], stop: bool
) -> dict[str, tuple[str | None, dict[str, int]]]:
    """Every case on one rank, its outcome and the transports it opened (see :func:`run_cases`)."""
    outcome: dict[str, tuple[str | None, dict[str, int]]] = {}
    for i, case in enumerate(cases):
        with counting("transport_opened") as opened:
            try:
                run(case, rank, world)
                outcome[case] = (None, dict(opened))
            except Exception as err:
                outcome[case] = (traceback.format_exc(), dict(opened))
                if isinstance(err, AssertionError) and not stop:
                    continue
                for later in cases[i + 1 :]:
                    outcome[later] = (f"not run: case {case} raised on rank {rank}", {})
                break
    return outcome


def run_outcomes(
    run: Callable[[str, int, int], None],
    world_size: int,
    cases: list[str],
    *,
    stop_on_failed_check: bool = False,
    **kwargs: Any,
) -> dict[str, Outcome]:
    """Runs ``run(case, rank, world_size)`` for every case on one spawn of ranks.

    A check that fails (AssertionError) normally leaves the ranks in step, so
    the next case runs; any other error may have left this rank's collectives
    out of step with the others', so the remaining cases are reported as not
    run. With ``stop_on_failed_check`` a failed check stops the run too (for
    cases where a rank that did not raise as expected is out of step).

    Args:
        run: a module-level function, as for :func:`run_ranks`.
        world_size: number of ranks.
        cases: the case names, run in order.
        stop_on_failed_check: stop after a failed check too.
        **kwargs: passed to :func:`run_ranks` (``timeout``, ``pg_timeout``,
            ``env``...).

    Returns:
        For each case, the tracebacks of the ranks where it failed (or None)
        and the transports each rank opened while it ran.
    """
    per_rank = run_ranks(_each_case, world_size, run, cases, stop_on_failed_check, **kwargs)
    return {
        case: Outcome(
            "\n".join(
                f"--- rank {r} ---\n{res[case][0]}"
                for r, res in enumerate(per_rank)
                if res[case][0]
            )
            or None,
            [res[case][1] for res in per_rank],
        )
        for case in cases
    }


def run_cases(
    run: Callable[[str, int, int], None], world_size: int, cases: list[str], **kwargs: Any
) -> dict[str, str | None]:
    """:func:`run_outcomes` without the transports: for each case, the
    tracebacks of the ranks where it failed, or None."""
    outcomes = run_outcomes(run, world_size, cases, **kwargs)
    return {case: outcome.failure for case, outcome in outcomes.items()}


def outcomes_per_world_size(
    run: Callable[[str, int, int], None], cases: list[str], **kwargs: Any
) -> Callable[[int], dict[str, Outcome]]:
    """:func:`run_outcomes` once per world size, on first use, its outcome (or
    error) remembered: for a module-scoped fixture of tests parametrized by
    world size."""
    cache: dict[int, dict[str, Outcome] | BaseException] = {}

    def outcomes(world_size: int) -> dict[str, Outcome]:
        if world_size not in cache:
            try:
                cache[world_size] = run_outcomes(run, world_size, cases, **kwargs)
            except BaseException as err:
                cache[world_size] = err
        result = cache[world_size]
        if isinstance(result, BaseException):
            raise result
        return result

    return outcomes


def per_world_size(
    run: Callable[[str, int, int], None], cases: list[str], **kwargs: Any
) -> Callable[[int], dict[str, str | None]]:
    """:func:`outcomes_per_world_size` without the transports (see :func:`run_cases`)."""
    outcomes = outcomes_per_world_size(run, cases, **kwargs)

    def failures(world_size: int) -> dict[str, str | None]:
        return {case: outcome.failure for case, outcome in outcomes(world_size).items()}

    return failures


def transport_env(transport: str) -> dict[str, str]:
    """The environment that forces ``transport`` (one of :data:`TRANSPORTS`) in every rank."""
    return {config.VARIABLES["transport"]: transport}


def wrong_transport(opened: list[dict[str, int]], transport: str) -> str | None:
    """What is wrong with the transports the ranks opened, all forced to ``transport``; or None."""
    wanted = _CLASSES[transport]
    problems = [
        f"rank {r} opened {dict(counts) or 'no transport'}"
        for r, counts in enumerate(opened)
        if counts.get(wanted, 0) <= 0 or any(n for name, n in counts.items() if name != wanted)
    ]
    if not problems:
        return None
    return f"expected only {wanted} (QCOMM_TRANSPORT={transport}), but " + "; ".join(problems)


def check_case(outcome: Outcome, what: str, transport: str | None) -> None:
    """Fails the calling test with the case's tracebacks, or unless every rank
    opened the transport forced (when ``transport`` is given) and no other."""
    if outcome.failure:
        pytest.fail(f"{what}:\n{outcome.failure}", pytrace=False)
    if transport is not None and (problem := wrong_transport(outcome.opened, transport)):
        pytest.fail(f"{what}: {problem}", pytrace=False)
