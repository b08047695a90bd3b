"""FSDP2 with qcomm's codecs (``qcomm.fsdp_quantize``): an MLP under
``fully_shard`` on 2 and 3 gloo ranks, one spawn per world size and
transport, every check of the door in it: no codec is FSDP's own training to
the bit; FSDP's op is honoured; int8 gradients with fp8 or int8 weights and
error feedback train to float32's loss within the codecs' error; every rank
builds the same parameters at every step; a checkpoint resumes bit for bit;
one rank's failing codec and ranks that disagree raise on every rank."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counting
from dist_utils import TRANSPORTS, run_ranks, transport_env
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import qcomm
from qcomm import CodecError

DIMS = (12, 30, 30, 5)  # 30 rows do not divide by 3 ranks with 5 per block alike: padding
BATCH = 8
STEPS = 20


class _FailsLater:
    """Makes the int8 codec's encode raise on the last rank once ``armed``."""

    armed = False


def _failing_int8() -> Any:
    base = type(qcomm.load_codec("int8"))

    class FailingInt8(base):  # type: ignore[misc, valid-type]
        def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            if _FailsLater.armed and dist.get_rank() == dist.get_world_size() - 1:
                raise RuntimeError("cannot encode here")
            return super().encode(input_tensor, ctx)

    return FailingInt8()


def _mesh(fresh: bool) -> DeviceMesh:
    # A fresh group: its first call of each collective checks that the ranks agree.
    world = dist.get_world_size()
    group = (
        dist.new_group(list(range(world))) if fresh else dist.distributed_c10d._get_default_group()
    )
    assert group is not None
    return DeviceMesh.from_group(group, "cpu")


def _model(mesh: DeviceMesh) -> Any:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIMS[0], generator=gen)
    return x, torch.sin(x[:, : DIMS[-1]] * 2)


def _replicas(model: Any, seen: list[str]) -> None:
    # What every rank computes with: the unsharded parameters in forward.
    def record(module: torch.nn.Module, args: Any) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        seen.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest())

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(record)


def _train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: range,
    after: Callable[[], None] | None = None,
) -> float:
    """Steps of Adam on the MSE; the mean loss over the ranks of the last step."""
    loss = torch.zeros(())
    for step in steps:
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _local(model: Any) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _plain(rank: int) -> dict[str, Any]:
    """No codec: FSDP's own collectives, nothing installed, the same bits."""
    out: dict[str, Any] = {}
    mesh = _mesh(fresh=False)
    runs = []
    for door in (False, True):
        model = _model(mesh)
        if door:
            state = qcomm.fsdp_quantize(model)
            out["installed"] = [
                (type(g._reduce_scatter_comm).__name__, type(g._all_gather_comm).__name__)
                for m in model.modules()
                if hasattr(m, "_get_fsdp_state")
                for g in m._get_fsdp_state()._fsdp_param_groups
            ]
            out["modules"] = state.modules
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        _train(model, opt, rank, range(3))
        runs.append(_local(model))
    out["plain_equal"] = _same(*runs)
    return out


def _ops(rank: int, world: int) -> dict[str, Any]:
    """AVG, PREMUL_SUM and SUM (with FSDP's post-division) against FSDP's own AVG
    (gloo cannot PREMUL_SUM: its gradients scaled instead)."""
    out: dict[str, Any] = {}
    mesh = _mesh(fresh=False)
    x, y = _batch(rank, 0)

    def grads(how: str | None) -> list[torch.Tensor]:
        model = _model(mesh)
        for m in model.modules():
            if how == "premul" and hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(2.5)
            if how == "sum" and hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
        if how is not None:
            qcomm.fsdp_quantize(model, gradients="fp16")
        torch.nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]

    reference = grads(None)
    out["scale"] = max(a.abs().max().item() for a in reference)
    for how, factor in (("avg", 1.0), ("premul", world / 2.5), ("sum", 1.0)):
        out[how] = max((a * factor - b).abs().max().item() for a, b in zip(reference, grads(how)))
    return out


def _quantized(rank: int) -> dict[str, Any]:
    """int8 gradients with fp8 or int8 weights and error feedback, against float32."""
    out: dict[str, Any] = {}
    mesh = _mesh(fresh=False)
    model = _model(mesh)
    out["float32"] = _train(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), rank, range(STEPS)
    )
    for weights in ("fp8_e4m3", "int8"):
        model = _model(mesh)
        state = qcomm.fsdp_quantize(model, gradients="int8", weights=weights, error_feedback=True)
        seen: list[str] = []
        _replicas(model, seen)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with counting("fsdp_call") as calls:
            out[weights] = _train(model, opt, rank, range(STEPS))
        out[f"{weights}_calls"] = dict(calls)
        out[f"{weights}_seen"] = seen
        out[f"{weights}_residual"] = max(
            r.scatter.abs().max().item() for r in state._residuals.values() if r.scatter is not None
        )
    # On CPU a synchronous call returns a Work too, which FSDP waits on
    # before it reads the output: a prefetched all-gather overlaps.
    comm = model[0]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
    world = dist.get_world_size()
    gathered = torch.empty(3 * world)
    work = comm(output_tensor=gathered, input_tensor=torch.full((3,), 0.5), group=dist.group.WORLD)
    out["sync_call_work"] = isinstance(work, dist.Work)
    if work is not None:
        work.wait()
    out["sync_call_gathered"] = gathered.tolist()
    return out


def _checkpoint(rank: int) -> dict[str, Any]:
    """Model, optimizer and residuals saved after 3 steps resume bit for bit."""
    mesh = _mesh(fresh=False)
    model = _model(mesh)
    state = qcomm.fsdp_quantize(model, gradients="int8", weights="fp8_e4m3", error_feedback=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, rank, range(3))
    saved = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "qcomm": state.state_dict()}, saved
    )
    _train(model, opt, rank, range(3, 6))
    straight = _local(model)
    out: dict[str, Any] = {}
    for restore_qcomm in (True, False):
        saved.seek(0)
        blob = torch.load(saved, weights_only=False)
        again = _model(mesh)
        resumed = qcomm.fsdp_quantize(
            again, gradients="int8", weights="fp8_e4m3", error_feedback=True
        )
        again.load_state_dict(blob["model"])
        opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
        opt2.load_state_dict(blob["opt"])
        if restore_qcomm:
            resumed.load_state_dict(blob["qcomm"])
        _train(again, opt2, rank, range(3, 6))
        out[f"resumed_equal_{restore_qcomm}"] = _same(straight, _local(again))
    # Residuals that do not fit (another model or world size) are dropped.
    wrong = blob["qcomm"]
    wrong["residuals"]["0"]["scatter"] = torch.zeros(7)
    model = _model(mesh)
    misfit = qcomm.fsdp_quantize(model, gradients="int8", error_feedback=True)
    misfit.load_state_dict(wrong)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), rank, range(1))
    out["resets"] = misfit.resets
    return out


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except CodecError as err:
        return f"CodecError: {err}"
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def _failures(rank: int, world: int) -> dict[str, Any]:
    """A codec failing on one rank, and ranks that disagree, raise on every rank."""
    out: dict[str, Any] = {}
    model = _model(_mesh(fresh=True))
    qcomm.fsdp_quantize(model, gradients=_failing_int8())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, rank, range(1))

    def fail() -> None:
        _FailsLater.armed = True
        try:
            _train(model, opt, rank, range(1, 2))
        finally:
            _FailsLater.armed = False

    out["codec_fails"] = _raises(fail)
    model = _model(_mesh(fresh=True))
    out["disagree"] = _raises(
        lambda: qcomm.fsdp_quantize(model, weights="int8" if rank == 0 else "fp8_e4m3")
    )
    model = _model(_mesh(fresh=True))
    out["codec_or_none"] = _raises(
        lambda: qcomm.fsdp_quantize(model, gradients=None if rank == 0 else "int8")
    )
    return out


def _inf_step(rank: int) -> dict[str, Any]:
    """An inf in one step's gradients (a step skipped, as a grad scaler does)
    leaves no NaN in the residuals: later steps train on finite values."""
    model = _model(_mesh(fresh=False))
    state = qcomm.fsdp_quantize(model, gradients="int8", error_feedback=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = _batch(rank, 0)
    out_ = model(x)
    out_.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    torch.nn.functional.mse_loss(out_, y).backward()
    opt.zero_grad()  # the step is skipped
    poisoned = [r.scatter for r in state._residuals.values() if r.scatter is not None]
    with counting("fsdp_call") as calls:
        loss = _train(model, opt, rank, range(1, 3))
    return {
        "inf_step_calls": dict(calls),
        "inf_step_residuals": len(poisoned),
        "inf_step_loss": loss,
        "inf_step_finite": all(p.to_local().isfinite().all().item() for p in model.parameters())
        and all(
            r.scatter.isfinite().all().item()
            for r in state._residuals.values()
            if r.scatter is not None
        ),
    }


def _run(rank: int, world: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    for part in (_plain, _quantized, _checkpoint, _inf_step):
        out.update(part(rank))
    out.update(_ops(rank, world))
    out.update(_failures(rank, world))
    return out


_RESULTS: dict[tuple[int, str], list[dict[str, Any]]] = {}


def _results(world: int, transport: str) -> list[dict[str, Any]]:
    key = (world, transport)
    if key not in _RESULTS:
        _RESULTS[key] = run_ranks(_run, world, env=transport_env(transport), timeout=180)
    return _RESULTS[key]


CASES = [(w, t) for w in (2, 3) for t in TRANSPORTS]
ids = [f"{w}ranks-{t}" for w, t in CASES]


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_no_codec_trains_as_plain_fsdp_bit_for_bit(world: int, transport: str) -> None:
    for r in _results(world, transport):
        assert r["plain_equal"]
        assert all(c == ("DefaultReduceScatter", "DefaultAllGather") for c in r["installed"])
        assert r["modules"] == ["0", "2", "4"]


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_fsdps_op_is_honoured(world: int, transport: str) -> None:
    # fp16 carries gradients to 2**-11 of their size; the sums are of world of them.
    for r in _results(world, transport):
        for how in ("avg", "premul", "sum"):
            assert r[how] <= world * 2**-11 * r["scale"], (how, r[how])


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_int8_gradients_and_fp8_or_int8_weights_train_as_float32(
    world: int, transport: str
) -> None:
    results = _results(world, transport)
    for r in results:
        for weights, info in (("fp8_e4m3", "fp8_e4m3"), ("int8", "int8")):
            bound = qcomm.codec_info(qcomm.load_codec(info)).rel_error_bound
            # The loss is a mean of squares of what the weights give: its
            # relative error stays within twice the weights' codec bound.
            assert abs(r[weights] - r["float32"]) <= 2 * bound * r["float32"], (weights, r)
            assert r[f"{weights}_calls"] == {
                "reduce_scatter": 3 * STEPS,
                "all_gather": 2 * 3 * STEPS,
            }
            assert r[f"{weights}_residual"] > 0  # error feedback carried something


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_a_synchronous_all_gather_on_cpu_returns_a_work_fsdp_waits_on(
    world: int, transport: str
) -> None:
    for r in _results(world, transport):
        assert r["sync_call_work"]
        assert r["sync_call_gathered"] == [0.5] * 3 * world


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_every_rank_computes_with_the_same_parameters_at_every_step(
    world: int, transport: str
) -> None:
    results = _results(world, transport)
    for weights in ("fp8_e4m3", "int8"):
        seen = [r[f"{weights}_seen"] for r in results]
        assert len(seen[0]) == 3 * STEPS
        assert all(s == seen[0] for s in seen)


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_a_checkpoint_with_the_residuals_resumes_bit_for_bit(world: int, transport: str) -> None:
    for r in _results(world, transport):
        assert r["resumed_equal_True"]
        assert not r["resumed_equal_False"]  # the residuals matter
        assert r["resets"] == 1


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_one_ranks_codec_failure_raises_on_every_rank(world: int, transport: str) -> None:
    results = _results(world, transport)
    for rank, r in enumerate(results):
        assert r["codec_fails"].startswith("CodecError"), r["codec_fails"]
        if rank != world - 1:
            assert f"rank {world - 1}" in r["codec_fails"], r["codec_fails"]


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_ranks_that_disagree_on_codecs_raise(world: int, transport: str) -> None:
    for r in _results(world, transport):
        assert r["disagree"].startswith("CodecError: weights:"), r["disagree"]


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_a_codec_on_one_rank_and_none_on_another_raise_on_every_rank(
    world: int, transport: str
) -> None:
    for r in _results(world, transport):
        assert r["codec_or_none"].startswith("CodecError: gradients:"), r["codec_or_none"]
        assert "rank 0: 'None'" in r["codec_or_none"], r["codec_or_none"]


@pytest.mark.parametrize(("world", "transport"), CASES, ids=ids)
def test_an_inf_in_one_steps_gradients_leaves_later_steps_finite(
    world: int, transport: str
) -> None:
    for r in _results(world, transport):
        assert r["inf_step_residuals"] == 3
        assert r["inf_step_calls"] == {"reduce_scatter": 3 * 2}
        assert r["inf_step_finite"], r
        assert r["inf_step_loss"] == r["inf_step_loss"]  # not NaN


def _hsdp(rank: int, world: int) -> dict[str, Any]:
    """4 ranks as 2 hosts of 2: shard inside a host, int8 between the replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    flat = _model(_mesh(fresh=False))
    out["float32"] = _train(flat, torch.optim.Adam(flat.parameters(), lr=1e-2), rank, range(STEPS))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(mesh["shard"])
    state = qcomm.fsdp_quantize(
        model,
        gradients="same_host=noop+other_host=int8",
        replica_group=mesh["replicate"].get_group(),
        error_feedback=True,
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    shards: list[list[torch.Tensor]] = []
    with counting("fsdp_call") as calls:
        out["hsdp"] = _train(model, opt, rank, range(STEPS), lambda: shards.append(_local(model)))
    out["calls"] = dict(calls)
    out["shards"] = shards
    out["saved"] = sorted(
        k for k, v in state.state_dict()["residuals"].items() if v["replicas"] is not None
    )
    # FSDP's own HSDP, and a replica group that is not one, are refused.
    replicate = mesh["replicate"].get_group()
    out["native_hsdp"] = _raises(lambda: qcomm.fsdp_quantize(_model(mesh), replica_group=replicate))
    out["not_replicas"] = _raises(
        lambda: qcomm.fsdp_quantize(_model(mesh["shard"]), replica_group=mesh["shard"].get_group())
    )
    # A divide factor of the world size: the replicas summed, the gradients
    # after one backward those of plain FSDP's average over the 4 ranks.
    x, y = _batch(rank, 0)

    def full_grads(model: Any) -> list[torch.Tensor]:
        torch.nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.full_tensor() for p in model.parameters()]

    reference = full_grads(_model(_mesh(fresh=False)))
    model = _model(mesh["shard"])
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(4.0)
    qcomm.fsdp_quantize(model, gradients="fp16", replica_group=replicate)
    with counting("fsdp_call") as calls:
        got = full_grads(model)
    out["factor_calls"] = dict(calls)
    out["factor_scale"] = max(a.abs().max().item() for a in reference)
    out["factor_error"] = max((a - b).abs().max().item() for a, b in zip(reference, got))
    return out


def _hsdp_results() -> list[dict[str, Any]]:
    if "hsdp" not in _HSDP:
        _HSDP["hsdp"] = run_ranks(_hsdp, 4, timeout=180)
    return _HSDP["hsdp"]


_HSDP: dict[str, list[dict[str, Any]]] = {}


def test_hsdp_by_host_compresses_between_hosts_only() -> None:
    results = _hsdp_results()
    rho = qcomm.codec_info(qcomm.load_codec("int8")).rel_error_bound
    for rank, r in enumerate(results):
        # The shard group's reduce-scatter is FSDP's own (no codec inside a
        # host); each module's shard is averaged over the replicas by qcomm.
        assert r["calls"] == {"all_reduce": 3 * STEPS}, r["calls"]
        assert abs(r["hsdp"] - r["float32"]) <= 2 * rho * r["float32"], r
        assert r["saved"] == ["0", "2", "4"]
        # The replicas of a shard (ranks 0 and 2, 1 and 3) stay identical.
        other = results[(rank + 2) % 4]["shards"]
        assert all(_same(a, b) for a, b in zip(r["shards"], other, strict=True))


def test_hsdp_refuses_a_replica_group_that_does_not_fit_fsdps_mesh() -> None:
    for r in _hsdp_results():
        assert r["native_hsdp"].startswith("ValueError: replica_group: module '0' is sharded"), r
        assert r["not_replicas"].startswith("ValueError: replica_group: expected"), r


def test_hsdp_with_a_divide_factor_sums_the_replicas() -> None:
    for r in _hsdp_results():
        assert r["factor_calls"] == {"reduce_scatter": 3, "all_reduce": 3}, r["factor_calls"]
        # fp16 in the shard group and between the replicas: 2**-11 each, of 4 terms.
        assert r["factor_error"] <= 8 * 2**-11 * r["factor_scale"], r["factor_error"]
