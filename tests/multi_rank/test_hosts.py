"""Codecs by host (qcomm.HostCodecs): each pair of ranks uses the codec of its
class of peer, both ways, in every collective and the hierarchical all-reduce.

Four ranks as two hosts of two (ranks 0, 1 and 2, 3), one spawn per
transport: the data between ranks of one host must come through bit for bit
(no codec touched it), the data between hosts exactly as the other-host
codec alone makes it, forward and backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import TRANSPORTS, run_ranks, transport_env

import qcomm
from qcomm import HostCodecs, QuantizedCommCodecs, config, load_codec
from qcomm.collectives import _call, _hosts
from qcomm.collectives.all_reduce import Residuals, all_reduce, granule, layout
from qcomm.registry import load_pair
from qcomm.specs import parse_host_spec
from qcomm.types import CodecError

WORLD = 4
PER_HOST = 2


def _same_host(a: int, b: int) -> bool:
    return a // PER_HOST == b // PER_HOST


def _data(rank: int, *shape: int) -> torch.Tensor:
    # Every rank can make every rank's data: values with full float32
    # mantissas, which no 16-bit or 8-bit codec keeps.
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(*shape, generator=g) * 3.0 + 0.1


def _pair(forward: str, backward: str) -> QuantizedCommCodecs:
    return QuantizedCommCodecs(load_codec(forward), load_codec(backward))


def _policy(forward: str = "int8", backward: str = "bf16", **kw: Any) -> HostCodecs:
    return HostCodecs(other_host=_pair(forward, backward), **kw)


def _run(fn: Any, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the input's gradient of ``fn(x)`` (an Awaitable)."""
    x = x.clone().requires_grad_()
    out = fn(x).wait()
    out.backward(grad)
    assert x.grad is not None
    return out.detach().clone(), x.grad.clone()


def _pooled(rank: int, policy: HostCodecs) -> dict[str, int]:
    """Output columns and gradient rows: from one's host as noop, else as the other codec."""
    batches, dims = [3, 2, 4, 1], [33, 8, 40, 17]
    rows = [sum(batches[:r]) for r in range(WORLD + 1)]
    cols = [sum(dims[:r]) for r in range(WORLD + 1)]
    x = _data(rank, rows[-1], dims[rank])
    grad = _data(100 + rank, batches[rank], cols[-1])

    def call(codecs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _run(lambda t: qcomm.all_to_all_pooled(t, batches, dims, codecs=codecs), x, grad)

    exact, by_host = call(None), call(policy)
    coded = call(policy.other_host)
    compared = 0
    for s in range(WORLD):
        band = slice(cols[s], cols[s + 1])
        block = slice(rows[s], rows[s + 1])
        want = exact if _same_host(rank, s) else coded
        assert torch.equal(by_host[0][:, band], want[0][:, band]), f"columns of rank {s}"
        assert torch.equal(by_host[1][block], want[1][block]), f"gradient rows of rank {s}"
        if not _same_host(rank, s):
            # The codec changed these: the comparison above can fail.
            assert not torch.equal(coded[0][:, band], exact[0][:, band])
            assert not torch.equal(coded[1][block], exact[1][block])
        compared += 1
    # What a rank sends itself, and its host's data, is its own to the bit.
    mine = _data(rank, rows[-1], dims[rank])
    assert torch.equal(
        by_host[0][:, cols[rank] : cols[rank + 1]], mine[rows[rank] : rows[rank + 1]]
    )
    return {"pooled": compared}


def _sequence(rank: int, policy: HostCodecs) -> dict[str, int]:
    sends = [[2, 3, 1, 4], [1, 1, 2, 2], [3, 0, 2, 1], [2, 2, 2, 2]]
    splits = sends[rank]
    recvs = [sends[s][rank] for s in range(WORLD)]
    x = _data(rank, sum(splits), 12)
    grad = _data(200 + rank, sum(recvs), 12)

    def call(codecs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _run(
            lambda t: qcomm.all_to_all_sequence(
                t, input_splits=splits, output_splits=recvs, codecs=codecs
            ),
            x,
            grad,
        )

    exact, by_host, coded = call(None), call(policy), call(policy.other_host)
    out_at = [sum(recvs[:s]) for s in range(WORLD + 1)]
    in_at = [sum(splits[:s]) for s in range(WORLD + 1)]
    for s in range(WORLD):
        want = exact if _same_host(rank, s) else coded
        got_rows, back_rows = slice(out_at[s], out_at[s + 1]), slice(in_at[s], in_at[s + 1])
        assert torch.equal(by_host[0][got_rows], want[0][got_rows]), f"rows from rank {s}"
        assert torch.equal(by_host[1][back_rows], want[1][back_rows]), f"gradient to rank {s}"
    return {"sequence": WORLD}


def _reduce_scatter(rank: int) -> dict[str, int]:
    """The sum adds the host's blocks as they are and the others' as fp16 makes them."""
    policy = HostCodecs(other_host=_pair("fp16", "bf16"), ranks_per_host=PER_HOST)
    rows = 3
    x = _data(rank, rows * WORLD, 5)
    grad = _data(300 + rank, rows, 5)
    out, grad_input = _run(lambda t: qcomm.reduce_scatter_pooled(t, codecs=policy), x, grad)
    # The exchange adds the blocks in rank order, the own one in its place.
    parts = []
    for s in range(WORLD):
        block = _data(s, rows * WORLD, 5)[rank * rows : (rank + 1) * rows]
        parts.append(block if _same_host(rank, s) else block.half().float())
    want = parts[0].clone()
    for part in parts[1:]:
        want += part
    assert torch.equal(out, want), "the sum is not the host's exact blocks plus fp16's others"
    # Backward: every rank's gradient block, from the host as it is, else as bf16 makes it.
    for s in range(WORLD):
        block = _data(300 + s, rows, 5)
        expected = block if _same_host(rank, s) else block.bfloat16().float()
        assert torch.equal(grad_input[s * rows : (s + 1) * rows], expected), f"gradient of {s}"
    # The gather, alike: fp16 between hosts forward, bf16 backward.
    mine = _data(400 + rank, 2, 6)
    gathered = qcomm.collectives.all_gather_pooled(mine, codecs=policy).wait()
    for s in range(WORLD):
        block = _data(400 + s, 2, 6)
        expected = block if _same_host(rank, s) else block.half().float()
        assert torch.equal(gathered[2 * s : 2 * s + 2], expected), f"gathered block of {s}"
    return {"reduce_scatter": 1}


def _exchanges_of(fn: Any) -> tuple[list[str], Any]:
    """The names of the exchanges ``fn`` ran, and its result."""
    names: list[str] = []
    real = _call.Call.next_exchange

    def counting(self: _call.Call, name: str) -> None:
        names.append(name)
        real(self, name)

    _call.Call.next_exchange = counting  # type: ignore[method-assign]
    try:
        return names, fn()
    finally:
        _call.Call.next_exchange = real  # type: ignore[method-assign]


def _all_reduce(rank: int) -> dict[str, Any]:
    """Hierarchical: four exchanges, every rank the same values, near the exact mean."""
    n = 10_000
    exact = torch.stack([_data(500 + r, n) for r in range(WORLD)]).sum(0) / WORLD
    noop_policy = HostCodecs(ranks_per_host=PER_HOST)
    names, plain = _exchanges_of(
        lambda: all_reduce(_data(500 + rank, n), by_host=noop_policy, average=True)
    )
    assert names == [
        "all_reduce reduce-scatter in host",
        "all_reduce reduce-scatter between hosts",
        "all_reduce all-gather between hosts",
        "all_reduce all-gather in host",
    ], names
    torch.testing.assert_close(plain, exact, rtol=1e-6, atol=1e-6)
    flat_names, _ = _exchanges_of(lambda: all_reduce(_data(500 + rank, n), average=True))
    assert flat_names == ["all_reduce reduce-scatter", "all_reduce all-gather"], flat_names
    policy = HostCodecs(other_host=_pair("int8", "int8"), ranks_per_host=PER_HOST)
    residuals = Residuals()
    results = []
    for _ in range(2):
        results.append(
            all_reduce(_data(500 + rank, n), by_host=policy, average=True, residuals=residuals)
        )
    # The residuals keep the flat all-reduce's shapes (the DDP hook's state relies on it).
    bounds = layout(n, WORLD, granule(policy.other_host.forward))
    assert residuals.scatter is not None and residuals.scatter.numel() == n
    assert residuals.gather is not None
    assert residuals.gather.numel() == bounds[rank + 1] - bounds[rank]
    # Between hosts only: what this rank sends inside its host carries no
    # residual, what it sends the other host does.
    for r in range(WORLD):
        sent = residuals.scatter[bounds[r] : bounds[r + 1]]
        if r != rank:
            assert bool(sent.any()) == (r % PER_HOST == rank % PER_HOST and r != rank), r
    error = (results[0] - exact).abs().max().item()
    assert 0 < error < 0.05 * exact.abs().max().item(), error
    # Hosts of unequal sizes (3 and 1), or of one rank each: flat, with the
    # other hosts' codecs for every peer (one codec in the all-gather keeps
    # the ranks' values alike).
    flat_results = {}
    for per_host in (3, 1):
        uneven = HostCodecs(other_host=_pair("int8", "int8"), ranks_per_host=per_host)
        flat_names, flat_results[per_host] = _exchanges_of(
            lambda policy=uneven: all_reduce(_data(500 + rank, n), by_host=policy, average=True)
        )
        assert flat_names == ["all_reduce reduce-scatter", "all_reduce all-gather"], flat_names
    uniform = all_reduce(
        _data(500 + rank, n),
        reduce_codec=load_codec("int8"),
        gather_codec=load_codec("int8"),
        average=True,
    )
    assert torch.equal(flat_results[3], uniform) and torch.equal(flat_results[1], uniform)
    # A bf16 buffer sums in float32 between the steps.
    half = all_reduce(_data(500 + rank, n).bfloat16(), by_host=noop_policy, average=True)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), exact, rtol=2e-2, atol=2e-2)
    return {"all_reduce": results[0], "all_reduce_second": results[1], "uneven": flat_results[3]}


def _ddp_hook(rank: int) -> dict[str, Any]:
    """The DDP hook with a host spec runs the hierarchical all-reduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state, hook = qcomm.ddp_comm_hook(
        f"same_host=noop+other_host=int8+ranks_per_host={PER_HOST}", error_feedback=True
    )
    ddp.register_comm_hook(state, hook)
    names, _ = _exchanges_of(lambda: ddp(_data(600 + rank, 8, 16)).sum().backward())
    assert "all_reduce all-gather in host" in names, names
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return {"ddp_grad": torch.cat([g.view(-1) for g in grads if g is not None])}


def _disagreements(rank: int) -> dict[str, int]:
    """Ranks that differ on the policy raise on every rank, naming it."""
    caught = 0
    cases = [
        # Another codec between hosts on rank 3.
        _policy("int8" if rank != 3 else "fp16", ranks_per_host=PER_HOST),
        # Other hosts on rank 0.
        _policy(ranks_per_host=PER_HOST if rank != 0 else 1),
    ]
    for policy in cases:
        group = dist.new_group(list(range(WORLD)))  # its first call is checked
        x = _data(rank, 8, 8)
        try:
            qcomm.all_to_all_pooled(x, [2] * WORLD, [8] * WORLD, group=group, codecs=policy)
        except CodecError as err:
            assert "codecs.forward" in str(err) and "host" in str(err), str(err)
            caught += 1
    # The DDP hook's all-reduce too.
    group = dist.new_group(list(range(WORLD)))
    try:
        all_reduce(_data(rank, 64), group=group, by_host=cases[1])
    except CodecError as err:
        assert "reduce_codec" in str(err), str(err)
        caught += 1
    assert caught == 3, caught
    return {"disagreements": caught}


def _host_names(rank: int) -> dict[str, int]:
    """Without ranks per host, the ranks learn host names: here one host, so no codec."""
    group = dist.new_group(list(range(WORLD)))
    policy = _policy()
    x = _data(rank, 8, 8)
    out = qcomm.all_to_all_pooled(x, [2] * WORLD, [8] * WORLD, group=group, codecs=policy).wait()
    exact = qcomm.all_to_all_pooled(x, [2] * WORLD, [8] * WORLD, group=group).wait()
    assert torch.equal(out, exact)
    assert _hosts._by_name[group] == (0,) * WORLD
    # The setting ranks_per_host, read on each call, makes two hosts of the same group.
    with config.configured(ranks_per_host=PER_HOST):
        split = qcomm.all_to_all_pooled(x, [2] * WORLD, [8] * WORLD, group=group, codecs=policy)
        assert not torch.equal(split.wait(), exact)
    return {"host_names": 1}


def by_host_checks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    out.update(_pooled(rank, _policy(ranks_per_host=PER_HOST)))
    out.update(_sequence(rank, _policy(ranks_per_host=PER_HOST)))
    out.update(_reduce_scatter(rank))
    out.update(_all_reduce(rank))
    out.update(_ddp_hook(rank))
    out.update(_disagreements(rank))
    out.update(_host_names(rank))
    out["opened"] = dict(counted("transport_opened"))
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_codecs_by_host_on_two_hosts_of_two(transport: str) -> None:
    results = run_ranks(by_host_checks, WORLD, env=transport_env(transport), timeout=300)
    for r in results:
        assert r["pooled"] == WORLD and r["sequence"] == WORLD and r["reduce_scatter"] == 1
        assert r["disagreements"] == 3 and r["host_names"] == 1
        # Every call took the forced transport.
        wanted = {"point_to_point": "PointToPoint", "all_to_all": "OneAllToAll"}[transport]
        assert set(r["opened"]) == {wanted}, r["opened"]
    # Every rank holds the same all-reduced values, and the DDP gradients agree.
    for key in ("all_reduce", "all_reduce_second", "uneven", "ddp_grad"):
        first = results[0][key]
        for r in results[1:]:
            assert torch.equal(r[key], first), key


def test_host_specs_parse_and_load() -> None:
    assert parse_host_spec("same_host=noop+other_host=int8/bf16+ranks_per_host=2") == {
        "same_host": "noop",
        "other_host": "int8/bf16",
        "ranks_per_host": 2,
    }
    assert parse_host_spec("int8/bf16") is None
    for bad, words in [
        ("same_host=noop+elsewhere=int8", "elsewhere"),
        ("same_host=noop+same_host=int8", "twice"),
        ("other_host=", "no value"),
        ("other_host=int8+ranks_per_host=0", "positive"),
    ]:
        with pytest.raises(CodecError, match=words):
            parse_host_spec(bad)
    pair = load_pair({"other_host": "int8/bf16"}, "x")
    assert isinstance(pair, HostCodecs)
    assert pair.forward is pair.other_host.forward
    assert type(pair.same_host.forward).__name__ == "NoOpQuantizedCommCodec"
    with pytest.raises(CodecError, match=r"x\.other_host\.forward"):
        load_pair("same_host=noop+other_host=nosuchcodec", "x")
    registry = qcomm.build_registry(
        "pooled_embeddings_all_to_all=same_host=noop+other_host=int8:row_dim=64/fp16,"
        "sequence_embeddings_all_to_all=fp16"
    )
    policy = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(policy, HostCodecs) and policy.other_host.forward.row_dim == 64
    with pytest.raises(ValueError, match="ranks_per_host"):
        HostCodecs(ranks_per_host=0)
    with pytest.raises(TypeError, match="same_host"):
        HostCodecs(same_host="noop")  # type: ignore[arg-type]


def test_registry_from_qcomm_codecs_with_a_host_spec(
    monkeypatch: pytest.MonkeyPatch, torchrecs_transport: None
) -> None:
    monkeypatch.setenv("QCOMM_CODECS", "same_host=noop+other_host=fp16/bf16")
    registry = qcomm.build_registry()
    assert len(registry) == 3 and all(isinstance(v, HostCodecs) for v in registry.values())
    # TorchRec's own reduce-scatter (chosen here) sums wires with the other
    # hosts' codec: an unsummable one is refused there, and the fix keeps the
    # host spec.
    monkeypatch.setenv("QCOMM_CODECS", "same_host=noop+other_host=int8/bf16")
    with pytest.raises(CodecError) as caught:
        qcomm.build_registry()
    fix = "pooled_embeddings_reduce_scatter=same_host=noop+other_host=bf16"
    assert fix in str(caught.value)
    pasted = str(caught.value).split("QCOMM_CODECS='")[1].split("'")[0]
    monkeypatch.setenv("QCOMM_CODECS", pasted)
    rs = qcomm.build_registry()["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    assert isinstance(rs, HostCodecs) and type(rs.forward).__name__ == "BF16Codec"


def test_ranks_per_host_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QCOMM_RANKS_PER_HOST", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _hosts.ranks_per_host(None) == (None, "host names")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _hosts.ranks_per_host(None) == (8, "LOCAL_WORLD_SIZE")
    monkeypatch.setenv("QCOMM_RANKS_PER_HOST", "2")
    assert _hosts.ranks_per_host(None) == (2, "QCOMM_RANKS_PER_HOST")
    assert _hosts.ranks_per_host(4) == (4, "ranks_per_host")
    with config.configured(ranks_per_host=3):
        assert _hosts.ranks_per_host(None) == (3, "qcomm.config.ranks_per_host")
    monkeypatch.setenv("QCOMM_RANKS_PER_HOST", "two")
    with pytest.raises(ValueError, match="QCOMM_RANKS_PER_HOST"):
        _hosts.ranks_per_host(None)


def test_the_ddp_hook_takes_a_host_spec() -> None:
    import pickle

    spec = "same_host=noop+other_host=int8/fp16+ranks_per_host=2"
    state, _ = qcomm.ddp_comm_hook(spec, error_feedback=True)
    assert isinstance(state.by_host, HostCodecs) and state.by_host.ranks_per_host == 2
    assert repr(state) == f"DDPCommHookState(by_host={spec!r}, error_feedback=True)"
    restored = pickle.loads(pickle.dumps(state))
    assert restored.by_host is not None and restored.by_host.other_host.backward is not None
    assert repr(restored) == repr(state)
    with pytest.raises(ValueError, match="gather"):
        qcomm.ddp_comm_hook(spec, gather="fp16")
    with pytest.raises(CodecError, match=r"spec\.other_host"):
        qcomm.ddp_comm_hook("same_host=noop+other_host=nosuch")


def test_torchrec_drivers_take_a_host_policy_as_a_registry_entry() -> None:
    # TorchRec's own collectives (QCOMM_TORCHREC_COLLECTIVES=torchrec) read
    # forward and backward: the other hosts' pair.
    policy = load_pair("same_host=noop+other_host=fp16/bf16")
    assert isinstance(policy, QuantizedCommCodecs) and isinstance(policy, HostCodecs)
    assert policy.forward is policy.other_host.forward
    assert policy.backward is policy.other_host.backward
