"""Adaptive codecs where no collective runs: the planner costs one at its last
(most precise) candidate, and :func:`~qcomm.torchrec_exchange.route` says a
pair holding one is refused on TorchRec's own transport."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import qcomm
from qcomm import CommOp, config, torchrec_exchange
from qcomm.planner import CodecPerfEstimator, CommsProfile, planner_topology, wire_bytes
from qcomm.torchrec_exchange import route

pytest.importorskip("torchrec")

BATCH, DIM = 2048, 128
# Rates far apart, so that a cost taken at the wrong candidate shows.
PROFILE = CommsProfile(
    inter_host_Bps=125e6,
    intra_host_Bps=5e9,
    encode_Bps={"mx4": 2e9, "int8": 3e9, "bf16": 8e9, "fp16": 7e9},
    decode_Bps={"mx4": 4e9, "int8": 5e9, "bf16": 9e9, "fp16": 6e9},
)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # TorchRec warns of every Topology built outside its factory.
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def _perf(registry: Any, sharding: str, dense: Any = None) -> list[tuple[float, float]]:
    """Every shard's forward and backward communication, as the estimator costs it."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    class Sharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types: list[str] = super().sharding_types(compute_device_type)
            return [*types, ShardingType.ROW_WISE.value]

    import torch

    config_ = EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=4096, feature_names=["f"]
    )
    ebc = EmbeddingBagCollection(tables=[config_], device=torch.device("meta"))
    topology = planner_topology(4, compute_device="cpu", local_world_size=2, profile=PROFILE)
    constraints = {"t": ParameterConstraints(sharding_types=[sharding])}
    estimator = CodecPerfEstimator(topology, registry, profile=PROFILE, dense_codec=dense)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=BATCH,
        constraints=constraints,
        estimator=[estimator, EmbeddingStorageEstimator(topology, constraints=constraints)],
    )
    (option,) = enumerator.enumerate(ebc, [Sharder(qcomm_codecs_registry=registry)])
    return [(s.perf.fwd_comms, s.perf.bwd_comms) for s in option.shards]


def _registry(forward: str, backward: str) -> Any:
    return qcomm.build_registry(
        forward=forward, backward=backward, allow_unsummable_reduce_scatter=True
    )


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "data_parallel"])
def test_the_planner_costs_an_adaptive_codec_at_its_last_candidate(sharding: str) -> None:
    adaptive = _perf(
        _registry("adaptive:mx4|int8|bf16", "adaptive:int8|fp16"),
        sharding,
        dense="adaptive:mx4|int8",
    )
    plain = _perf(_registry("bf16", "fp16"), sharding, dense="int8")
    cheapest = _perf(_registry("mx4", "int8"), sharding, dense="mx4")
    assert adaptive == plain, (adaptive, plain)
    assert adaptive != cheapest  # the estimate reads the candidate it costs


def test_wire_bytes_and_codec_time_of_an_adaptive_codec_are_its_last_candidates() -> None:
    adaptive = qcomm.load_codec("adaptive:mx4|int8")
    guard = qcomm.load_codec("mx4:max_error=0.1")
    int8, mx4 = qcomm.load_codec("int8"), qcomm.load_codec("mx4")
    assert wire_bytes(adaptive, BATCH, DIM) == wire_bytes(int8, BATCH, DIM)
    assert wire_bytes(guard, BATCH, DIM, pooled=False) == wire_bytes(mx4, BATCH, DIM, pooled=False)
    for encode in (True, False):
        seconds = PROFILE.codec_seconds(adaptive, 1e9, encode=encode)
        assert seconds == PROFILE.codec_seconds(int8, 1e9, encode=encode)


def test_the_route_says_an_adaptive_pair_is_refused_on_torchrecs_transport() -> None:
    torchrec_exchange.install()  # whatever an earlier test left
    pair = qcomm.load_pair("int8/adaptive:fp16|bf16")
    assert route(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, pair).transport == "qcomm"
    with config.configured(torchrec_collectives="torchrec"):
        found = route(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL, pair)
    assert found.transport == "torchrec"
    assert found.reason == (
        "the setting torchrec_collectives is 'torchrec' (qcomm.config.torchrec_collectives); "
        "the call is refused: its backward codec (fp16|bf16, max_error=0.03) is adaptive or "
        "budgeted"
    )
