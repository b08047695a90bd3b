"""The DDP hook and its all-reduce as training uses them, on 2 gloo ranks.

- One codec object shared by two DDP modules on two process groups (two
  hooks, two worker threads), and by two threads calling ``all_reduce`` on
  two groups: each call keeps its own record of what it encoded, so the
  results are bit for bit those of the same calls made one after the other.
  The codec makes the two threads' first encodes meet, so the calls are in
  flight together.
- A bfloat16 and a float32 parameter with the int8 hook and error feedback,
  150 steps of a fixed gradient: the sum of what was applied drifts from the
  exact sum by no more than what the residuals hold at the end, bfloat16 as
  float32 (the bfloat16 bucket's residual sums and the rounding of its result
  carried in float32); without feedback it drifts far beyond.
- Resuming: 8 training steps (int8 with error feedback, SGD with momentum)
  in one go, against 4 steps, a checkpoint (model, optimizer, hook state) and
  4 more in fresh processes: the same losses and weights, bit for bit,
  although the resumed DDP's first bucket holds every parameter and the
  residuals were saved from its rebuilt buckets; with DDP's default options
  and with a static graph (whose first two steps hand over one bucket).

One spawn per transport (forced with ``QCOMM_TRANSPORT``) runs every case,
a second one the resumed steps; each case is reported as its own test, which
also checks that the case's calls opened the transport it names and no
other.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from ddp_bucket import Bucket
from dist_utils import TRANSPORTS, Outcome, check_case, run_outcomes, transport_env

import qcomm
from qcomm.collectives.all_reduce import Residuals, all_reduce
from qcomm.ddp import DDPCommHookState

WORLD = 2
STEPS = 4
U32 = 2.0**-24  # float32's unit roundoff


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


DRIFT_STEPS = 150
MIXED: list[tuple[int, ...]] = [(1000,), (1000,)]
MIXED_DTYPES = [torch.bfloat16, torch.float32]


def case_bf16_feedback(rank: int, world: int) -> None:
    # A fixed gradient for 150 steps, on a bfloat16 and a float32 parameter
    # (one bucket each): with error feedback what was applied in sum stays
    # within what the residuals hold at the end, for both.
    gs = [
        coefficients(f"mixed:{i}", math.prod(n)).to(d)
        for i, (n, d) in enumerate(zip(MIXED, MIXED_DTYPES))
    ]
    exact = [g.double() for g in gs]
    big = [g.double().abs().max() for g in gs]
    for x in exact:
        dist.all_reduce(x)
        x /= world
    for m in big:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    info = qcomm.codec_info(qcomm.load_codec("int8"))
    rho, alpha = info.rel_error_bound, info.abs_error_bound
    drift: dict[bool, list[float]] = {}
    for feedback in (True, False):
        model = torch.nn.parallel.DistributedDataParallel(Linear(MIXED, MIXED_DTYPES))
        state, hook = qcomm.ddp_comm_hook("int8", error_feedback=feedback)
        model.register_comm_hook(state, hook)
        totals = [torch.zeros(math.prod(n), dtype=torch.float64) for n in MIXED]
        for _ in range(DRIFT_STEPS):
            model.zero_grad()
            model(gs).backward()
            for total, p in zip(totals, model.module.ps):
                total += p.grad.double().view(-1)
        drift[feedback] = [
            ((t - DRIFT_STEPS * e).abs().max() / m).item() for t, e, m in zip(totals, exact, big)
        ]
        if feedback:
            dtypes = {e["layout"]["dtype"] for e in state.state_dict()["residuals"].values()}
            assert dtypes == {"torch.bfloat16", "torch.float32"}, f"buckets of {dtypes}"
    bounds = []
    for i, dtype in enumerate(MIXED_DTYPES):
        # What the residuals hold at the end, over max|g|: the reduce-scatter
        # codec's error on g + e (e its own residual), then the all-gather
        # codec's on the average plus its residual and the rounding of the
        # result into the bucket (half an ulp: delta), which it carries too.
        # Each step's float32 rounding of the sums is not carried.
        delta = torch.finfo(dtype).eps / 2 if dtype != torch.float32 else 0.0
        a = alpha / big[i].item()
        carried = (rho + a) / (1 - rho) + (rho + a + delta) / (1 - rho - delta)
        bounds.append(carried + DRIFT_STEPS * 8 * U32 * world)
    for i, dtype in enumerate(MIXED_DTYPES):
        assert drift[True][i] <= bounds[i], (
            f"{dtype} with error feedback: drift {drift[True][i]:.4f} of max|g| after "
            f"{DRIFT_STEPS} steps, beyond {bounds[i]:.4f} (without: {drift[False][i]:.4f})"
        )
    assert drift[False][0] > 10 * bounds[0], (
        f"without error feedback the bfloat16 drift is only {drift[False][0]:.4f}; the case "
        f"cannot tell feedback from none"
    )


RESUME_STEPS = 8
RESUME_AT = 4
RESUME_DIR = "QCOMM_TEST_RESUME_DIR"  # where the spawns keep their checkpoints
# DDP's own options: by default its first step hands over one bucket; with a
# static graph its first two do.
DDP_OPTIONS: dict[str, dict[str, Any]] = {"default": {}, "static": {"static_graph": True}}


def mlp() -> torch.nn.Module:
    """A small MLP whose parameters DDP splits into several buckets (of 10 KB)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )


def train(model: Any, opt: Any, first: int, last: int) -> list[torch.Tensor]:
    """Steps ``first`` to ``last - 1`` on this rank's data; their losses."""
    losses = []
    for t in range(first, last):
        gen = torch.Generator().manual_seed(zlib.crc32(f"data:{dist.get_rank()}:{t}".encode()))
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def trainer(
    module: torch.nn.Module,
    options: dict[str, Any],
    hook_state: Any = None,
    seen: list[int] | None = None,
    walks: list[Walk] | None = None,
) -> tuple[Any, Any, Any]:
    """DDP of ``module`` (with ``options``) with the int8 hook and error feedback,
    and SGD with momentum; ``seen`` gets the number of parameters of every
    bucket hooked, ``walks`` (see :func:`counting_walks`) what the hook's
    look for restored buckets walked."""
    model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.01, **options)
    state, hook = qcomm.ddp_comm_hook("int8", error_feedback=True)
    if hook_state is not None:
        state.load_state_dict(hook_state)
    if walks is not None:
        counting_walks(state, walks)

    def counting(state, bucket):  # type: ignore[no-untyped-def]
        # (No annotations: DDP checks them against the real types.)
        if seen is not None:
            seen.append(len(bucket.parameters()))
        return hook(state, bucket)

    model.register_comm_hook(state, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, state


@dataclasses.dataclass
class Walk:
    """What the hook's look for restored buckets did with one bucket."""

    params: int  # the bucket's parameters
    walked: int  # how many of them it numbered
    regrouped: bool  # whether it found restored buckets held whole


def counting_walks(state: Any, walks: list[Walk]) -> None:
    """Has ``walks`` get, for every bucket the hook looks at for restored
    buckets (``state._regroup``), its parameters, how many of them the look
    numbered (walked) and whether it regrouped the bucket."""
    regroup, number = state._regroup, state._number
    walked = [0]

    def counted_number(param: torch.Tensor) -> Any:
        walked[0] += 1
        return number(param)

    def counted_regroup(bucket: Any) -> Any:
        walked[0] = 0
        state._number = counted_number
        try:
            parts = regroup(bucket)
        finally:
            del state._number
        walks.append(Walk(len(bucket.parameters()), walked[0], parts is not None))
        return parts

    state._regroup = counted_regroup


def version_2(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A hook state as qcomm wrote it before version 3: each layout a list of
    its fields in this order (see ``V2_WRITTEN``)."""
    order = ("numel", "dtype", "world", "rank", "shapes", "start", "stop")
    residuals = {
        k: {**e, "layout": [e["layout"][name] for name in order]}
        for k, e in state_dict["residuals"].items()
    }
    return {**state_dict, "version": 2, "residuals": residuals}


def saved(name: str, how: str) -> str:
    return os.path.join(os.environ[RESUME_DIR], f"{name}-{how}-{dist.get_rank()}.pt")


def case_resume_whole(rank: int, world: int) -> None:
    # All the steps in one go, and the first part saved as a checkpoint.
    for how, options in DDP_OPTIONS.items():
        model, opt, state = trainer(mlp(), options)
        losses = train(model, opt, 0, RESUME_STEPS)
        assert len(state.state_dict()["residuals"]) >= 2, "the case wants several buckets"
        torch.save({"losses": losses, "weights": model.module.state_dict()}, saved("whole", how))
        model, opt, state = trainer(mlp(), options)
        train(model, opt, 0, RESUME_AT)
        checkpoint = {"model": model.module.state_dict(), "opt": opt.state_dict()}
        torch.save({**checkpoint, "hook": state.state_dict()}, saved("checkpoint", how))


def resume(how: str, hook_state: Callable[[Any], Any], walks: list[Walk] | None = None) -> None:
    """In a fresh process: the checkpoint restored (its hook state through
    ``hook_state``), the rest of the steps, bit for bit those in one go."""
    whole = torch.load(saved("whole", how))
    checkpoint = torch.load(saved("checkpoint", how))
    module = mlp()
    module.load_state_dict(checkpoint["model"])
    seen: list[int] = []
    model, opt, state = trainer(
        module, DDP_OPTIONS[how], hook_state(checkpoint["hook"]), seen, walks
    )
    opt.load_state_dict(checkpoint["opt"])
    losses = train(model, opt, RESUME_AT, RESUME_STEPS)
    # DDP's first step hands every parameter in one bucket; the residuals
    # were saved from its rebuilt buckets, several.
    params = len(list(model.parameters()))
    assert seen[0] == params, f"{how}: first resumed step: buckets of {seen} parameters"
    assert len(checkpoint["hook"]["residuals"]) > 1, "the case wants several saved buckets"
    for t, (a, b) in enumerate(zip(losses, whole["losses"][RESUME_AT:]), RESUME_AT):
        assert torch.equal(a, b), f"{how}: step {t}: loss {a.item()!r}, in one go {b.item()!r}"
    for name, w in model.module.state_dict().items():
        assert torch.equal(w, whole["weights"][name]), f"{how}: {name} differs"
    assert state.resets == 0, f"{how}: resets {state.resets}"


def case_resume_rest(rank: int, world: int) -> None:
    for how in DDP_OPTIONS:
        resume(how, lambda hook: hook)


def case_resume_from_version_2(rank: int, world: int) -> None:
    # The checkpoint's hook state as qcomm wrote it before version 3.
    for how in DDP_OPTIONS:
        resume(how, lambda hook: version_2(hook))


def case_resume_stops_looking(rank: int, world: int) -> None:
    # Once DDP's buckets are those saved, the hook's look for restored
    # buckets held whole stops at each bucket's first parameter.
    for how in DDP_OPTIONS:
        walks: list[Walk] = []
        resume(how, lambda hook: hook, walks)
        params = len(list(mlp().parameters()))
        # One bucket of every parameter on the first step, two with a static
        # graph: each regrouped into the buckets saved.
        whole = [w for w in walks if w.params == params]
        assert len(whole) == (2 if how == "static" else 1), f"{how}: {walks}"
        assert all(w.regrouped for w in whole), f"{how}: {walks}"
        # Then DDP's rebuilt buckets, as many each step; those of the last step.
        rebuilt = walks[len(whole) :]
        last = rebuilt[-len(rebuilt) // (RESUME_STEPS - RESUME_AT - len(whole)) :]
        assert max(w.params for w in last) > 1, f"{how}: the case wants a bucket of parameters"
        assert all(w.walked <= 1 for w in last), f"{how}: the last step walked {last}"


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (
        case_shared_codec_ddp,
        case_shared_codec_threads,
        case_bf16_feedback,
        case_resume_whole,
    )
}
# In a spawn of their own, after the others.
LATER: dict[str, Callable[[int, int], None]] = {
    f.__name__: f for f in (case_resume_rest, case_resume_from_version_2, case_resume_stops_looking)
}


def run_case(case: str, rank: int, world: int) -> None:
    {**CASES, **LATER}[case](rank, world)


Spawned = dict[str, Callable[[], dict[str, Outcome]]]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    """Per transport, on first use: every case in one spawn, then the later
    cases in another (fresh processes), which read what the first saved."""
    cache: dict[str, dict[str, Outcome] | BaseException] = {}

    def outcomes(transport: str) -> dict[str, Outcome]:
        if transport not in cache:
            env = {**transport_env(transport), RESUME_DIR: str(tmp_path_factory.mktemp(transport))}
            kwargs: dict[str, Any] = {"env": env, "timeout": 600.0, "pg_timeout": 30.0}
            try:
                first = run_outcomes(run_case, WORLD, list(CASES), **kwargs)
                later = run_outcomes(run_case, WORLD, list(LATER), **kwargs)
                cache[transport] = {**first, **later}
            except BaseException as err:  # noqa: BLE001 - every test of the spawn reports it
                cache[transport] = err
        result = cache[transport]
        if isinstance(result, BaseException):
            raise result
        return result

    return {t: functools.partial(outcomes, t) for t in TRANSPORTS}


def check(spawned: Spawned, transport: str, case: Callable[[int, int], None]) -> None:
    """Fails the calling test with ``case``'s tracebacks, or unless every rank
    opened ``transport`` only."""
    name = case.__name__
    check_case(spawned[transport]()[name], f"{name} on {WORLD} ranks, {transport}", transport)


# Each test checks its case of the spawns, on each transport.


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_codec_shared_by_two_ddp_modules_reducing_at_once(
    transport: str, spawned: Spawned
) -> None:
    check(spawned, transport, case_shared_codec_ddp)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_codec_shared_by_all_reduces_on_two_threads(transport: str, spawned: Spawned) -> None:
    check(spawned, transport, case_shared_codec_threads)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_feedback_on_bfloat16_keeps_the_applied_sum_within_the_residuals(
    transport: str, spawned: Spawned
) -> None:
    check(spawned, transport, case_bf16_feedback)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_training_in_one_go_saves_its_checkpoint_half_way(transport: str, spawned: Spawned) -> None:
    check(spawned, transport, case_resume_whole)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_training_resumed_in_a_fresh_process_matches_training_in_one_go(
    transport: str, spawned: Spawned
) -> None:
    check(spawned, transport, case_resume_rest)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_training_resumed_from_a_version_2_state_matches_training_in_one_go(
    transport: str, spawned: Spawned
) -> None:
    check(spawned, transport, case_resume_from_version_2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_once_buckets_are_those_saved_the_look_for_restored_ones_stops_at_their_first_parameter(
    transport: str, spawned: Spawned
) -> None:
    check(spawned, transport, case_resume_stops_looking)


# --------------------------------------------------------------------------
# What needs no peers: the format of version 2.

# What qcomm wrote before version 3 (at 66657b0) for BUCKETS hooked with int8
# and error feedback on one rank (its residuals zero, nothing being lost
# alone), the tensors as lists.
V2_WRITTEN: dict[str, Any] = {
    "version": 2,
    "error_feedback": True,
    "residuals": {
        0: {
            "index": 0,
            "layout": [16, "torch.float32", 1, 0, [[4, 3], [4]], 0, 16],
            "params": [0, 1],
            "scatter": [0.0] * 16,
            "gather": [0.0] * 16,
        },
        1: {
            "index": 1,
            "layout": [40, "torch.float32", 1, 0, [[40]], 0, 40],
            "params": [2],
            "scatter": [0.0] * 40,
            "gather": [0.0] * 40,
        },
    },
}
# elements, index, shapes
BUCKETS: list[tuple[int, int, Any]] = [(16, 0, ((4, 3), (4,))), (40, 1, ((40,),))]


def as_lists(state_dict: dict[str, Any]) -> dict[str, Any]:
    residuals = {
        k: {**e, **{t: e[t].tolist() for t in ("scatter", "gather")}}
        for k, e in state_dict["residuals"].items()
    }
    return {**state_dict, "residuals": residuals}


def test_version_2_states_load_and_are_used() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state, hook = qcomm.ddp_comm_hook("int8", error_feedback=True)
        buckets = [Bucket(torch.arange(float(n)), index, shapes) for n, index, shapes in BUCKETS]
        for bucket in buckets:
            hook(state, bucket).wait()
        saved = state.state_dict()
        assert saved["version"] == 3
        # The tests' version 2 (resume_from_version_2) is what qcomm wrote.
        assert as_lists(version_2(saved)) == V2_WRITTEN
        # Written so, residuals of any value load, as version 3 would, and
        # the buckets of the same parameters take them.
        old = copy.deepcopy(V2_WRITTEN)
        for k, e in old["residuals"].items():
            e["scatter"] = torch.arange(len(e["scatter"]), dtype=torch.float32) + k + 1
            e["gather"] = -torch.arange(len(e["gather"]), dtype=torch.float32) - k
        restored = DDPCommHookState("int8", error_feedback=True)
        restored.load_state_dict(old)
        again = restored.state_dict()
        assert again["version"] == 3 and version_2(again)["residuals"].keys() == {0, 1}
        assert as_lists(version_2(again)) == as_lists(old)
        for bucket in buckets:
            hook(restored, bucket).wait()  # alone: nothing is lost, nothing changes
            got = restored.residuals(cast(Any, bucket))
            for name in ("scatter", "gather"):
                expected = old["residuals"][bucket.index()][name]
                assert torch.equal(getattr(got, name), expected), f"{bucket.index()} {name}"
        assert restored.resets == 0
    finally:
        dist.destroy_process_group()
