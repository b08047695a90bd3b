"""The DDP hook's state through what training does to it, on 2 and 3 gloo ranks.

- A gradient that overflowed (inf, NaN) on any rank reaches the optimizer
  non-finite on every rank, with fp16, bf16 and the others, so that
  ``torch.amp.GradScaler`` skips the step; residuals stay finite.
- One ``(state, hook)`` pair on two DDP modules keeps each module's residuals
  apart.
- Residuals saved and restored are used from the first resumed step on, on a
  new DDP module (whose first buckets differ from its rebuilt ones) as on the
  same one, and with another codec.

How "used" is checked: with error feedback, what was applied over all steps
plus what the residuals still hold is the exact sum of the gradients. A few
steps of zero gradients drain the residuals (each step leaves only the
codec's error of the last), so afterwards the applied sum must be the exact
sum, up to float32 rounding: a residual lost or given to another module
shows as an error of the codec's size.
"""

from __future__ import annotations

import math
import pickle
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_bucket import Bucket
from dist_utils import per_world_size

import qcomm
from qcomm import CodecError
from qcomm.ddp import DDPCommHookState, all_reduce_hook

WORLD_SIZES = (2, 3)
U32 = 2.0**-24  # float32's unit roundoff
LINEAR = [(4, 3), (4,)]  # an nn.Linear(3, 4)'s parameters
# With a 10 KB bucket cap DDP makes several uneven buckets, and its rebuilt
# buckets hold other parameters than its first ones.
UNEVEN = [(3,), (1000,), (7, 5), (4099,), (33,), (1,), (600, 3)]
STEPS = 6
DRAIN = 8


class Params(torch.nn.Module):
    """Parameters of the given shapes; the loss is linear in them, so that
    each rank's gradient is exactly the coefficients it is given."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, coefs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p * c.view(p.shape)).sum() for p, c in zip(self.ps, coefs)), torch.zeros(()))


def forwarding(box, bucket):  # type: ignore[no-untyped-def]
    # (No annotations: DDP checks them against the real types.) The hook of
    # whatever state the box holds, so that a test can swap it.
    return all_reduce_hook(box[0], bucket)


def wrap(shapes: list[tuple[int, ...]], state: DDPCommHookState) -> Any:
    """A DDP module of ``Params(shapes)`` with the hook on a swappable state."""
    cap = 0.01 if len(shapes) > 2 else 25.0
    model: Any = torch.nn.parallel.DistributedDataParallel(Params(shapes), bucket_cap_mb=cap)
    box = [state]
    model.register_comm_hook(box, forwarding)
    model.box = box
    return model


def gradients(tag: str, shapes: list[tuple[int, ...]], world: int) -> list[list[torch.Tensor]]:
    """Every rank's coefficients, one tensor per shape, of magnitudes from 1e-3 to 10."""
    gen = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    out = []
    for _ in range(world):
        coefs = []
        for s in shapes:
            n = math.prod(s)
            coefs.append(torch.randn(n, generator=gen) * 10.0 ** torch.linspace(-3, 1, n))
        out.append(coefs)
    return out


def step(model: Any, coefs: list[torch.Tensor]) -> torch.Tensor:
    """One backward pass; the averaged gradient, flat, in float64."""
    model.zero_grad()
    model(coefs).backward()
    return torch.cat([p.grad.view(-1) for p in model.module.ps]).double()


def run(model: Any, coefs: list[torch.Tensor], steps: int) -> torch.Tensor:
    """The sum of ``steps`` steps' gradients."""
    return sum((step(model, coefs) for _ in range(steps)), torch.zeros((), dtype=torch.float64))


def drain(model: Any) -> torch.Tensor:
    """The sum of what ``DRAIN`` steps of zero gradients still apply."""
    zeros = [torch.zeros(math.prod(p.shape)) for p in model.module.ps]
    return run(model, zeros, DRAIN)


def exact_mean(coefs: list[torch.Tensor]) -> torch.Tensor:
    x = torch.cat(coefs).double()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def assert_drained(
    what: str, total: torch.Tensor, gs: list[list[torch.Tensor]], steps: int, specs: tuple[str, ...]
) -> None:
    """``total`` is ``steps`` times the exact average, up to float32 rounding."""
    rank = dist.get_rank()
    exact = steps * exact_mean(gs[rank])
    # Float32 rounding is not fed back: of the gradients, and of the residuals,
    # which near a large element of a codec's block may be as large as its
    # error there (here, the largest element anywhere). Each step rounds, and
    # so does carrying residuals to a new layout. The codecs' absolute error
    # bounds (up to 3e-8) are what a drained residual may keep.
    rho = max(qcomm.codec_info(qcomm.load_codec(s)).rel_error_bound for s in specs)
    flat = [torch.cat(g).abs().double() for g in gs]
    magnitude = sum((g + 2 * rho * g.max() for g in flat), torch.zeros(()))
    slack = (steps + DRAIN) * 8 * U32 * magnitude + 1e-7
    err = (total - exact).abs()
    bad = ~(err <= slack)
    if bad.any():
        worst = int((err / slack).nan_to_num(math.inf).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off the exact sum; worst "
            f"element {worst}: got {total[worst].item()}, exact {exact[worst].item()}, "
            f"{err[worst].item() / slack[worst].item():.0f} times the rounding slack"
        )


# --------------------------------------------------------------------------
# The cases (run inside a rank).


def case_nonfinite(rank: int, world: int) -> None:
    # As with PyTorch's fp16_compress_hook: a place that overflowed on one
    # rank is not finite on any, and GradScaler skips the step.
    shapes = [(5,), (300,), (7, 3)]
    places = [5 + 10, 5 + 11, 5 + 200]  # in the flat gradient, all in the second parameter
    elementwise = ("fp16", "bf16", "noop")
    for spec in ("fp16", "bf16", "int8", "mx4", "noop"):
        for feedback in (False, True):
            what = f"{spec}, feedback={feedback}"
            state, hook = qcomm.ddp_comm_hook(spec, error_feedback=feedback)
            model = wrap(shapes, state)
            params = list(model.module.parameters())
            opt = torch.optim.SGD(params, lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            for i in range(3):  # finite, overflowed, finite
                coefs = gradients(f"nonfinite:{spec}:{i}", shapes, world)[rank]
                if i == 1 and rank == 0:
                    coefs[1][10], coefs[1][11] = math.inf, -math.inf
                if i == 1 and rank == world - 1:
                    coefs[1][200] = math.nan
                before = [p.detach().clone() for p in params]
                scale = scaler.get_scale()
                opt.zero_grad()
                scaler.scale(model(coefs)).backward()
                grad = torch.cat([p.grad.view(-1) for p in params])
                finite = torch.isfinite(grad)
                if i == 1:
                    assert not finite[places].any(), (
                        f"{what}: the overflowed places came back as {grad[places].tolist()}"
                    )
                    if spec in elementwise:
                        assert int(finite.sum()) == grad.numel() - len(places), (
                            f"{what}: {grad.numel() - int(finite.sum())} places not finite"
                        )
                else:
                    assert finite.all(), f"{what}, step {i}: a finite step came back not finite"
                for index, entry in state.state_dict()["residuals"].items():
                    for name in ("scatter", "gather"):
                        assert torch.isfinite(entry[name]).all(), (
                            f"{what}, step {i}: residuals[{index}][{name!r}] not finite"
                        )
                scaler.step(opt)
                scaler.update()
                same = all(torch.equal(p, b) for p, b in zip(params, before))
                if i == 1:
                    assert same, f"{what}: GradScaler applied the overflowed step"
                    assert scaler.get_scale() == scale / 2, f"{what}: the scale was not lowered"
                else:
                    assert not same, f"{what}, step {i}: GradScaler skipped a finite step"
    # A bucket of float16 parameters, and a place that is NaN on one rank and
    # infinite on another.
    for spec in ("fp16", "bf16"):
        state, hook = qcomm.ddp_comm_hook(spec, error_feedback=True)
        x = torch.linspace(-2, 2, 100, dtype=torch.float16)
        x[7] = math.inf if rank == 0 else math.nan
        got = hook(state, Bucket(x)).wait()
        finite = torch.isfinite(got)
        assert not finite[7] and int(finite.sum()) == 99, f"{spec} on float16: {got[7].item()}"


def case_two_modules(rank: int, world: int) -> None:
    # One pair on two modules with buckets of the same shapes (and so the
    # same bucket indices and layouts): each keeps its own residuals, also
    # saved and restored.
    state, hook = qcomm.ddp_comm_hook("int8", error_feedback=True)
    gs = [gradients("two:a", LINEAR, world), gradients("two:b", LINEAR, world)]
    for g in gs[1]:
        g[0].mul_(-30.0)
    models = [wrap(LINEAR, state) for _ in gs]
    totals = [torch.zeros(()), torch.zeros(())]
    for _ in range(STEPS):
        for k, model in enumerate(models):
            totals[k] = totals[k] + step(model, gs[k][rank])
    saved = state.state_dict()
    assert len(saved["residuals"]) == 2, f"residuals of {len(saved['residuals'])} bucket(s)"
    restored = DDPCommHookState("int8", error_feedback=True)
    restored.load_state_dict(saved)
    # Going on with the same modules, and with new ones on the restored state.
    again = [wrap(LINEAR, restored) for _ in gs]
    for what, ms, st in (("same modules", models, state), ("restored", again, restored)):
        for k, model in enumerate(ms):
            total = totals[k] + drain(model)
            assert_drained(f"module {k}, {what}", total, gs[k], STEPS, ("int8",))
        assert st.resets == 0, f"{what}: resets {st.resets}"


def check_resume(
    rank: int, world: int, shapes: list[tuple[int, ...]], specs: tuple[str, str]
) -> None:
    """``specs[0]`` for ``STEPS`` steps; then, with ``specs[1]``, the residuals
    restored on the same DDP module, on a new one, pickled, and saved in the
    format of version 1 (which knew nothing of parameters)."""
    first, then = specs
    gs = gradients(f"resume:{len(shapes)}", shapes, world)
    state, hook = qcomm.ddp_comm_hook(first, error_feedback=True)
    model = wrap(shapes, state)
    total = run(model, gs[rank], STEPS)
    saved, blob = state.state_dict(), pickle.dumps(state)
    assert len(saved["residuals"]) >= (2 if len(shapes) > 2 else 1)
    old = {
        "version": 1,
        "error_feedback": True,
        "residuals": {
            k: {
                "layout": [e["layout"][f] for f in ("numel", "dtype", "world", "rank", "shapes")],
                "scatter": e["scatter"],
                "gather": e["gather"],
            }
            for k, e in saved["residuals"].items()
        },
    }
    hows = ["same module", "new module", "pickled", "version 1", "going on"]
    for how in hows if first == then else [h for h in hows if h != "version 1"]:
        what = f"{first} then {then}, {how}, {len(shapes)} parameters"
        if how == "pickled":
            restored = pickle.loads(blob)  # with the first codec
        elif how == "going on":
            restored = state
        else:
            restored = DDPCommHookState(then, error_feedback=True)
            restored.load_state_dict(old if how == "version 1" else saved)
        if how in ("same module", "version 1", "going on"):
            resumed = model
            model.box[0] = restored
        else:
            resumed = wrap(shapes, restored)
        assert_drained(what, total + drain(resumed), gs, STEPS, specs)
        assert restored.resets == 0, f"{what}: resets {restored.resets}"
        model.box[0] = state


def case_resume(rank: int, world: int) -> None:
    for shapes in (LINEAR, UNEVEN):
        check_resume(rank, world, shapes, ("int8", "int8"))


def case_codec_change(rank: int, world: int) -> None:
    for specs in (("int8", "fp16"), ("fp16", "int8"), ("int8", "mx4")):
        check_resume(rank, world, LINEAR, specs)
    check_resume(rank, world, UNEVEN, ("int8", "fp16"))


def case_linear(rank: int, world: int) -> None:
    # A real nn.Linear, saved after its buckets were rebuilt and restored on a
    # new DDP module, whose first bucket orders its parameters otherwise.
    torch.manual_seed(0)
    state, hook = qcomm.ddp_comm_hook("int8", error_feedback=True)
    linear = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4))
    linear.register_comm_hook(state, hook)
    for _ in range(3):
        linear(torch.randn(2, 3)).sum().backward()
    restored, _ = qcomm.ddp_comm_hook("int8", error_feedback=True)
    restored.load_state_dict(state.state_dict())
    again = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4))
    again.register_comm_hook(restored, hook)
    for _ in range(3):
        again(torch.randn(2, 3)).sum().backward()
    assert restored.resets == 0, f"resets {restored.resets}"


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (case_nonfinite, case_two_modules, case_resume, case_linear, case_codec_change)
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


Spawned = Callable[[int], dict[str, Any]]


@pytest.fixture(scope="module")
def spawned() -> Spawned:
    """Runs every case once per world size, on first use."""
    return per_world_size(run_case, list(CASES), timeout=600.0, pg_timeout=30.0)


def check(spawned: Spawned, world: int, case: Callable[[int, int], None]) -> None:
    """Fails the calling test with ``case``'s tracebacks on ``world`` ranks."""
    outcome = spawned(world)[case.__name__]
    failure = getattr(outcome, "failure", outcome)  # an Outcome, or the text itself
    if failure:
        pytest.fail(f"{case.__name__} on {world} ranks:\n{failure}", pytrace=False)


# Each test checks its case of the spawn, on each world size.


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_gradient_that_overflowed_on_one_rank_is_non_finite_on_every_rank(
    world: int, spawned: Spawned
) -> None:
    check(spawned, world, case_nonfinite)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_one_hook_on_two_modules_keeps_each_modules_residuals_apart(
    world: int, spawned: Spawned
) -> None:
    check(spawned, world, case_two_modules)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_restored_residuals_are_used_from_the_first_resumed_step(
    world: int, spawned: Spawned
) -> None:
    check(spawned, world, case_resume)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_linear_layer_restored_on_a_new_ddp_module_resumes_its_residuals(
    world: int, spawned: Spawned
) -> None:
    check(spawned, world, case_linear)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_restored_residuals_are_used_under_another_codec(world: int, spawned: Spawned) -> None:
    check(spawned, world, case_codec_change)


# --------------------------------------------------------------------------
# What needs no peers.


def test_codec_class_is_refused_where_it_is_given() -> None:
    # A codec class, not an instance: refused at once, as the registry does.
    cls = type(qcomm.load_codec("int8"))
    with pytest.raises(CodecError) as registry:
        qcomm.build_registry(forward=cls)
    problem = str(registry.value).split(", got ", 1)[1]
    assert problem.startswith("the class Int8Codec"), problem
    for kwargs, name in (
        ({"spec": cls}, "spec"),
        ({"spec": "int8", "gather": cls}, "gather"),
        ({"spec": None, "gather": cls}, "gather"),
        ({"spec": cls, "gather": "fp16"}, "spec"),
    ):
        for make in (qcomm.ddp_comm_hook, DDPCommHookState):
            with pytest.raises(CodecError) as err:
                make(**kwargs)
            assert str(err.value).startswith(f"{name}: "), str(err.value)
            assert str(err.value).endswith(f"got {problem}"), str(err.value)
