"""``qcomm.fsdp_quantize`` refuses what it cannot serve, naming the argument:
a model without FSDP modules, wrong types, weights by host without a
replica group, a stochastic weight codec, a state of another model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counting
from torch.distributed.fsdp import fully_shard

import qcomm
from qcomm import CodecError


@pytest.fixture
def world_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded() -> Any:
    return fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": torch.nn.Linear(2, 2)}, ValueError, "model: expected fully_shard"),
        ({"model": "a model"}, TypeError, "model: expected a torch.nn.Module"),
        ({"gradients": "no_such_codec"}, CodecError, "gradients"),
        ({"weights": 3}, (TypeError, CodecError), "weights"),
        ({"error_feedback": 1}, TypeError, "error_feedback: expected a bool"),
        ({"replica_group": "group"}, TypeError, "replica_group: expected"),
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes"),
        ({"weights": "same_host=noop+other_host=int8"}, ValueError, "weights: codecs by host"),
        (
            {"gradients": "same_host=noop+other_host=int8", "error_feedback": True},
            ValueError,
            "error_feedback: with gradients by host",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(
    world_one: None, kwargs: dict[str, Any], error: Any, match: str
) -> None:
    model = kwargs.pop("model", None) or _sharded()
    with pytest.raises(error, match=match):
        qcomm.fsdp_quantize(model, **kwargs)


def test_a_stochastic_weight_codec_is_refused(world_one: None) -> None:
    codec: Any = qcomm.load_codec("int8")
    codec.info = dataclasses.replace(qcomm.codec_info(codec), stochastic=True)
    with pytest.raises(ValueError, match="weights: codec 'int8' is stochastic"):
        qcomm.fsdp_quantize(_sharded(), weights=codec)
    qcomm.fsdp_quantize(_sharded(), gradients=codec)  # a gradient may be


def test_a_state_of_other_modules_is_refused(world_one: None) -> None:
    state = qcomm.fsdp_quantize(_sharded(), gradients="int8", error_feedback=True)
    assert state.modules == [""]
    with pytest.raises(ValueError, match="state_dict: expected an FSDPCommState"):
        state.load_state_dict({"residuals": {}})
    with pytest.raises(ValueError, match="module 'layers.0' is not one of this state's"):
        state.load_state_dict({"version": 1, "error_feedback": True, "residuals": {"layers.0": {}}})
    state.load_state_dict(state.state_dict())


@pytest.mark.parametrize("flag", ["stochastic", "stateful"])
def test_error_feedback_refuses_a_gradient_codec_that_encodes_a_block_differently(
    world_one: None, flag: str
) -> None:
    codec: Any = qcomm.load_codec("int8")
    flags: dict[str, Any] = {flag: True}
    codec.info = dataclasses.replace(qcomm.codec_info(codec), **flags)
    with pytest.raises(ValueError, match=f"error_feedback: gradient codec 'int8' is {flag}"):
        qcomm.fsdp_quantize(_sharded(), gradients=codec, error_feedback=True)
    qcomm.fsdp_quantize(_sharded(), gradients=codec)  # without error feedback it may


def test_a_saved_state_with_other_error_feedback_is_refused(world_one: None) -> None:
    saved = qcomm.fsdp_quantize(_sharded(), gradients="int8").state_dict()
    state = qcomm.fsdp_quantize(_sharded(), gradients="int8", error_feedback=True)
    with pytest.raises(
        ValueError, match=r"state_dict\['error_feedback'\]: expected True.*got False"
    ):
        state.load_state_dict(saved)


def test_restored_residuals_are_checked_and_none_clears_them(world_one: None) -> None:
    state = qcomm.fsdp_quantize(_sharded(), gradients="int8", error_feedback=True)
    state._residuals[""].scatter = torch.ones(3)
    saved = {"version": 1, "error_feedback": True, "residuals": {"": {"scatter": None}}}
    state.load_state_dict(saved)
    assert state._residuals[""].scatter is None
    saved["residuals"] = {"": {"scatter": torch.zeros(3, dtype=torch.float64)}}
    with pytest.raises(
        ValueError, match=r"\['scatter'\]: expected a float32 tensor, got torch.float64"
    ):
        state.load_state_dict(saved)
    saved["residuals"] = {"": {"replicas": {"scatter": torch.zeros(2), "gather": 1}}}
    with pytest.raises(ValueError, match=r"\['replicas'\]: this state reduces no replicas"):
        state.load_state_dict(saved)


def test_an_all_gather_of_bytes_is_fsdps_own(world_one: None) -> None:
    # FSDP gathers uint8 for groups of mixed dtypes: no codec applies to bytes.
    model = _sharded()
    qcomm.fsdp_quantize(model, weights="int8")
    comm = model._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
    data = torch.arange(250, 256, dtype=torch.uint8)
    out = torch.empty_like(data)
    with counting("fsdp_call") as calls:
        comm(output_tensor=out, input_tensor=data, group=dist.group.WORLD)
    assert dict(calls) == {"all_gather_fsdp": 1}
    assert torch.equal(out, data)


def test_weights_by_host_with_an_identity_forward_inside_a_host_are_fsdps_own(
    world_one: None,
) -> None:
    # An all-gather encodes with the forward codec only: a same-host pair
    # whose forward is no-op leaves the shard group's all-gather to FSDP.
    replicas = dist.new_group([0])
    state = qcomm.fsdp_quantize(
        _sharded(), weights="same_host=noop/int8+other_host=int8", replica_group=replicas
    )
    assert state.weights is None
    state = qcomm.fsdp_quantize(
        _sharded(), weights="same_host=int8/noop+other_host=int8", replica_group=replicas
    )
    assert state.weights is not None
