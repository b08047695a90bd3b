"""Where qcomm's exchange gets into TorchRec, and where it stays out
(``qcomm.torchrec_exchange``): a registry built in a launcher and handed to
spawned ranks brings it with it, and ``uninstall()`` holds whatever comes
after it, TorchRec's own import included."""

from __future__ import annotations

import pickle
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
from qcomm import torchrec_exchange

pytest.importorskip("torchrec")

WORLD = 3
# Ranks 0 and 1 share a host, rank 2 is alone on another.
HOSTS = {"QCOMM_RANKS_PER_HOST": "2"}
GROUPS = ([0, 1], [1, 2], [0, 1, 2])
BATCH, DIM = 4, 8
# fp8_e4m3_tensor takes values up to 0.9375 unscaled.
MAGNITUDE = 0.9


def _registry() -> dict[str, qcomm.QuantizedCommCodecs]:
    return qcomm.build_registry(
        {
            "pooled_embeddings_all_to_all": "same_host=noop+other_host=int8/bf16",
            # Not summable: its wires summed as they are would be wrong.
            "pooled_embeddings_reduce_scatter": "fp8_e4m3_tensor/fp16",
        },
        allow_unsummable_reduce_scatter=True,
    )


def _data(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=gen) * 2 - 1) * MAGNITUDE


def _pooled(registry: dict[str, Any], rank: int, members: list[int]) -> dict[int, Any]:
    # Every block of the output and of the gradient, by the rank it came from:
    # its error against the exact value (gradient times TorchRec's division).
    from torchrec.distributed.comm_ops import get_gradient_division
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    group = dist.new_group(members)
    if rank not in members:
        return {}
    world, me = len(members), members.index(rank)
    xs = {r: _data(10 + r, world * BATCH, DIM) for r in members}
    gs = {r: _data(20 + r, BATCH, world * DIM) for r in members}
    a2a = PooledEmbeddingsAllToAll(
        group, [DIM] * world, codecs=registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    )
    x = xs[rank].clone().requires_grad_(True)
    y = a2a(x).wait()
    y.backward(gs[rank])
    assert x.grad is not None
    divide = world if get_gradient_division() else 1
    out = {}
    for k, peer in enumerate(members):
        rows, cols = slice(k * BATCH, (k + 1) * BATCH), slice(k * DIM, (k + 1) * DIM)
        fwd = (y[:, cols] - xs[peer][me * BATCH : (me + 1) * BATCH]).abs().max().item()
        bwd = (x.grad[rows] * divide - gs[peer][:, me * DIM : (me + 1) * DIM]).abs().max().item()
        out[peer] = (fwd, bwd)
    return out


def _reduce_scatter(registry: dict[str, Any], rank: int) -> float:
    from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter

    rs = PooledEmbeddingsReduceScatter(
        dist.group.WORLD, codecs=registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    )
    xs = [_data(30 + r, WORLD * BATCH, DIM) for r in range(WORLD)]
    y = rs(xs[rank]).wait()
    exact = torch.stack([x[rank * BATCH : (rank + 1) * BATCH] for x in xs]).sum(dim=0)
    return float((y - exact).abs().max())


def _spawned(rank: int, world_size: int, registry: dict[str, Any]) -> dict[str, Any]:
    from torchrec.distributed import dist_data  # noqa: F401  (TorchRec imported in the rank)

    out: dict[str, Any] = {"installed": torchrec_exchange.installed()}
    before = sum(counted("torchrec_call").values())
    out["pooled"] = {str(m): _pooled(registry, rank, m) for m in GROUPS}
    out["reduce_scatter"] = _reduce_scatter(registry, rank)
    out["calls"] = sum(counted("torchrec_call").values()) - before
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_registry_handed_to_spawned_ranks_runs_on_qcomms_exchange(transport: str) -> None:
    registry = _registry()  # built here, pickled to the ranks
    per_rank = run_ranks(
        _spawned, WORLD, registry, env={**HOSTS, **transport_env(transport)}, timeout=240.0
    )
    int8 = qcomm.codec_info(qcomm.load_codec("int8"))
    bf16 = qcomm.codec_info(qcomm.load_codec("bf16"))
    fp8 = qcomm.codec_info(qcomm.load_codec("fp8_e4m3_tensor"))
    for rank, r in enumerate(per_rank):
        assert r["installed"], f"rank {rank}: qcomm's exchange not installed"
        # Two pooled calls per group the rank is in, and the reduce-scatter.
        in_groups = sum(rank in m for m in GROUPS)
        assert r["calls"] == in_groups + 1, f"rank {rank}: {r['calls']} calls on qcomm's exchange"
        for members in GROUPS:
            for peer, (fwd, bwd) in r["pooled"][str(members)].items():
                where = f"rank {rank}, group {members}, peer {peer}"
                if peer // 2 == rank // 2:  # same host: no codec, exact
                    assert fwd == 0.0 and bwd <= 1e-6, f"{where}: {fwd}, {bwd}"
                else:  # other host: int8 forward, bf16 backward, each within its bound
                    assert 0 < fwd <= int8.rel_error_bound * MAGNITUDE, f"{where}: {fwd}"
                    assert 0 < bwd <= 2 * bf16.rel_error_bound * MAGNITUDE, f"{where}: {bwd}"
        # Decoded before the sum: the codec's bound per part, not 17 times it.
        bound = WORLD * fp8.rel_error_bound * MAGNITUDE
        assert r["reduce_scatter"] <= bound, f"rank {rank}: {r['reduce_scatter']} > {bound}"


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


def test_uninstall_holds_in_any_order() -> None:
    out = _script(
        """
        import pickle, sys
        import qcomm
        from qcomm import torchrec_exchange as tx
        registry = qcomm.build_registry(forward="int8", backward="bf16",
                                        allow_unsummable_reduce_scatter=True)
        assert "torchrec" not in sys.modules
        tx.uninstall()  # before TorchRec is imported
        from torchrec.distributed import dist_data
        assert not tx.installed(), "TorchRec's import installed it"
        assert not hasattr(dist_data.alltoall_pooled, "__wrapped__")
        # Nothing after it installs: a new registry, an unpickled one, a pair.
        qcomm.build_registry(forward="fp16")
        pickle.loads(pickle.dumps(registry))
        qcomm.QuantizedCommCodecs()
        assert not tx.installed(), "a pair installed it after uninstall()"
        tx.install()  # the explicit step lifts it
        assert tx.installed() and hasattr(dist_data.alltoall_pooled, "__wrapped__")
        tx.uninstall()  # after TorchRec is imported
        assert not tx.installed() and not hasattr(dist_data.alltoall_pooled, "__wrapped__")
        qcomm.build_registry(forward="fp16")
        assert not tx.installed()
        print("ok")
        """
    )
    assert out == "ok"


def test_an_unpickled_registry_installs_on_torchrecs_import() -> None:
    # What a spawned rank does: unpickle first, import TorchRec later.
    registry = _registry()
    out = _script(
        f"""
        import pickle, sys
        registry = pickle.loads({pickle.dumps(registry)!r})  # brings the door with it
        assert "qcomm.torchrec_exchange" in sys.modules and "qcomm.registry" not in sys.modules
        from qcomm import torchrec_exchange as tx
        assert "torchrec" not in sys.modules and not tx.installed()
        from torchrec.distributed import dist_data
        print(tx.installed(), hasattr(dist_data.alltoall_pooled, "__wrapped__"))
        """
    )
    assert out == "True True"


def _on_torchrecs_transport(rank: int, world_size: int) -> dict[str, str]:
    # Installed, and the setting chooses TorchRec's transport at the first
    # call: the registry's reduce-scatter pair goes there, which sums wires as
    # they are.
    from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter

    qcomm.build_registry(forward="fp16")  # installs
    out = {}
    with qcomm.config.configured(torchrec_collectives="torchrec"):
        for spec in ("fp8_e4m3_tensor/fp16", "fp16/int8", "fp16/fp16"):
            registry = qcomm.build_registry(
                {"pooled_embeddings_reduce_scatter": spec}, allow_unsummable_reduce_scatter=True
            )
            rs = PooledEmbeddingsReduceScatter(
                dist.group.WORLD, codecs=registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
            )
            try:
                rs(_data(rank, world_size * BATCH, DIM)).wait()
                out[spec] = "ok"
            except qcomm.CodecError as err:
                out[spec] = str(err)
    out["installed"] = str(torchrec_exchange.installed())
    out["calls"] = str(sum(counted("torchrec_call").values()))
    return out


def test_an_unsummable_pair_on_torchrecs_transport_is_refused_on_every_rank() -> None:
    # build_registry let the pair through for qcomm's exchange; a call that
    # goes to TorchRec's transport after all raises instead of summing wires.
    for r in run_ranks(_on_torchrecs_transport, 2, timeout=180.0):
        assert r["installed"] == "True" and r["calls"] == "0", r
        assert r["fp16/fp16"] == "ok", r
        for spec, problem in (
            ("fp8_e4m3_tensor/fp16", "forward codec 'fp8_e4m3_tensor' is not summable"),
            ("fp16/int8", "backward codec 'int8' changes the size"),
        ):
            assert problem in r[spec], r
            assert "the setting torchrec_collectives is 'torchrec'" in r[spec], r
