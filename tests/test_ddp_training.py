"""The DDP hook and its all-reduce as training uses them, on 2 gloo ranks.

- One codec object shared by two DDP modules on two process groups (two
  hooks, two worker threads), and by two threads calling ``all_reduce`` on
  two groups: each call keeps its own record of what it encoded, so the
  results are bit for bit those of the same calls made one after the other.
  The codec makes the two threads' first encodes meet, so the calls are in
  flight together.

One spawn per transport (forced with ``QCOMM_TRANSPORT``) runs every case;
each case is reported as its own test, which also checks that the case's
calls opened the transport it names and no other.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env

import qcomm
from qcomm.collectives.all_reduce import Residuals, all_reduce

WORLD = 2
STEPS = 4


def rendezvous_int8(meet: threading.Barrier | None) -> Any:
    """An int8 codec whose first encode on each thread waits at ``meet``
    (when given) for another thread's first encode, noting the threads."""
    base: Any = type(qcomm.load_codec("int8"))

    class RendezvousInt8(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.meet = meet
            self.threads: set[int] = set()
            self.met = 0

        def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            me = threading.get_ident()
            if self.meet is not None and me not in self.threads:
                self.threads.add(me)
                self.meet.wait()
                self.met += 1
            return super().encode(input_tensor, ctx)  # type: ignore[no-any-return]

    return RendezvousInt8()


def coefficients(tag: str, n: int) -> torch.Tensor:
    """This rank's values for ``tag``: normal, scaled over four orders of magnitude."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}:{dist.get_rank()}".encode()))
    return torch.randn(n, generator=gen) * 10.0 ** torch.linspace(-3, 1, n)


class Linear(torch.nn.Module):
    """Parameters whose gradients are exactly the coefficients given."""

    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
        )

    def forward(self, coefs: list[torch.Tensor]) -> torch.Tensor:
        return sum(
            ((p * c.view(p.shape).to(p.dtype)).sum().float() for p, c in zip(self.ps, coefs)),
            torch.zeros(()),
        )


def grads(model: Any) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.module.ps]


# --------------------------------------------------------------------------
# The cases (run inside a rank).

SHARED_SHAPES = [(300,), (40, 7)]


def case_shared_codec_ddp(rank: int, world: int) -> None:
    # Two DDP modules on two groups, one codec object for both hooks; one
    # backward pass through both, so both workers reduce at once.
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    dtypes = [torch.float32] * len(SHARED_SHAPES)
    coefs = [
        [
            [coefficients(f"ddp:{k}:{s}:{i}", math.prod(n)) for i, n in enumerate(SHARED_SHAPES)]
            for s in range(STEPS)
        ]
        for k in range(2)
    ]

    def modules(codecs: list[Any]) -> list[Any]:
        out = []
        for k, group in enumerate(groups):
            model = torch.nn.parallel.DistributedDataParallel(
                Linear(SHARED_SHAPES, dtypes), process_group=group
            )
            model.register_comm_hook(
                *qcomm.ddp_comm_hook(codecs[k], error_feedback=True, process_group=group)
            )
            out.append(model)
        return out

    # One module after the other, each with its own codec.
    apart = modules([rendezvous_int8(None), rendezvous_int8(None)])
    expected = []
    for s in range(STEPS):
        for k, model in enumerate(apart):
            model.zero_grad()
            model(coefs[k][s]).backward()
        expected.append([grads(m) for m in apart])
    shared = rendezvous_int8(threading.Barrier(2, timeout=60))
    together = modules([shared, shared])
    for s in range(STEPS):
        for model in together:
            model.zero_grad()
        sum((m(coefs[k][s]) for k, m in enumerate(together)), torch.zeros(())).backward()
        got = [grads(m) for m in together]
        for k in range(2):
            for a, b in zip(got[k], expected[s][k]):
                assert torch.equal(a, b), f"step {s}, module {k}: not what it gives alone"
    assert shared.met == 2 and len(shared.threads) == 2, (
        f"the two hooks' encodes never met: {shared.met} on {shared.threads}"
    )


def case_shared_codec_threads(rank: int, world: int) -> None:
    # The public all_reduce from two threads, on two groups, one codec object.
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    inputs = [[coefficients(f"threads:{k}:{s}", 1000) for s in range(STEPS)] for k in range(2)]

    def run(codec: Any, k: int, out: list[Any]) -> None:
        try:
            residuals = Residuals()
            for x in inputs[k]:
                got = all_reduce(
                    x.clone(),
                    group=groups[k],
                    reduce_codec=codec,
                    gather_codec=codec,
                    average=True,
                    residuals=residuals,
                )
                out.append(got)
        except BaseException as err:  # noqa: BLE001 - reported below
            out.append(err)

    alone = rendezvous_int8(None)
    expected: list[list[Any]] = [[], []]
    for k in range(2):
        run(alone, k, expected[k])
    shared = rendezvous_int8(threading.Barrier(2, timeout=60))
    got: list[list[Any]] = [[], []]
    threads = [threading.Thread(target=run, args=(shared, k, got[k])) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread's all_reduce never returned"
    for k in range(2):
        failed = [x for x in got[k] if isinstance(x, BaseException)]
        assert not failed, f"thread {k}: {failed[0]!r}"
        assert len(got[k]) == STEPS
        for s in range(STEPS):
            assert torch.equal(got[k][s], expected[k][s]), f"thread {k}, step {s}: corrupted"
    assert shared.met == 2 and len(shared.threads) == 2, (
        f"the two threads' encodes never met: {shared.met} on {shared.threads}"
    )


CASES: dict[str, Callable[[int, int], None]] = {
    "shared_codec_ddp": case_shared_codec_ddp,
    "shared_codec_threads": case_shared_codec_threads,
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


@pytest.fixture(scope="module")
def spawned() -> dict[str, Callable[[int], dict[str, Outcome]]]:
    """Runs every case once per transport, on first use."""
    return {
        transport: outcomes_per_world_size(
            run_case, list(CASES), env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport in TRANSPORTS
    }


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ddp_training(
    transport: str, case: str, spawned: dict[str, Callable[[int], dict[str, Outcome]]]
) -> None:
    outcome = spawned[transport](WORLD)[case]
    check_case(outcome, f"{case} on {WORLD} ranks, {transport}", transport)
