"""Which transport a TorchRec call takes (``qcomm.torchrec_exchange.route``),
the same answer its call gives (counted in spawned ranks, on both of qcomm's
transports); and the reduce-scatter summability rule where wires are summed:
``build_registry`` keeps it only where TorchRec's own transport is chosen."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import TRANSPORTS, run_ranks, transport_env

import qcomm
from qcomm import CodecError, CommOp, config, torchrec_exchange
from qcomm.torchrec_exchange import Route, route

A2A = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER


def test_codecs_not_from_qcomm_take_torchrecs_transport() -> None:
    theirs = object()  # a TorchRec QuantizedCommCodecs, say
    assert route(A2A, theirs) == Route(
        "torchrec", "the codecs are not a qcomm pair (none, or TorchRec's own)"
    )


def test_the_setting_chooses_torchrecs_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    with config.configured(torchrec_collectives="torchrec"):
        found = route("pooled_embeddings_all_to_all")
    assert found.transport == "torchrec"
    assert found.reason == (
        "the setting torchrec_collectives is 'torchrec' (qcomm.config.torchrec_collectives)"
    )
    monkeypatch.setenv("QCOMM_TORCHREC_COLLECTIVES", "torchrec")
    assert "(QCOMM_TORCHREC_COLLECTIVES)" in route(RS).reason
    monkeypatch.setenv("QCOMM_TORCHREC_COLLECTIVES", "nccl")
    with pytest.raises(ValueError, match="QCOMM_TORCHREC_COLLECTIVES: expected"):
        route(RS)


def test_a_compiled_call_takes_qcomms_exchange() -> None:
    qcomm.build_registry(forward="fp16")  # qcomm's exchange installed or due
    assert route(A2A).transport == "qcomm"
    assert route(A2A, compiled=True) == route(A2A)


def test_an_unknown_op_is_refused() -> None:
    with pytest.raises(CodecError, match="unknown CommOp 'all_reduce'"):
        route("all_reduce")


def test_a_reduce_scatter_pair_torchrec_cannot_carry_is_said_to_be_refused() -> None:
    pair = qcomm.load_pair("int8/fp16")
    qcomm.build_registry(forward="fp16")
    assert route(RS, pair).transport == "qcomm"
    with config.configured(torchrec_collectives="torchrec"):
        found = route(RS, pair)
        assert route(A2A, pair).reason in found.reason  # the all-to-all sums nothing
    assert found.transport == "torchrec"
    assert found.reason.endswith("the call is refused: forward codec 'int8' is not summable")


# -- the summability rule where wires are summed ---------------------------------


def test_an_unsummable_reduce_scatter_pair_is_taken_for_qcomms_exchange() -> None:
    # The default route decodes every part before summing: no refusal, no opt-out.
    for registry in (
        qcomm.build_registry(forward="int8", backward="bf16"),
        qcomm.build_registry({RS: "fp8_e4m3_tensor/int8"}),
        qcomm.build_registry("pooled_embeddings_reduce_scatter=same_host=noop+other_host=int8"),
    ):
        assert RS.name in registry


def test_an_unsummable_reduce_scatter_pair_is_refused_where_torchrecs_transport_is_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with config.configured(torchrec_collectives="torchrec"):
        with pytest.raises(CodecError) as caught:
            qcomm.build_registry({RS: "int8/fp16"})
        msg = str(caught.value)
        assert msg.startswith(
            "build_registry: codec 'int8' cannot be the forward codec of "
            "POOLED_EMBEDDINGS_REDUCE_SCATTER on TorchRec's own transport, which TorchRec's "
            "reduce-scatter takes here (the setting torchrec_collectives is 'torchrec' "
            "(qcomm.config.torchrec_collectives))"
        ), msg
        assert "e.g. build_registry({CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER: 'bf16/fp16'})" in msg
        assert "pass allow_unsummable_reduce_scatter=True" in msg
        registry = qcomm.build_registry({RS: "int8/fp16"}, allow_unsummable_reduce_scatter=True)
        assert type(registry[RS.name].forward).__name__ == "Int8Codec"
        # The setting codecs, set in code: the fix is written as a setting too.
        with config.configured(codecs="int8"):
            with pytest.raises(CodecError, match=r"^qcomm.config.codecs: codec 'int8'") as caught:
                qcomm.build_registry()
        assert "e.g. qcomm.config.configure(codecs='pooled_embeddings_all_to_all=int8," in str(
            caught.value
        )
    monkeypatch.setenv("QCOMM_TORCHREC_COLLECTIVES", "torchrec")
    with pytest.raises(CodecError, match=r"takes here \(the setting .* \(QCOMM_TORCHREC_COLL"):
        qcomm.build_registry(forward="fp16", backward="int8")


def _script(body: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_route_follows_install_and_uninstall() -> None:
    # A fresh process: nothing installed until a registry is built, due at
    # TorchRec's import; uninstall() chooses TorchRec's transport, and its
    # rule comes back with it.
    out = _script(
        """
        import sys
        import qcomm
        from qcomm import torchrec_exchange as tx
        rs = "pooled_embeddings_reduce_scatter"
        print(tx.route(rs).reason)
        qcomm.build_registry(forward="int8")
        assert "torchrec" not in sys.modules
        print(tx.route(rs).transport)
        tx.uninstall()
        print(tx.route(rs).reason)
        try:
            qcomm.build_registry(forward="int8")
        except qcomm.CodecError as err:
            print(str(err).split(": it sums")[0])
        tx.install()
        print(tx.route(rs).transport, tx.installed())
        print(len(qcomm.build_registry(forward="int8")))
        """
    )
    assert out.splitlines() == [
        "qcomm's exchange is not installed in TorchRec (install(), or build a registry)",
        "qcomm",
        "qcomm.torchrec_exchange.uninstall() put TorchRec's functions back",
        "build_registry: codec 'int8' cannot be the forward codec of "
        "POOLED_EMBEDDINGS_REDUCE_SCATTER on TorchRec's own transport, which TorchRec's "
        "reduce-scatter takes here (qcomm.torchrec_exchange.uninstall() put TorchRec's "
        "functions back)",
        "qcomm True",
        "3",
    ]


# -- the query and the call agree (spawned ranks) -------------------------------


def _calls(
    rank: int, world: int, registry: dict[str, Any], op: CommOp, compiled: bool = False
) -> tuple[Route, str]:
    """The route of ``op`` with the registry's pair, and what its call did:
    ``"qcomm"`` (counted on qcomm's exchange), ``"torchrec"`` or the error."""
    from torchrec.distributed.dist_data import (
        PooledEmbeddingsAllToAll,
        PooledEmbeddingsReduceScatter,
    )

    pair = registry[op.name]
    found = route(op, pair, compiled=compiled)
    before = sum(counted("torchrec_call").values())
    x = torch.full((2 * world, 4), 0.25 * (rank + 1))
    try:
        if op is RS:
            PooledEmbeddingsReduceScatter(dist.group.WORLD, codecs=pair)(x).wait()
        else:
            a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, [4] * world, codecs=pair)
            a2a(x[:2]).wait()
    except CodecError as err:
        return found, str(err)
    return found, "qcomm" if sum(counted("torchrec_call").values()) > before else "torchrec"


def _route_and_call(rank: int, world: int) -> dict[str, Any]:
    from torchrec.distributed import comm_ops

    # Built without the opt-out: an unsummable reduce-scatter pair is fine on
    # qcomm's exchange, the route by default.
    registry = qcomm.build_registry(
        {A2A: "fp16/bf16", RS: "fp8_e4m3_tensor/fp16"},
    )
    half = qcomm.build_registry(forward="fp16", backward="fp16")
    out: dict[str, Any] = {}
    out["default a2a"] = _calls(rank, world, registry, A2A)
    out["default rs"] = _calls(rank, world, registry, RS)
    comm_ops.set_use_sync_collectives(True)
    out["sync a2a"] = _calls(rank, world, registry, A2A)
    out["sync rs"] = _calls(rank, world, registry, RS)
    out["sync rs fp16"] = _calls(rank, world, half, RS)
    comm_ops.set_use_sync_collectives(False)
    # The setting is read at the first call after an install.
    torchrec_exchange.uninstall()
    with config.configured(torchrec_collectives="torchrec"):
        torchrec_exchange.install()
        out["setting a2a"] = _calls(rank, world, registry, A2A)
        out["setting rs"] = _calls(rank, world, registry, RS)
    out["held a2a"] = _calls(rank, world, registry, A2A)
    torchrec_exchange.uninstall()
    torchrec_exchange.install()
    out["again a2a"] = _calls(rank, world, registry, A2A)
    dist.barrier()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_route_is_the_one_the_call_takes(transport: str) -> None:
    pytest.importorskip("torchrec")
    for r in run_ranks(_route_and_call, 2, timeout=300.0, env=transport_env(transport)):
        for case, (found, did) in r.items():
            if did.startswith("comm_ops."):  # refused: the route said so, and why
                assert found.transport == "torchrec", (case, found, did)
                assert "the call is refused" in found.reason, (case, found, did)
                why = found.reason.split("; the call is refused")[0]
                assert f"transport ({why})" in did, (case, found, did)
            else:
                assert found.transport == did, (case, found, did)
        assert [r[c][0].transport for c in r] == [
            "qcomm",  # default a2a
            "qcomm",  # default rs
            "qcomm",  # sync a2a
            "qcomm",  # sync rs
            "qcomm",  # sync rs fp16
            "torchrec",  # setting a2a
            "torchrec",  # setting rs
            "torchrec",  # held a2a: the setting as it was at the first call
            "qcomm",  # again a2a
        ], r
        assert r["setting rs"][1].startswith("comm_ops."), r
        assert "'torchrec' at the first call since install()" in r["held a2a"][0].reason, r
