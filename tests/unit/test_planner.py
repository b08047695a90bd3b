"""The codec-aware estimator for TorchRec's planner (qcomm.planner)."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import pytest
import torch

import qcomm
from qcomm.planner import (
    DEFAULT_CODEC_BPS,
    DEFAULT_COPY_BPS,
    DEFAULT_PROFILE,
    CodecPerfEstimator,
    CommsProfile,
    plan_specs,
    planner_topology,
    profile_from_bench,
    wire_bytes,
)

pytest.importorskip("torchrec")

BATCH = 2048  # per rank
DIM = 128
ELEMENTS = BATCH * DIM  # one peer's block of a table
LINK = 125e6  # 1 Gbit/s, bytes/s
# Codec rates far from the default, so that a test that reads the default fails.
ENCODE = {"mx4": 2e9, "int8": 3e9, "fp8_e4m3": 2.5e9, "bf16": 8e9}
DECODE = {"mx4": 4e9, "int8": 5e9, "fp8_e4m3": 4.5e9, "bf16": 9e9}
COPY = 3e9
PROFILE = CommsProfile(
    inter_host_Bps=LINK,
    intra_host_Bps=40 * LINK,
    encode_Bps=ENCODE,
    decode_Bps=DECODE,
    copy_Bps=COPY,
)
A2A = "POOLED_EMBEDDINGS_ALL_TO_ALL"
MS = 1e3  # TorchRec's estimates are in milliseconds


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    # TorchRec warns of every Topology built outside its factory.
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def _options(
    registry: Any,
    estimator: Any,
    topology: Any,
    sharding: str,
    tables: int = 1,
    data_type: Any = None,
) -> list[Any]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import DataType

    configs = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=DIM,
            num_embeddings=4096,
            feature_names=[f"f{t}"],
            data_type=data_type or DataType.FP32,
        )
        for t in range(tables)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    constraints = {f"t{t}": ParameterConstraints(sharding_types=[sharding]) for t in range(tables)}
    estimators = None
    if estimator is not None:
        estimators = [estimator, EmbeddingStorageEstimator(topology, constraints=constraints)]
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=BATCH, constraints=constraints, estimator=estimators
    )
    return enumerator.enumerate(ebc, [_sharder(registry)])


def _registry(*args: Any, **kwargs: Any) -> Any:
    # Planning runs no collective: a reduce-scatter codec needs no route here
    # (an earlier test may have put TorchRec's transport back).
    return qcomm.build_registry(*args, allow_unsummable_reduce_scatter=True, **kwargs)


def _sharder(registry: Any) -> Any:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    # TorchRec's sharder leaves row-wise out on CPU, as the step benchmark's does not.
    class Sharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types: list[str] = super().sharding_types(compute_device_type)
            return [*types, ShardingType.ROW_WISE.value]

    return Sharder(qcomm_codecs_registry=registry)


def _codec_s(name: str, elements: int) -> float:
    return 4 * elements / ENCODE[name] + 4 * elements / DECODE[name]


# Bytes per element, from each format (not from qcomm): mx4 16 bytes and an
# exponent per 32; int8 32 bytes and a float32 scale and bias per row of 32;
# fp8 row-wise (R + 8) / R at R = 32; bf16 two bytes.
WIRE = {"mx4": 17 / 32, "int8": 40 / 32, "fp8_e4m3": 40 / 32, "bf16": 2.0}


@pytest.mark.parametrize("forward", ["mx4", "int8", "fp8_e4m3"])
def test_table_wise_forward_comms_is_wire_bytes_over_the_link_plus_codec_time(forward: str) -> None:
    # Two ranks on two hosts: a table-wise table's owner sends its peer one block.
    registry = _registry(forward=forward, backward="bf16")
    topology = planner_topology(2, compute_device="cpu", local_world_size=1, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    (option,) = _options(registry, estimator, topology, "table_wise")
    perf = option.shards[0].perf
    fwd = ELEMENTS * WIRE[forward] / LINK + _codec_s(forward, ELEMENTS)
    bwd = ELEMENTS * WIRE["bf16"] / LINK + _codec_s("bf16", ELEMENTS)
    assert perf.fwd_comms == pytest.approx(MS * fwd, rel=0.02)
    assert perf.bwd_comms == pytest.approx(MS * bwd, rel=0.02)
    # TorchRec's own: one byte per uint8 element, the rank's own block
    # included, no codec time.
    (own,) = _options(registry, None, topology, "table_wise")
    assert own.shards[0].perf.fwd_comms == pytest.approx(MS * 2 * ELEMENTS * 1.0 / LINK)
    assert wire_bytes(registry[A2A].forward, BATCH, DIM) == ELEMENTS * WIRE[forward]


def test_torchrec_sizes_an_mx4_wire_at_188_times_its_bytes() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.utils import build_sharder_data

    registry = _registry(forward="mx4", backward="bf16")
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    torchrec_bytes, _ = build_sharder_data(sharder).qcomm_dtype_sizes[A2A]
    ours = wire_bytes(registry[A2A].forward, BATCH, DIM) / ELEMENTS
    assert torchrec_bytes / ours == pytest.approx(1.88, abs=0.005)


def test_codecs_by_host_send_nothing_encoded_inside_a_host() -> None:
    # Four ranks, two per host: of a table's three peers, one shares its
    # host (float32 at the host's rate, no codec) and two do not (int8).
    registry = _registry({A2A: "same_host=noop/noop+other_host=int8/bf16"})
    assert isinstance(registry[A2A], qcomm.HostCodecs)
    topology = planner_topology(4, compute_device="cpu", local_world_size=2, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    (option,) = _options(registry, estimator, topology, "table_wise")
    perf = option.shards[0].perf
    inside = 4 * ELEMENTS / PROFILE.intra_host_Bps
    fwd = inside + 2 * (ELEMENTS * WIRE["int8"] / LINK + _codec_s("int8", ELEMENTS))
    bwd = inside + 2 * (ELEMENTS * WIRE["bf16"] / LINK + _codec_s("bf16", ELEMENTS))
    assert perf.fwd_comms == pytest.approx(MS * fwd, rel=0.02)
    assert perf.bwd_comms == pytest.approx(MS * bwd, rel=0.02)


def test_row_wise_shards_take_the_reduce_scatters_codecs() -> None:
    registry = _registry(
        "pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=mx4/bf16"
    )
    topology = planner_topology(2, compute_device="cpu", local_world_size=1, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    (option,) = _options(registry, estimator, topology, "row_wise")
    assert len(option.shards) == 2
    for shard in option.shards:
        # Every shard sends its peer the partial sums of the peer's batch,
        # and adds the peer's into its own: 1.5 times a copy.
        sums = 1.5 * 4 * ELEMENTS / COPY
        fwd = ELEMENTS * WIRE["mx4"] / LINK + _codec_s("mx4", ELEMENTS) + sums
        assert shard.perf.fwd_comms == pytest.approx(MS * fwd, rel=0.02)


def _all_reduce_steps(n: int, numel: int, wire: float, codec: str | None) -> float:
    # qcomm's all-reduce on n ranks (one per host), step by step, for one
    # rank: the buffer is n blocks, each peer owns one.
    block = numel / n
    reduce_scatter = {"sent": n - 1, "encoded": n - 1, "decoded": n - 1}
    # The owner decodes its own encoded block too, so that all ranks agree.
    all_gather = {"sent": n - 1, "encoded": 1, "decoded": n}
    steps = (reduce_scatter, all_gather)
    seconds = sum(s["sent"] for s in steps) * block * wire / LINK
    if codec is not None:
        seconds += sum(s["encoded"] for s in steps) * 4 * block / ENCODE[codec]
        seconds += sum(s["decoded"] for s in steps) * 4 * block / DECODE[codec]
    return seconds


def test_data_parallel_tables_are_all_reduced_at_the_ddp_hooks_codec() -> None:
    from torchrec.modules.embedding_configs import DataType

    n = 4
    topology = planner_topology(n, compute_device="cpu", local_world_size=1, profile=PROFILE)
    registry = _registry(forward="int8", backward="bf16")
    plain = CodecPerfEstimator(topology, registry, profile=PROFILE)
    hooked = CodecPerfEstimator(topology, registry, profile=PROFILE, dense_codec="bf16")
    numel = 4096 * DIM
    cases = [
        (plain, DataType.FP32, _all_reduce_steps(n, numel, 4.0, None)),
        (hooked, DataType.FP32, _all_reduce_steps(n, numel, 2.0, "bf16")),
        # No hook: a half-precision table's gradients travel at two bytes each.
        (plain, DataType.FP16, _all_reduce_steps(n, numel, 2.0, None)),
    ]
    for estimator, data_type, seconds in cases:
        (option,) = _options(registry, estimator, topology, "data_parallel", data_type=data_type)
        assert option.tensor.dtype == (
            torch.float16 if data_type == DataType.FP16 else torch.float32
        )
        assert option.shards[0].perf.bwd_comms == pytest.approx(MS * seconds, rel=0.02)
        assert option.shards[0].perf.fwd_comms == 0


def test_a_registry_built_with_torchrecs_codecs_costs_its_no_op_as_free() -> None:
    from torchrec.distributed.types import NoOpQuantizedCommCodec as TorchRecNoOp
    from torchrec.distributed.types import QuantizedCommCodecs

    # TorchRec's pair defaults its backward to its own no-op codec, whose
    # quantized_dtype is a method.
    registry = {A2A: QuantizedCommCodecs(forward=qcomm.load_codec("int8"))}
    assert isinstance(registry[A2A].backward, TorchRecNoOp)
    topology = planner_topology(2, compute_device="cpu", local_world_size=1, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    # TorchRec 1.8's own enumerator cannot size that no-op's wire
    # (build_sharder_data): the option comes from a qcomm registry.
    (option,) = _options(_registry(forward="int8"), None, topology, "table_wise")
    fwd_ms, bwd_ms = estimator.shard_comms(option, option.shards[0]) or (0.0, 0.0)
    fwd = ELEMENTS * WIRE["int8"] / LINK + _codec_s("int8", ELEMENTS)
    assert fwd_ms == pytest.approx(MS * fwd, rel=0.02)
    assert bwd_ms == pytest.approx(MS * 4 * ELEMENTS / LINK, rel=1e-9)
    assert wire_bytes(registry[A2A].backward, BATCH, DIM) == 4 * ELEMENTS

    class PassThrough:
        # A plugin's codec that sends the float32 data as it is, by any name.
        info = qcomm.CodecInfo(name="pass_through", bits_per_element=32.0, summable=True)
        quantized_dtype = torch.float32

        def create_context(self) -> None:
            return None

        def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
            return input_len

    profile = CommsProfile(
        inter_host_Bps=LINK, intra_host_Bps=LINK, encode_Bps={"pass_through": 1.0}
    )
    for free in (TorchRecNoOp(), qcomm.NoOpQuantizedCommCodec(torch.float16), PassThrough()):
        assert profile.codec_seconds(free, 1e9, encode=True) == 0.0, free
    assert profile.codec_seconds(qcomm.load_codec("int8"), 1e9, encode=True) > 0


def test_without_measurements_the_documented_model_stands_in() -> None:
    assert DEFAULT_PROFILE.inter_host_Bps == 12.5 * 1024**3
    assert DEFAULT_PROFILE.intra_host_Bps == 600 * 1024**3
    assert DEFAULT_PROFILE.codec_seconds("int8", DEFAULT_CODEC_BPS, encode=True) == 1.0
    assert DEFAULT_PROFILE.codec_seconds("noop", 1e12, encode=False) == 0.0
    assert DEFAULT_PROFILE.copy_Bps == DEFAULT_COPY_BPS == 1e12
    topology = planner_topology(2, compute_device="cpu", local_world_size=1)
    # TorchRec's own default, in its bytes per millisecond.
    assert topology.comms_bandwidths.inter_host_bw == pytest.approx(12.5 * 1024**3 / 1000)
    registry = _registry(forward="int8", backward="bf16")
    (option,) = _options(registry, CodecPerfEstimator(topology, registry), topology, "table_wise")
    fwd = (
        ELEMENTS * WIRE["int8"] / DEFAULT_PROFILE.inter_host_Bps + 8 * ELEMENTS / DEFAULT_CODEC_BPS
    )
    assert option.shards[0].perf.fwd_comms == pytest.approx(MS * fwd, rel=0.02)


def _bench_json(link: bool) -> dict[str, Any]:
    codec = {"source": "qcomm", "status": "ok", "encode_GBps": 2.0, "decode_GBps": 4.0}
    data: dict[str, Any] = {
        "meta": {"world_size": 2, "link": "1gbit" if link else None},
        "codecs": [
            {**codec, "codec": "mx4"},
            {**codec, "codec": "int8:row_dim=64", "encode_GBps": 3.0},
            {**codec, "codec": "int8", "source": "fbgemm", "encode_GBps": 99.0},
        ],
    }
    if link:
        data["roofline"] = {"bytes": 1 << 24, "copy_s": 0.005, "copy_GBps": 2.5}
        data["link"] = {
            "spec": "1gbit",
            "rate_bps": 1e9,
            "one_way_GBps": 0.118,
            "both_ways_GBps": 0.117,
        }
    return data


def test_a_bench_file_gives_the_estimator_its_rates(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_json(link=True)))
    profile = profile_from_bench(path)
    # Both ways at once, as a collective sends; a rank per host.
    assert profile.inter_host_Bps == pytest.approx(0.117e9)
    assert profile.intra_host_Bps == profile.inter_host_Bps
    assert profile.encode_Bps == {"mx4": 2e9, "int8": 3e9}  # qcomm's rows only
    assert profile.decode_Bps == {"mx4": 4e9, "int8": 4e9}
    assert profile.copy_Bps == pytest.approx(2.5e9)
    assert profile.source == "bench"
    # On loopback the link is not measured: the model's rates stand in.
    loopback = profile_from_bench(_bench_json(link=False))
    assert loopback.inter_host_Bps == DEFAULT_PROFILE.inter_host_Bps
    assert loopback.encode_Bps["mx4"] == 2e9
    assert loopback.copy_Bps == DEFAULT_COPY_BPS
    with pytest.raises(ValueError, match="results"):
        profile_from_bench({"codecs": []})


def test_the_bench_measures_the_link_inside_a_host_for_the_planner() -> None:
    # Two hosts of two ranks: the JSON holds both rates, the profile takes them.
    data = _bench_json(link=True)
    data["meta"]["ranks_per_host"] = 2
    data["link"]["same_host_both_ways_GBps"] = 2.5
    profile = profile_from_bench(data)
    assert profile.inter_host_Bps == pytest.approx(0.117e9)
    assert profile.intra_host_Bps == pytest.approx(2.5e9)
    # Not measured inside a host: the model's rate stands in.
    del data["link"]["same_host_both_ways_GBps"]
    assert profile_from_bench(data).intra_host_Bps == DEFAULT_PROFILE.intra_host_Bps
    # A --train run names its link's rate only: TCP's share of it.
    train = {"meta": {"link": "1gbit"}, "link": {"spec": "1gbit", "rate_bps": 1e9}, "train": {}}
    assert profile_from_bench(train).inter_host_Bps == pytest.approx(1e9 / 8 * 0.95)


def test_codecs_by_host_must_split_the_hosts_as_the_topology_does() -> None:
    from torchrec.distributed.types import QuantizedCommCodecs

    pair = QuantizedCommCodecs(qcomm.load_codec("int8"), qcomm.load_codec("bf16"))
    registry = {A2A: qcomm.HostCodecs(other_host=pair, ranks_per_host=2)}
    flat = planner_topology(4, compute_device="cpu", local_world_size=1, profile=PROFILE)
    with pytest.raises(ValueError, match=r"ranks_per_host=2.*local_world_size=1"):
        CodecPerfEstimator(flat, registry, profile=PROFILE)
    # Two per host, as the codecs say: one peer inside the host, uncoded.
    topology = planner_topology(4, compute_device="cpu", local_world_size=2, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    (option,) = _options(registry, estimator, topology, "table_wise")
    inside = 4 * ELEMENTS / PROFILE.intra_host_Bps
    fwd = inside + 2 * (ELEMENTS * WIRE["int8"] / LINK + _codec_s("int8", ELEMENTS))
    assert option.shards[0].perf.fwd_comms == pytest.approx(MS * fwd, rel=0.02)


def test_the_estimator_takes_torchrecs_sharder_data_and_refuses_none() -> None:
    registry = _registry(forward="int8", backward="bf16")
    topology = planner_topology(2, compute_device="cpu", local_world_size=1, profile=PROFILE)
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE)
    options = _options(registry, estimator, topology, "table_wise")
    with pytest.raises(ValueError, match="sharder_data_map"):
        estimator.estimate(options, None)


def test_a_codec_benched_with_several_parameter_sets_is_costed_at_its_defaults() -> None:
    codec = {"source": "qcomm", "status": "ok", "decode_GBps": 9.0}
    data = _bench_json(link=False)
    data["codecs"] = [
        {**codec, "codec": "int8:row_dim=64", "encode_GBps": 3.0},
        {**codec, "codec": "int8", "encode_GBps": 2.0},
        {**codec, "codec": "int8:row_dim=16", "encode_GBps": 7.0},
        {**codec, "codec": "mx4:a=1", "encode_GBps": 5.0},
        {**codec, "codec": "mx4:a=2", "encode_GBps": 6.0},
        {**codec, "codec": "same_host=noop/noop+other_host=int8/bf16", "encode_GBps": 1.0},
    ]
    profile = profile_from_bench(data)
    assert dict(profile.encode_Bps) == {"int8": 2e9, "mx4": 5e9}
    assert dict(profile.decode_Bps) == {"int8": 9e9, "mx4": 9e9}


def test_bad_bench_files_profiles_and_plans_are_refused_naming_them(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="results: cannot read"):
        profile_from_bench(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="results: cannot read"):
        profile_from_bench(bad)
    with pytest.raises(TypeError, match="encode_Bps"):
        CommsProfile(inter_host_Bps=1.0, intra_host_Bps=1.0, encode_Bps=[1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plan"):
        plan_specs(["t0"])
    # The shared default cannot be changed in place.
    with pytest.raises(TypeError):
        DEFAULT_PROFILE.encode_Bps["int8"] = 1.0  # type: ignore[index]
    rates = {"int8": 2e9}
    profile = CommsProfile(inter_host_Bps=1.0, intra_host_Bps=1.0, encode_Bps=rates)
    rates["int8"] = 1.0
    assert profile.encode_Bps["int8"] == 2e9


def test_bad_rates_and_registries_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="inter_host_Bps"):
        CommsProfile(inter_host_Bps=0.0, intra_host_Bps=1.0)
    with pytest.raises(ValueError, match=r"encode_Bps\['int8'\]"):
        CommsProfile(inter_host_Bps=1.0, intra_host_Bps=1.0, encode_Bps={"int8": -1.0})
    with pytest.raises(ValueError, match="rows"):
        wire_bytes(qcomm.load_codec("int8"), -1, 4)
    topology = planner_topology(2, compute_device="cpu")
    with pytest.raises(TypeError, match="registry"):
        CodecPerfEstimator(topology, ["int8"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="profile"):
        CodecPerfEstimator(topology, None, profile={"inter_host_Bps": 1.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        planner_topology(0)
    with pytest.raises(ValueError, match="local_world_size"):
        planner_topology(2, local_world_size=0)
    with pytest.raises(qcomm.CodecError, match="no_such_codec"):
        CodecPerfEstimator(topology, None, dense_codec="no_such_codec")


def _mixed_model(tables: int) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=DIM, num_embeddings=4096, feature_names=[f"f{t}"]
        )
        for t in range(tables)
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_a_plan_made_with_the_estimator_is_one_the_step_benchmark_runs() -> None:
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    from qcomm.benchmark.train_plan import parse_plan, table_generators

    tables = 4
    registry = _registry(forward="mx4", backward="bf16")
    topology = planner_topology(2, compute_device="cpu", local_world_size=1, profile=PROFILE)
    kinds = ["table_wise", "row_wise", "column_wise"]
    constraints = {f"t{t}": ParameterConstraints(sharding_types=kinds) for t in range(tables)}
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE, constraints=constraints)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=BATCH,
        constraints=constraints,
        estimator=[estimator, EmbeddingStorageEstimator(topology, constraints=constraints)],
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, enumerator=enumerator, constraints=constraints
    )
    sharder = _sharder(registry)
    ebc = _mixed_model(tables)
    plan = planner.plan(ebc, [sharder])
    specs = plan_specs(plan)
    assert sorted(specs) == [f"t{t}" for t in range(tables)]
    # What --train-plan reads back builds TorchRec's plan of the bench's tables.
    checked = parse_plan(json.loads(json.dumps(specs)), tables, 2)
    rebuilt = construct_module_sharding_plan(
        ebc,
        table_generators(checked),
        sharder=sharder,
        local_size=2,
        world_size=2,
        device_type="cpu",
    )
    (module_plan,) = plan.plan.values()
    for name, sharding in module_plan.items():
        assert rebuilt[name].sharding_type == sharding.sharding_type
        assert rebuilt[name].ranks == sharding.ranks


def test_a_bench_plan_that_does_not_fit_is_refused_naming_the_table() -> None:
    from qcomm.benchmark.train_plan import parse_plan

    with pytest.raises(ValueError, match="--train-plan: expected the tables t0, t1"):
        parse_plan({"t0": "row_wise"}, 2, 2)
    with pytest.raises(ValueError, match="table t1"):
        parse_plan({"t0": "row_wise", "t1": "table_wise:2"}, 2, 2)
    with pytest.raises(ValueError, match="table t0"):
        parse_plan({"t0": "data_parallel", "t1": "row_wise"}, 2, 2)
    with pytest.raises(ValueError, match="table t0"):
        parse_plan({"t0": "table_wise", "t1": "row_wise"}, 2, 2)


def test_the_step_benchmark_reads_a_plan_from_its_command_line(tmp_path: pathlib.Path) -> None:
    from qcomm.benchmark.command import config_from_args
    from qcomm.benchmark.train import table_wise_count
    from qcomm.cli import build_parser

    def config(*argv: str) -> Any:
        return config_from_args(build_parser().parse_args(["bench", "--train", "--quick", *argv]))

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"t0": "row_wise", "t1": "table_wise:1"}))
    read = config("--train-plan", str(path))
    assert read.train_plan == {"t0": "row_wise", "t1": "table_wise:1"}
    assert table_wise_count(read) == 1
    with pytest.raises(ValueError, match="--train-plan: shards every table"):
        config("--train-plan", str(path), "--train-sharding", "row_wise")
    path.write_text(json.dumps({"t0": "row_wise", "t1": "table_wise:2"}))
    with pytest.raises(ValueError, match="--train-plan: table t1"):
        config("--train-plan", str(path))  # two ranks: no rank 2
    with pytest.raises(ValueError, match="--train-plan: cannot read"):
        config("--train-plan", str(tmp_path / "none.json"))


def test_the_step_benchmark_counts_each_sharding_of_a_plan() -> None:
    from types import SimpleNamespace

    from qcomm.benchmark.options import BenchConfig
    from qcomm.benchmark.report import _train_what
    from qcomm.benchmark.results import DlrmModel, DlrmTrain
    from qcomm.benchmark.train import sharding_counts

    plan = {"t0": "column_wise:0,1", "t1": "table_wise:1", "t2": "row_wise", "t3": "column_wise:1"}
    counts = sharding_counts(BenchConfig(train_tables=4, train_plan=plan))
    assert counts == {"table_wise": 1, "row_wise": 1, "column_wise": 2}
    model = DlrmModel(tables=4, rows=8, dim=4, batch_per_rank=2)
    model.table_wise, model.row_wise = counts["table_wise"], counts["row_wise"]
    model.column_wise = counts["column_wise"]
    meta = SimpleNamespace(
        local=True, world_size=2, backend="gloo", device="cpu", threads_per_rank=1, duration_s=1.0
    )
    lines = _train_what(SimpleNamespace(meta=meta, link=None), DlrmTrain(model=model))  # type: ignore[arg-type]
    assert "(1 table-wise, 1 row-wise, 2 column-wise)" in lines[1]
