"""The DDP communication hook (``qcomm.ddp_comm_hook``) on 2 and 3 gloo ranks.

Every rank draws every rank's gradients from fixed seeds, computes the exact
average with ``dist.all_reduce`` in float64, and checks what the hook gave it:

- within the bound the codecs declare (:class:`~qcomm.CodecInfo`), summed
  over the ranks (see :func:`step_bound`), for every installed codec, on
  buckets of uneven sizes, with and without error feedback;
- the same bits on every rank (data-parallel replicas must not drift apart);
- with error feedback, the sum over 100 steps of a fixed gradient stays
  within one step's bound of the exact sum; without it, it drifts (a
  deterministic codec makes the same error every step);
- through a real ``DistributedDataParallel`` whose buckets are uneven and
  rebuilt after the first step;
- the state saved and restored (``state_dict`` and pickling) continues
  bit for bit, and a bucket whose layout changes starts again from zero.

One spawn per world size and transport (forced with ``QCOMM_TRANSPORT``:
gloo's point-to-point, and the all-to-all NCCL takes) runs every case; each
case is reported as its own test, which also checks that the case's calls
opened the transport it names and no other. Argument checks that need no
peers run in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from codec_names import suite_codecs
from ddp_bucket import Bucket
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env

import qcomm
import qcomm.cli
from qcomm import CodecError, CodecInfo, config
from qcomm.collectives.all_reduce import Residuals, all_reduce, layout
from qcomm.ddp import DDPCommHookState, all_reduce_hook

WORLD_SIZES = (2, 3)
U32 = 2.0**-24  # float32's unit roundoff
# Bucket lengths: shorter than a block, not a multiple of any block, longer
# than a chunk (the hook's cases run with a small chunk size too).
SIZES = (1, 7, 33, 1000, 4099)
STEPS = 100
# The codecs of tests/support/codec_names.py (the example plugin goes through the
# same door as the built-in ones), less int4 and fp8_e4m3_tensor, which this
# suite's bounds were never written for.
CODECS = ["noop", *(c for c in suite_codecs() if c not in ("fp8_e4m3_tensor", "int4"))]
# Error feedback on one codec of each kind: per element (bf16), per block
# with min/max (int8), per block floating point (fp8, MX4), a plugin's.
FEEDBACK = [c for c in ("bf16", "int8", "fp8_e4m3", "mx4", "example_fp16_scaled") if c in CODECS]


# --------------------------------------------------------------------------
# Bounds, from what the codecs declare.


def window_max(x: torch.Tensor, info: CodecInfo) -> torch.Tensor:
    """An upper bound of ``s`` of every element (see :class:`~qcomm.CodecInfo`)
    whatever block it is encoded in: the largest magnitude within one block's
    length on either side (the whole tensor for ``error_block == 0``)."""
    a = x.abs().double()
    if info.error_block == 1 or a.numel() == 0:
        return a
    if info.error_block == 0:
        return torch.full_like(a, a.max().item())
    b = info.error_block
    return F.max_pool1d(a.view(1, 1, -1), 2 * b - 1, stride=1, padding=b - 1).view(-1)


def step_bound(
    gs: list[torch.Tensor], reduce: CodecInfo, gather: CodecInfo, feedback: bool
) -> torch.Tensor:
    r"""How far one step's average may be from the exact one, per element.

    Every rank's value is encoded by the reduce-scatter codec (counted for
    all :math:`n` ranks, though a rank's own block travels unencoded):
    :math:`E_1 = \frac1n \sum_r (\rho_1 s(g_r) + \alpha_1)`. The all-gather
    codec encodes the average, off by at most :math:`E_1`:
    :math:`E_2 = \rho_2 s(|m| + E_1) + \alpha_2`. Plus float32 rounding of the
    sums and of the division.

    With error feedback a rank encodes :math:`x = g + e` with :math:`e` the
    residual, itself bounded by the codec on :math:`x`, so the largest
    magnitude :math:`M` of a block obeys :math:`M \le s(g) + \rho M + \alpha`:
    the scales are :math:`(s + \alpha) / (1 - \rho)`, and the all-gather's
    input is off by the residuals coming in and going out, :math:`2 E_1`.
    (A step's own result may be off by twice what this returns: see
    :func:`~qcomm.collectives.all_reduce.all_reduce`.)
    """
    n = len(gs)
    r1, a1, r2, a2 = (reduce.rel_error_bound, reduce.abs_error_bound,
                      gather.rel_error_bound, gather.abs_error_bound)  # fmt: skip
    scales = [window_max(g, reduce) for g in gs]
    if feedback:
        scales = [(s + a1) / (1 - r1) for s in scales]
    e1 = sum(r1 * s + a1 for s in scales) / n
    m = torch.stack(gs).double().mean(0)
    s2 = window_max(m.abs() + (2 if feedback else 1) * e1, gather)
    if feedback:
        s2 = (s2 + a2) / (1 - r2)
    e2 = r2 * s2 + a2
    partial = sum(g.abs().double() for g in gs)
    return e1 + e2 + 8 * U32 * (partial + n * (e1 + e2))


def assert_within(what: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - ref.double()).abs()
    bad = ~(err <= bound)  # a NaN is bad too
    if bad.any():
        worst = int((err - bound).nan_to_num(math.inf).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements beyond the bound; worst "
            f"element {worst}: got {got[worst].item()}, exact {ref[worst].item()}, "
            f"bound {bound[worst].item()}"
        )


# --------------------------------------------------------------------------
# The checks (run inside a rank).


def gradients(tag: str, n: int, world: int) -> list[torch.Tensor]:
    """Every rank's gradient: normal values whose scale changes along the
    buffer over four orders of magnitude, and a run of zeros."""
    gen = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    scale = 10.0 ** torch.linspace(-3, 1, n)
    out = []
    for _ in range(world):
        g = torch.randn(n, generator=gen) * scale
        g[n // 3 : n // 3 + n // 10] = 0.0
        out.append(g)
    return out


def exact_mean(g: torch.Tensor) -> torch.Tensor:
    x = g.double().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def assert_same_on_all_ranks(what: str, x: torch.Tensor) -> None:
    world = dist.get_world_size()
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x.contiguous())
    differ = [r for r in range(world) if not torch.equal(everyone[r], everyone[0])]
    assert not differ, f"{what}: ranks {differ} hold other values than rank 0"


def info_of(spec: str) -> CodecInfo:
    info = qcomm.codec_info(qcomm.load_codec(spec))
    assert math.isfinite(info.rel_error_bound), f"{spec} declares no error bound"
    return info


def case_hook(rank: int, world: int, spec: str) -> None:
    info = info_of(spec)
    for feedback in (False, True):
        for chunk in (None, 256):
            state, hook = qcomm.ddp_comm_hook(spec, error_feedback=feedback, chunk_bytes=chunk)
            for index, n in enumerate(SIZES):
                gs = gradients(f"{spec}:{n}", n, world)
                ref = exact_mean(gs[rank])
                bound = step_bound(gs, info, info, feedback)
                for step in range(2 if feedback else 1):
                    got = hook(state, Bucket(gs[rank].clone(), index)).wait()
                    what = f"{spec}, {n} elements, feedback={feedback}, chunk={chunk}, step {step}"
                    # A step with feedback also carries the last step's residual.
                    assert_within(what, got, ref, bound * (1 if step == 0 else 2))
                    assert_same_on_all_ranks(what, got)


def case_feedback(rank: int, world: int, spec: str) -> None:
    info = info_of(spec)
    n = 1000
    gs = gradients(f"fixed:{spec}", n, world)
    ref = exact_mean(gs[rank])
    sums = {}
    for feedback in (True, False):
        state, hook = qcomm.ddp_comm_hook(spec, error_feedback=feedback)
        total = torch.zeros(n, dtype=torch.float64)
        for _ in range(STEPS):
            total += hook(state, Bucket(gs[rank].clone())).wait().double()
        sums[feedback] = total
    one = step_bound(gs, info, info, True)
    # Each step's float32 rounding is not fed back: it may add up.
    slack = STEPS * 8 * U32 * sum(g.abs().double() for g in gs)
    assert_within(
        f"{spec}: sum of {STEPS} steps with feedback", sums[True], STEPS * ref, one + slack
    )
    drift = ((sums[False] - STEPS * ref).abs() / step_bound(gs, info, info, False)).max().item()
    assert drift > 5, (
        f"{spec}: without feedback the sum of {STEPS} steps stays within {drift:.2f} times "
        f"one step's bound; expected it to drift"
    )


class Params(torch.nn.Module):
    """Parameters of uneven shapes; the loss is linear in them, so that each
    rank's gradient is exactly the coefficients it is given."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, coefs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p * c.view(p.shape)).sum() for p, c in zip(self.ps, coefs)), torch.zeros(()))


def case_ddp(rank: int, world: int) -> None:
    # With a 10 KB bucket cap DDP makes several uneven buckets, and rebuilds
    # them after the first step.
    shapes = [(3,), (1000,), (7, 5), (4099,), (33,), (1,), (600, 3)]
    for spec, feedback in (("int8", True), ("mx4", False), ("noop", True)):
        model = torch.nn.parallel.DistributedDataParallel(Params(shapes), bucket_cap_mb=0.01)
        state, hook = qcomm.ddp_comm_hook(spec, error_feedback=feedback)
        seen: set[int] = set()

        def counting(state, bucket, seen=seen, hook=hook):  # type: ignore[no-untyped-def]
            # (No annotations: DDP checks them against the real types.)
            seen.add(bucket.index())
            return hook(state, bucket)

        model.register_comm_hook(state, counting)
        # Where DDP puts each parameter in its buckets is its business: the
        # bound takes the largest magnitude of all for every block.
        info = dataclasses.replace(info_of(spec), error_block=0)
        for step in range(3):
            coefs = [gradients(f"ddp:{s}:{step}", math.prod(s), world) for s in shapes]
            model.zero_grad()
            model([c[rank] for c in coefs]).backward()
            whole = [torch.cat([c[r] for c in coefs]) for r in range(world)]
            bound = step_bound(whole, info, info, feedback) * (2 if feedback and step else 1)
            grad = torch.cat([p.grad.view(-1) for p in model.module.ps])  # type: ignore[union-attr]
            what = f"DDP {spec}, feedback={feedback}, step {step}"
            assert_within(what, grad, exact_mean(whole[rank]), bound)
            assert_same_on_all_ranks(what, grad)
        assert len(seen) > 1, f"DDP made {len(seen)} bucket(s); the case wants several"
        if feedback and spec != "noop":
            saved = state.state_dict()["residuals"]
            assert sorted(saved) == sorted(seen), f"residuals of buckets {sorted(saved)}"


def case_state(rank: int, world: int) -> None:
    n = 777
    gs = [gradients(f"state:{k}", n, world) for k in range(4)]
    state, hook = qcomm.ddp_comm_hook("int8/mx4", error_feedback=True)
    for k in range(3):
        hook(state, Bucket(gs[k][rank].clone(), 2, (n,))).wait()
    saved = state.state_dict()
    entry = saved["residuals"][2]
    assert entry["scatter"].shape == (n,) and entry["scatter"].abs().sum() > 0
    mine = layout(n, world, 32)
    assert entry["gather"].shape == (mine[rank + 1] - mine[rank],)
    restored, _ = qcomm.ddp_comm_hook("int8/mx4", error_feedback=True)
    restored.load_state_dict(saved)
    unpickled = pickle.loads(pickle.dumps(state))
    assert unpickled.process_group is None and repr(unpickled) == repr(state)
    outs = [
        hook(s, Bucket(gs[3][rank].clone(), 2, (n,))).wait() for s in (state, restored, unpickled)
    ]
    assert torch.equal(outs[0], outs[1]), "load_state_dict does not continue bit for bit"
    assert torch.equal(outs[0], outs[2]), "pickling does not continue bit for bit"
    # The same bucket index with another layout: its residuals start again.
    for shapes, reset in (((n - 1,), True), ((n - 1,), False), ((n - 11, 10), True)):
        size = sum(shapes)
        before = state.resets
        got = hook(state, Bucket(gs[0][rank][:size].clone(), 2, shapes)).wait()
        assert state.resets == before + reset, f"layout {shapes}: resets {state.resets}"
        if reset:
            fresh, _ = qcomm.ddp_comm_hook("int8/mx4", error_feedback=True)
            expected = hook(fresh, Bucket(gs[0][rank][:size].clone(), 2, shapes)).wait()
            assert torch.equal(got, expected), f"layout {shapes}: residuals were not reset"


class GatedFP16:
    """fp16 whose encode waits for ``gate`` (and fails where ``fail`` is set),
    noting the threads it ran on."""

    def __init__(self, gate: threading.Event, fail: bool = False) -> None:
        self.inner = qcomm.load_codec("fp16")
        self.gate = gate
        self.fail = fail
        self.threads: set[str] = set()

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        assert self.gate.wait(60), "the gate never opened"
        if self.fail:
            raise RuntimeError("GatedFP16 fails on purpose")
        return self.inner.encode(input_tensor, ctx)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.inner.decode(input_grad, ctx)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self.inner.quantized_dtype

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return self.inner.calc_quantized_size(input_len, ctx)

    def create_context(self) -> Any:
        return self.inner.create_context()

    def padded_size(self, *args: Any) -> Any:
        return self.inner.padded_size(*args)


SHAPES = (5000, 7000, 300_000)


def _gated_ddp(
    gate: threading.Event, fail: bool
) -> tuple[torch.nn.Module, GatedFP16, list[torch.futures.Future[torch.Tensor]], list[bool]]:
    # Small buckets, so that one backward pass hands over several (DDP's
    # first bucket takes up to 1 MB, the others up to the cap).
    shapes: list[tuple[int, ...]] = [(n,) for n in SHAPES]
    model = torch.nn.parallel.DistributedDataParallel(Params(shapes), bucket_cap_mb=0.01)
    codec = GatedFP16(gate)
    state, hook = qcomm.ddp_comm_hook(codec)
    futures: list[torch.futures.Future[torch.Tensor]] = []
    first_pending: list[bool] = []

    def gated(state, bucket):  # type: ignore[no-untyped-def]
        futures.append(hook(state, bucket))
        if len(futures) == 2:
            # The second bucket's gradients are computed and handed over
            # while the first bucket cannot have been reduced (its encode
            # waits for the gate): the backward pass overlapped it.
            first_pending.append(not futures[0].done())
            gate.set()
        return futures[-1]

    model.register_comm_hook(state, gated)
    # DDP's first backward pass hands over one bucket; it makes several
    # from the second on. A first pass with the gate open, then it closes.
    gate.set()
    model([torch.zeros(n) for n in SHAPES]).backward()
    gate.clear()
    futures.clear()
    first_pending.clear()
    model.zero_grad()
    codec.fail = fail
    return model, codec, futures, first_pending


def case_overlap(rank: int, world: int) -> None:
    # The hook returns before its bucket is reduced, the backward pass goes
    # on meanwhile, the worker thread does the encoding, and the result is
    # what the synchronous all-reduce gives.
    gate = threading.Event()
    model, codec, futures, first_pending = _gated_ddp(gate, fail=False)
    coefs = [gradients(f"overlap:{n}", n, world) for n in SHAPES]
    model([c[rank] for c in coefs]).backward()
    assert first_pending == [True], (
        f"first bucket done before the second was handed: {first_pending}"
    )
    assert len(futures) >= 2 and all(f.done() for f in futures)
    assert codec.threads and threading.current_thread().name not in codec.threads, codec.threads
    grad = torch.cat([p.grad.view(-1) for p in model.module.ps])  # type: ignore[union-attr]
    whole = [torch.cat([c[r] for c in coefs]) for r in range(world)]
    info = dataclasses.replace(info_of("fp16"), error_block=0)
    assert_within(
        "overlapped DDP", grad, exact_mean(whole[rank]), step_bound(whole, info, info, False)
    )
    assert_same_on_all_ranks("overlapped DDP", grad)


def case_overlap_failure(rank: int, world: int) -> None:
    # A codec that fails on the last rank, in the worker: every rank's
    # backward pass raises, naming the rank, and none waits for the timeout.
    gate = threading.Event()
    model, _, futures, _ = _gated_ddp(gate, fail=rank == world - 1)
    coefs = [gradients(f"failure:{n}", n, world) for n in SHAPES]
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        model([c[rank] for c in coefs]).backward()
    assert time.monotonic() - start < 20, "the failure took as long as a timeout"
    message = str(raised.value)
    assert "GatedFP16 fails on purpose" in message or f"rank {world - 1}" in message, message
    assert futures, "the hook never ran"


def case_disagreement(rank: int, world: int) -> None:
    # One rank with another codec, every call checked (QCOMM_VERIFY=1):
    # every rank raises, none waits.
    spec = "fp16" if rank == 0 else "int8"
    state, hook = qcomm.ddp_comm_hook(spec)
    with config.configured(verify="always"):
        future = hook(state, Bucket(torch.ones(100)))
        with pytest.raises(CodecError):
            future.wait()
    # The group stays usable.
    state, hook = qcomm.ddp_comm_hook("int8")
    got = hook(state, Bucket(torch.full((100,), float(rank)))).wait()
    assert torch.allclose(got, torch.full((100,), (world - 1) / 2), atol=1e-2)


def case_all_reduce_sum(rank: int, world: int) -> None:
    # The all-reduce under the hook, summing, with two codecs and residuals.
    gs = gradients("sum", 5000, world)
    residuals = Residuals()
    int8, fp16 = qcomm.load_codec("int8"), qcomm.load_codec("fp16")
    got = all_reduce(gs[rank].clone(), reduce_codec=int8, gather_codec=fp16, residuals=residuals)
    bound = step_bound(gs, qcomm.codec_info(int8), qcomm.codec_info(fp16), False) * world
    assert_within("all_reduce sum", got, exact_mean(gs[rank]) * world, bound)
    assert residuals.scatter is not None and residuals.gather is not None
    mine = layout(5000, world, 32)
    own = residuals.scatter[mine[rank] : mine[rank + 1]]
    assert not own.any(), "the block a rank keeps travels unencoded: its residual is zero"


def case_narrow_buffers(rank: int, world: int) -> None:
    # Buckets of half-precision parameters: sums still run in float32, and
    # the result is rounded once to the bucket's dtype.
    for dtype in (torch.float16, torch.bfloat16):
        for spec in ("noop", "int8"):
            info = info_of(spec)
            gs = [g.to(dtype) for g in gradients(f"narrow:{dtype}", 1000, world)]
            state, hook = qcomm.ddp_comm_hook(spec, error_feedback=True)
            got = hook(state, Bucket(gs[rank].clone())).wait()
            assert got.dtype == dtype
            ref = exact_mean(gs[rank])
            rounding = ref.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
            bound = step_bound([g.float() for g in gs], info, info, True) + rounding
            assert_within(f"{spec} on {dtype}", got, ref, bound)
            assert_same_on_all_ranks(f"{spec} on {dtype}", got)


CASES: dict[str, Callable[[int, int], None]] = {
    f.__name__: f
    for f in (
        case_ddp,
        case_state,
        case_disagreement,
        case_all_reduce_sum,
        case_narrow_buffers,
        case_overlap,
        case_overlap_failure,
    )
}
CODEC_CASES: dict[str, Callable[[int, int, str], None]] = {
    f.__name__: f for f in (case_hook, case_feedback)
}
CASE_IDS = [
    *CASES,
    *(f"case_hook[{c}]" for c in CODECS),
    *(f"case_feedback[{c}]" for c in FEEDBACK),
]


def run_case(case: str, rank: int, world: int) -> None:
    if case in CASES:
        CASES[case](rank, world)
        return
    kind, codec = case.rstrip("]").split("[")
    CODEC_CASES[kind](rank, world, codec)


Spawned = dict[str, Callable[[int], dict[str, Outcome]]]


@pytest.fixture(scope="module")
def spawned() -> Spawned:
    """Runs every case once per transport and world size, on first use."""
    return {
        transport: outcomes_per_world_size(
            run_case, CASE_IDS, env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport in TRANSPORTS
    }


def check(
    spawned: Spawned, transport: str, world: int, case: Callable[..., None], *codec: str
) -> None:
    """Fails the calling test with ``case``'s tracebacks (on ``codec`` where given),
    or unless every rank opened ``transport`` only."""
    name = f"{case.__name__}[{codec[0]}]" if codec else case.__name__
    check_case(spawned[transport](world)[name], f"{name} on {world} ranks, {transport}", transport)


# Each test checks its case of the spawn, on each transport and world size.


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ddp_with_uneven_and_rebuilt_buckets_matches_the_mean_within_the_bound(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_ddp)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_state_saved_loaded_or_pickled_continues_bit_for_bit_and_resets_on_a_new_layout(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_state)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_whose_hooks_differ_all_raise_without_waiting(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_disagreement)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_under_the_hook_sums_with_two_codecs_and_residuals(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_all_reduce_sum)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_half_precision_buckets_sum_in_float32_and_round_once(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_narrow_buffers)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_hook_returns_before_its_bucket_is_reduced_and_matches_the_synchronous_result(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_overlap)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_codec_failing_in_the_worker_fails_every_ranks_backward_pass_promptly(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_overlap_failure)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_hook_is_within_the_codecs_bound_with_and_without_feedback_and_chunks(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_hook, codec)


@pytest.mark.parametrize("codec", FEEDBACK)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_feedback_keeps_the_sum_of_steps_within_one_steps_bound(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, case_feedback, codec)


# --------------------------------------------------------------------------
# What needs no peers.


def test_arguments_are_checked_before_anything_runs() -> None:
    with pytest.raises(CodecError, match="unknown codec 'int9'"):
        qcomm.ddp_comm_hook("int9")
    with pytest.raises(ValueError, match="gather: the spec 'int8/fp16' already names"):
        qcomm.ddp_comm_hook("int8/fp16", gather="bf16")
    with pytest.raises(TypeError, match="error_feedback: expected a bool, got int"):
        qcomm.ddp_comm_hook("int8", error_feedback=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes: expected a positive"):
        qcomm.ddp_comm_hook("int8", chunk_bytes=0)
    with pytest.raises(TypeError, match="spec: expected a codec spec"):
        qcomm.ddp_comm_hook(42)
    with pytest.raises(TypeError, match="process_group: expected"):
        qcomm.ddp_comm_hook("int8", process_group="world")
    with pytest.raises(ValueError, match="state_dict: expected a DDPCommHookState.state_dict"):
        DDPCommHookState().load_state_dict({"version": 99})


def test_codecs_and_pairs() -> None:
    state, hook = qcomm.ddp_comm_hook("int8:row_dim=64/fp16")
    assert hook is all_reduce_hook
    assert repr(state.reduce_codec) == "Int8Codec(row_dim=64)"
    assert state.gather_codec.info.name == "fp16"
    same, _ = qcomm.ddp_comm_hook("mx4")
    # A spec gives each step its own instance; an object serves both.
    assert same.reduce_codec is not same.gather_codec
    codec = qcomm.load_codec("int8")
    obj, _ = qcomm.ddp_comm_hook(codec)
    assert obj.reduce_codec is codec and obj.gather_codec is codec
    none, _ = qcomm.ddp_comm_hook(None)
    assert none.reduce_codec is None and none.gather_codec is None


def test_one_rank_and_wrong_inputs(one_rank: None) -> None:
    int8 = qcomm.load_codec("int8")
    state, hook = qcomm.ddp_comm_hook("int8", error_feedback=True)
    x = torch.randn(100)
    assert torch.equal(hook(state, Bucket(x.clone())).wait(), x)
    with pytest.raises(TypeError, match="state: expected the DDPCommHookState"):
        hook(object(), Bucket(x))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer: expected a 1-D tensor"):
        all_reduce(torch.ones(2, 2))
    with pytest.raises(TypeError, match="buffer: expected a floating-point tensor"):
        all_reduce(torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"residuals.scatter: expected 4 elements"):
        all_reduce(torch.ones(4), reduce_codec=int8, residuals=Residuals(torch.zeros(3), None))
    # With no codec nothing is lost, and nothing is kept.
    residuals = Residuals()
    all_reduce(torch.ones(4), residuals=residuals)
    assert residuals.scatter is None and residuals.gather is None


def test_layout() -> None:
    for numel in (0, 1, 31, 32, 100, 1000, 4099):
        for world in (1, 2, 3, 8):
            for granule in (1, 32, 64):
                bounds = layout(numel, world, granule)
                assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == world + 1
                assert all(a <= b for a, b in zip(bounds, bounds[1:]))
                assert all(b % granule == 0 for b in bounds[:-1] if b < numel)


def test_bench_all_reduce_row(tmp_path: Any) -> None:
    # qcomm bench --ops all_reduce: qcomm's hook with each codec, PyTorch's two
    # hooks and the bare exchange, in one run; nccl-tests' all-reduce busbw.
    out = tmp_path / "bench.json"
    argv = ["bench", "--ops", "ar", "--codecs", "int8", "--sizes", "64K", "--quick"]
    status = qcomm.cli.main([*argv, "--no-fbgemm", "--json", str(out)])
    assert status == 0
    results = json.loads(out.read_text())
    assert results["meta"]["ops"] == ["all_reduce"]
    rows = {p["label"]: p for p in results["collectives"]}
    labels = ["noop", "int8", "pytorch[allreduce_hook]", "pytorch[fp16_compress_hook]", "bare:p2p"]
    assert list(rows) == labels
    world = results["meta"]["world_size"]
    for label, p in rows.items():
        assert p["status"] == "ok" and p["pass"] == "fwd", label
        assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * 2 * (world - 1) / world)
    assert rows["noop"]["max_rel_error"] < 1e-6
    # Relative to the largest output: each step's bound relative to its
    # input's scale, and neither input is larger than the output (see step_bound).
    assert rows["int8"]["max_rel_error"] <= 2.01 * info_of("int8").rel_error_bound
    for label in ("noop", "int8"):
        theirs = rows["pytorch[allreduce_hook]"]["latency_s"] / rows[label]["latency_s"]
        assert rows[label]["vs_allreduce_hook"] == pytest.approx(theirs)
        assert rows[label]["vs_fp16_compress_hook"] > 0


_EXITING = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import qcomm
from qcomm import _ddp_worker


def main(rank, port, destroy):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    model.register_comm_hook(*qcomm.ddp_comm_hook("int8"))
    for _ in range(3):
        model(torch.randn(8, 64)).sum().backward()
    (worker,) = _ddp_worker._workers.values()
    assert worker._thread.is_alive() and worker.group is not None
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    port, destroy = int(sys.argv[1]), sys.argv[2] == "1"
    ctx = mp.spawn(main, args=(port, destroy), nprocs=2, join=False)
    while not ctx.join():
        pass
    print("ok")
"""


@pytest.mark.parametrize("destroy", [True, False])
def test_processes_with_the_hook_exit_cleanly(destroy: bool, tmp_path: Any) -> None:
    # The worker thread and its process group are let go at exit while the
    # interpreter still runs: left to its teardown, gloo aborted the process
    # (SIGABRT, "terminate called") about one exit in three.
    import socket
    import subprocess
    import sys

    script = tmp_path / "exiting.py"
    script.write_text(_EXITING)
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        done = subprocess.run(
            [sys.executable, str(script), str(port), "1" if destroy else "0"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
        assert "terminate called" not in done.stderr, done.stderr[-3000:]


def test_close_all_joins_the_workers_and_lets_go_of_their_groups() -> None:
    from qcomm import _ddp_worker

    group = object()
    worker = _ddp_worker.Worker(group, "test-worker")  # type: ignore[arg-type]
    ran: list[Any] = []

    def work(g: Any) -> torch.Tensor:
        ran.append(g)
        return torch.ones(1)

    future = worker.submit(work, torch.device("cpu"))
    assert torch.equal(future.wait(), torch.ones(1)) and ran == [group]
    worker.close(timeout=5.0)
    assert not worker._thread.is_alive() and worker.group is None


def test_spec_errors_name_the_argument() -> None:
    # Pairs are read by qcomm's one parser of pair specs, and each codec
    # spec's error names the argument it came in.
    for spec, gather, name in (
        ("int8/", None, "spec"),
        ("/fp16", None, "spec"),
        ("int8/fp16/bf16", None, "spec"),
        ("int9/fp16", None, "spec.forward"),
        ("int8/int9", None, "spec.backward"),
        ("int8", "int9", "gather"),
        ("int9", "fp16", "spec"),
        (None, "int9", "gather"),
    ):
        for make in (qcomm.ddp_comm_hook, DDPCommHookState):
            with pytest.raises(CodecError) as err:
                make(spec, gather=gather)
            assert str(err.value).startswith(f"{name}: "), (spec, gather, str(err.value))
    # What a pair gives is unchanged: a codec per step, from its spec.
    state = DDPCommHookState(" int8:row_dim=64 / fp16 ", error_feedback=True)
    assert repr(state) == (
        "DDPCommHookState(reduce='int8:row_dim=64', gather='fp16', error_feedback=True)"
    )
    assert pickle.loads(pickle.dumps(state)).gather_codec.info.name == "fp16"


def test_one_split_of_a_bucket_for_the_all_reduce_and_the_hook() -> None:
    from qcomm.collectives._blocks import split_blocks
    from qcomm.collectives._hosts import ByHost

    def codec(spec: str) -> Any:
        return qcomm.load_codec(spec)

    # The blocks start at multiples of every codec's scale block (the least
    # common multiple), whichever way the all-reduce or the hook holds them.
    assert split_blocks(1000, 3, codec("mx4:group_size=16"), codec("fp16")) == [0, 336, 672, 1000]
    assert split_blocks(1000, 3, None, None) == layout(1000, 3, 1)
    host = qcomm.HostCodecs(
        same_host=qcomm.QuantizedCommCodecs(codec("fp16"), codec("int8:row_dim=64")),
        other_host=qcomm.QuantizedCommCodecs(codec("mx4:group_size=16"), codec("fp16")),
    )
    expected = layout(1000, 3, 64)
    assert split_blocks(1000, 3, host) == expected
    reduce = ByHost(host.same_host.forward, host.other_host.forward, None, "")
    gather = ByHost(host.same_host.backward, host.other_host.backward, None, "")
    assert split_blocks(1000, 3, reduce, gather) == expected
    # The hook lays its residuals out by it (rank 1 of 3's block here).
    state = DDPCommHookState(host, error_feedback=True)
    placed = state._layout(1000, torch.float32, [(1000,)], 3, 1)
    assert (placed.start, placed.stop) == (expected[1], expected[2])
