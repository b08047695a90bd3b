"""The benchmark reads codec specs with qcomm's one spec parser (qcomm.specs)
and a codec's summability from its CodecInfo, not from a list of names."""

from __future__ import annotations

import pytest

from qcomm import CommOp
from qcomm.benchmark.harness import TrainSeries
from qcomm.benchmark.options import check_spec, host_parts

RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value


def _unsummable(registry: str) -> bool:
    return TrainSeries("s", "qcomm", "int8/bf16", registry).unsummable_reduce_scatter


def test_the_reduce_scatter_summability_comes_from_the_codec() -> None:
    # A registry string as build_registry reads it: op names in any case,
    # blanks around a pair, options after a codec.
    assert _unsummable(f"{RS}=int8/bf16")
    assert _unsummable(f"{RS.upper()}=int8/bf16")
    assert not _unsummable(f"{RS}= fp16/fp16")
    assert not _unsummable(f"{RS}=bf16 / bf16")
    # A codec the old list of names did not know: its CodecInfo says.
    assert _unsummable(f"{RS}=example_fp16_scaled:block_size=32/bf16")
    assert not _unsummable(f"{CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value}=int8/bf16")


def test_codecs_by_host_specs_split_their_pairs_with_the_spec_parser() -> None:
    assert host_parts("same_host=noop+other_host= int8 / bf16") == {
        "same_host": "noop",
        "other_host": "int8",
    }
    check_spec("same_host=noop+other_host=int8/bf16")
    with pytest.raises(Exception, match="forward/backward"):
        check_spec("same_host=noop+other_host=int8/bf16/fp16")


def test_the_dlrm_mode_asks_qcomm_how_the_reduce_scatter_is_routed(monkeypatch) -> None:
    pytest.importorskip("torchrec")
    from qcomm import config, torchrec_exchange
    from qcomm.benchmark import train

    asked: list[object] = []
    route = torchrec_exchange.route

    def counted(op: object, *args: object, **kwargs: object) -> object:
        asked.append(op)
        return route(op, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torchrec_exchange, "route", counted)
    was = torchrec_exchange.installed()
    try:
        assert train._refused() is None  # qcomm's exchange, installed: it carries int8
        with config.configured(torchrec_collectives="torchrec"):
            assert "torchrec_collectives" in (train._refused() or "")
    finally:
        if not was:  # as the other tests found it
            torchrec_exchange.uninstall()
    assert asked == [CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER] * 2
