"""Adaptive codecs (``adaptive:fp16|bf16``) through qcomm's other doors, on
gloo ranks and both transports: the DDP hook (with and without error
feedback), the all-gather and the backward passes of the all-to-alls,
``torch.compile`` (aot_eager), FSDP2's gradients, TorchRec's door on qcomm's
exchange (3 ranks, one spawn per transport), and codecs by host (4 ranks as
hosts of two, and of three and one; one spawn per transport).

Where one rank's data (or one host's) drops below fp16's range at call K,
every rank records the same calls: fp16 over budget at call K, bf16 from
call K + 1. Each door is shown reached by its own count (its records, its
events). Where an adaptive codec cannot run (FSDP2's weights and error
feedback; TorchRec's own transport, eager and compiled) it is refused, on
every rank, before anything is sent.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted, counting
from ddp_bucket import Bucket
from dist_utils import TRANSPORTS, run_ranks, transport_env, wrong_transport

import qcomm
from qcomm import torchrec_exchange

pytest.importorskip("torchrec")

WORLD = 3
BUDGET = 0.01
SPEC = f"adaptive:fp16|bf16,max_error={BUDGET},window=2"
TINY = 1e-9  # below fp16's smallest subnormal: fp16 makes it zero
CALLS = 6
DROP = 3  # the call from which one rank's data is TINY
# bf16 until fp16 is measured within budget twice; fp16 until the drop; bf16 after.
SWITCHED = ["bf16", "bf16"] + ["fp16"] * (DROP - 2) + ["fp16"] + ["bf16"] * (CALLS - DROP - 1)


def _data(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def _key(record: Any) -> tuple[Any, ...]:
    return (record.collective, record.number, record.codec, record.errors, record.switched_to)


def _history(source: Any) -> list[Any]:
    return [_key(r) for r in qcomm.error_history(source)]


def _opened(fn: Any, *args: Any) -> tuple[Any, dict[str, int]]:
    """``fn(*args)`` and the transports it opened."""
    with counting("transport_opened") as opened:
        out = fn(*args)
    return out, dict(opened)


# -- the DDP hook ----------------------------------------------------------------


def _ddp(rank: int) -> dict[bool, Any]:
    """Rank 1's gradients drop below fp16's range at step 4, with and without feedback."""
    out: dict[bool, Any] = {}
    for feedback in (False, True):
        state, hook = qcomm.ddp_comm_hook(SPEC, error_feedback=feedback)
        averaged = []
        for step in range(8):
            scale = TINY if rank == 1 and step >= 4 else 1.0
            buffer = _data(10 * rank + step, 1000, scale=scale)
            averaged.append(hook(state, Bucket(buffer)).wait().clone())
        out[feedback] = {"records": _history(state), "averaged": torch.stack(averaged)}
    return out


# -- the all-gather and the backward passes ----------------------------------------


def _passes(rank: int, world: int) -> dict[str, Any]:
    """Every pass of the all-gather and the all-to-alls; rank 2's gradients drop at DROP."""
    pairs = {
        name: qcomm.QuantizedCommCodecs(qcomm.load_codec(SPEC), qcomm.load_codec(SPEC))
        for name in ("gather", "pooled", "sequence")
    }
    splits = [4] * world
    for call in range(CALLS):
        scale = TINY if rank == 2 and call >= DROP else 1.0
        x = _data(100 * rank + call, 4, 8).requires_grad_()
        y = qcomm.all_gather_pooled(x, codecs=pairs["gather"]).wait()
        y.backward(_data(200 * rank + call, *y.shape, scale=scale))
        x = _data(300 * rank + call, 4 * world, 8).requires_grad_()
        y = qcomm.all_to_all_pooled(x, splits, [8] * world, codecs=pairs["pooled"]).wait()
        y.backward(_data(400 * rank + call, *y.shape, scale=scale))
        x = _data(500 * rank + call, 4 * world, 8).requires_grad_()
        y = qcomm.all_to_all_sequence(
            x, input_splits=splits, output_splits=splits, codecs=pairs["sequence"]
        ).wait()
        y.backward(_data(600 * rank + call, *y.shape, scale=scale))
    return {name: _history(pair) for name, pair in pairs.items()}


# -- torch.compile ------------------------------------------------------------------


def _compiled(rank: int, world: int) -> dict[str, Any]:
    """The same calls compiled (aot_eager) and eager; rank 1's data drops at DROP."""
    torch._dynamo.reset()
    compiled_codec, eager_codec = qcomm.load_codec(SPEC), qcomm.load_codec(SPEC)

    def pooled(x: torch.Tensor, pair: Any) -> torch.Tensor:
        return qcomm.all_to_all_pooled(x, [4] * world, [8] * world, codecs=pair).wait()

    compiled = torch.compile(pooled, backend="aot_eager", fullgraph=True)
    pairs = [qcomm.QuantizedCommCodecs(forward=c) for c in (compiled_codec, eager_codec)]
    before = Counter(counted("compiled_call"))
    for call in range(CALLS):
        x = _data(700 * rank + call, 4 * world, 8, scale=TINY if rank == 1 and call >= DROP else 1)
        compiled(x, pairs[0])
        pooled(x, pairs[1])
    return {
        "compiled": [r.codec for r in qcomm.error_history(compiled_codec)],
        "eager": [r.codec for r in qcomm.error_history(eager_codec)],
        "records": _history(compiled_codec),
        "operators": dict(Counter(counted("compiled_call")) - before),
    }


# -- FSDP2 ---------------------------------------------------------------------------


def _fsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
        mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), "cpu")
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net

    out: dict[str, Any] = {}
    for name, kwargs in (
        ("weights", {"weights": SPEC}),
        ("feedback", {"gradients": SPEC, "error_feedback": True}),
    ):
        try:
            qcomm.fsdp_quantize(model(), **kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    net = model()
    state = qcomm.fsdp_quantize(net, gradients=SPEC)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with counting("fsdp_call") as calls:
        for step in range(3):
            x = _data(800 * rank + step, 8, 12)
            torch.nn.functional.mse_loss(net(x), torch.sin(x[:, :5])).backward()
            opt.step()
            opt.zero_grad()
    out["records"] = _history(state)
    out["calls"] = dict(calls)
    return out


# -- TorchRec's door -------------------------------------------------------------------


def _torchrec(rank: int, world: int) -> dict[str, Any]:
    from torchrec.distributed import comm_ops
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll
    from torchrec_utils import dlrm_batches, small_dlrm

    out: dict[str, Any] = {}
    registry = qcomm.build_registry(forward=SPEC, backward=SPEC)
    model, opt = small_dlrm(rank, world, registry, dim=8, rows=50, dense=4)
    with counting("torchrec_call") as calls:
        for batch in dlrm_batches(rank, 3, batch=16, rows=50, dense=4):
            loss, _ = model(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    out["calls"] = dict(calls)
    out["collectives"] = sorted({r.collective for r in qcomm.error_history(registry)})
    out["records"] = len(qcomm.error_history(registry))

    a2a = PooledEmbeddingsAllToAll(
        dist.group.WORLD, [8] * world, codecs=registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    )

    def call(x: torch.Tensor) -> torch.Tensor:
        return a2a(x).wait()

    sent = Counter[str]()
    own = dist.all_to_all_single

    def counted_a2a(*args: Any, **kwargs: Any) -> Any:
        sent["all_to_all_single"] += 1
        return own(*args, **kwargs)

    def refused(fn: Any) -> str | None:
        try:
            fn(_data(rank, 4 * world, 8))
        except Exception as err:  # noqa: BLE001 - the test reads what it is
            return f"{type(err).__name__}: {err}"
        return None

    dist.all_to_all_single = counted_a2a  # what TorchRec's own transport sends with
    try:
        with counting("torchrec_call") as taken:
            # TorchRec's way to swap its transport: its own, here.
            out["custom"] = refused(
                lambda x: comm_ops.alltoall_pooled(
                    x,
                    [4] * world,
                    [8] * world,
                    codecs=registry["POOLED_EMBEDDINGS_ALL_TO_ALL"],
                    all_to_all_single_comm=comm_ops.DefaultAll2AllSingle(),
                ).wait()
            )
            torchrec_exchange.uninstall()
            out["uninstalled"] = refused(call)
            torchrec_exchange.install()  # the setting is read again at the next call
            with qcomm.config.configured(torchrec_collectives="torchrec"):
                out["setting"] = refused(call)
                for fullgraph in (False, True):
                    torch._dynamo.reset()
                    compiled = torch.compile(call, backend="aot_eager", fullgraph=fullgraph)
                    out[f"compiled fullgraph={fullgraph}"] = refused(compiled)
    finally:
        dist.all_to_all_single = own
        torchrec_exchange.uninstall()
        torchrec_exchange.install()
    out["sent"] = dict(sent)
    out["taken"] = dict(taken)
    # Nothing was sent: the ranks are in step, and the next call runs.
    out["after"] = tuple(call(_data(rank, 4 * world, 8)).shape)
    return out


def _three_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    out["ddp"], out["ddp opened"] = _opened(_ddp, rank)
    out["passes"], out["passes opened"] = _opened(_passes, rank, world)
    out["compiled"], out["compiled opened"] = _opened(_compiled, rank, world)
    out["fsdp"], out["fsdp opened"] = _opened(_fsdp, rank)
    out["torchrec"], out["torchrec opened"] = _opened(_torchrec, rank, world)
    return out


@functools.cache
def _results(transport: str) -> list[dict[str, Any]]:
    return run_ranks(_three_ranks, WORLD, env=transport_env(transport), timeout=300.0)


@pytest.fixture(params=TRANSPORTS)
def results(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _results(request.param)


def _opened_right(transport: str, found: list[dict[str, Any]], case: str) -> None:
    problem = wrong_transport([r[f"{case} opened"] for r in found], transport)
    assert problem is None, f"{case}: {problem}"


def _same_on_every_rank(found: list[Any], what: str) -> None:
    for rank, value in enumerate(found):
        assert value == found[0], f"{what}: rank {rank} differs from rank 0"


def test_the_ddp_hook_switches_to_bf16_the_step_after_gradients_underflow(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, found = results
    _opened_right(transport, found, "ddp")
    for feedback in (False, True):
        records = found[0]["ddp"][feedback]["records"]
        _same_on_every_rank([r["ddp"][feedback]["records"] for r in found], f"{feedback=}")
        scatter = [r for r in records if r[0] == "all_reduce reduce-scatter"]
        gather = [r for r in records if r[0] == "all_reduce all-gather"]
        assert len(scatter) == len(gather) == 8, records  # both steps of 8 calls, counted
        # Without feedback, fp16 is over budget at step 4, where rank 1's
        # gradients drop. With it, what is measured is what is sent: the
        # gradient plus the residual carried, which step 4 still holds in
        # fp16's range; the next step's is not.
        over = 5 if feedback else 4
        codecs = [r[2] for r in scatter]
        assert codecs == ["bf16", "bf16"] + ["fp16"] * (over - 1) + ["bf16"] * (7 - over), (
            feedback,
            codecs,
        )
        assert scatter[over][4] == "bf16" and scatter[over][3][1] > BUDGET, scatter[over]
        assert all(e <= BUDGET for r in scatter[over + 1 :] for e in r[3]), scatter
        # The all-gather sends the average, in fp16's range throughout.
        assert [r[2] for r in gather] == ["bf16", "bf16"] + ["fp16"] * 6, gather
        averaged = [r["ddp"][feedback]["averaged"] for r in found]
        assert all(torch.equal(a, averaged[0]) for a in averaged), "replicas differ"


def test_the_all_gather_and_the_backward_passes_adapt_under_their_own_names(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, found = results
    _opened_right(transport, found, "passes")
    names = {
        "gather": "all_gather_pooled",
        "pooled": "all_to_all_pooled",
        "sequence": "all_to_all_sequence",
    }
    for key, collective in names.items():
        records = found[0]["passes"][key]
        _same_on_every_rank([r["passes"][key] for r in found], collective)
        forward = [r for r in records if r[0] == f"{collective} forward"]
        backward = [r for r in records if r[0] == f"{collective} backward"]
        assert len(forward) == len(backward) == CALLS, records
        assert [r[2] for r in forward] == ["bf16", "bf16"] + ["fp16"] * (CALLS - 2), forward
        assert [r[2] for r in backward] == SWITCHED, backward
        assert backward[DROP][3][2] > BUDGET and backward[DROP][4] == "bf16", backward[DROP]


def test_a_compiled_collective_switches_as_the_eager_one(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, found = results
    _opened_right(transport, found, "compiled")
    _same_on_every_rank([r["compiled"]["records"] for r in found], "compiled")
    for rank, r in enumerate(found):
        compiled = r["compiled"]
        assert compiled["compiled"] == compiled["eager"] == SWITCHED, (rank, compiled)
        ops = compiled["operators"]
        assert ops.get("all_to_all_pooled_start") == CALLS, (rank, ops)


def test_fsdp_adapts_its_gradients_and_refuses_adaptive_weights_and_feedback(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, found = results
    _opened_right(transport, found, "fsdp")
    _same_on_every_rank([r["fsdp"]["records"] for r in found], "fsdp")
    for rank, r in enumerate(found):
        fsdp = r["fsdp"]
        assert fsdp["calls"].get("reduce_scatter", 0) > 0, (rank, fsdp["calls"])
        assert len(fsdp["records"]) == fsdp["calls"]["reduce_scatter"], (rank, fsdp)
        assert {x[0] for x in fsdp["records"]} == {"reduce_scatter_pooled forward"}
        assert [x[2] for x in fsdp["records"][:3]] == ["bf16", "bf16", "fp16"], fsdp["records"]
        assert fsdp["weights"].startswith("weights: an adaptive or budgeted codec"), fsdp
        assert fsdp["feedback"].startswith("error_feedback: an adaptive or budgeted"), fsdp


def test_torchrec_trains_on_qcomms_exchange_with_an_adaptive_registry(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, found = results
    _opened_right(transport, found, "torchrec")
    for rank, r in enumerate(found):
        tr = r["torchrec"]
        assert tr["calls"] == {"alltoall_pooled": 3, "reduce_scatter_base_pooled": 3}, (rank, tr)
        assert tr["collectives"] == [
            "all_to_all_pooled backward",
            "all_to_all_pooled forward",
            "reduce_scatter_pooled backward",
            "reduce_scatter_pooled forward",
        ], (rank, tr)
        assert tr["records"] == 12, (rank, tr)


def test_torchrecs_own_transport_refuses_an_adaptive_pair_before_sending(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    _, found = results
    for rank, r in enumerate(found):
        tr = r["torchrec"]
        # The codec itself refuses where qcomm is uninstalled (its first call).
        assert tr["uninstalled"].startswith("CodecError: an adaptive or budgeted codec"), tr
        said = tr["setting"]
        assert said.startswith(
            "CodecError: comm_ops.alltoall_pooled: this call runs on TorchRec's own transport "
            "(the setting torchrec_collectives is 'torchrec' (qcomm.config.torchrec_collectives))"
        ), said
        assert "forward codec (fp16|bf16, max_error=0.01)" in said, said
        assert "backward codec (fp16|bf16, max_error=0.01)" in said, said
        assert tr["compiled fullgraph=False"] == said, (rank, tr)
        assert tr["custom"].startswith(
            "CodecError: comm_ops.alltoall_pooled: this call runs on TorchRec's own transport "
            "(the call passes its own all_to_all_single_comm)"
        ), tr["custom"]
        # With fullgraph, dynamo raises its own error, naming this one.
        assert "torchrec_collectives is 'torchrec'" in tr["compiled fullgraph=True"], tr
        assert tr["sent"] == {}, (rank, tr["sent"])  # nothing sent by TorchRec
        assert tr["taken"] == {}, (rank, tr["taken"])  # nor on qcomm's exchange
        assert tr["after"] == (4, 8 * WORLD), (rank, tr)


# -- codecs by host (4 ranks) ------------------------------------------------------------


def _by_host(rank: int, world: int) -> dict[str, Any]:
    """Hosts of two (ranks_per_host=2), and of three and one (rank 3 alone)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with counting("transport_opened") as opened:
        for per_host in (2, 3):
            other = qcomm.QuantizedCommCodecs(qcomm.load_codec(SPEC), qcomm.load_codec(SPEC))
            codecs = qcomm.HostCodecs(other_host=other, ranks_per_host=per_host)
            for call in range(CALLS):
                scale = TINY if rank == 3 and call >= DROP else 1.0
                x = _data(100 * rank + call, 4 * world, 8, scale=scale)
                qcomm.all_to_all_pooled(x, [4] * world, [8] * world, codecs=codecs).wait()
            out[f"pooled {per_host}"] = _history(codecs)
            # The hook: its whole host drops (ranks 2 and 3, or rank 3 alone):
            # what crosses between hosts is then below fp16's range.
            state, hook = qcomm.ddp_comm_hook(
                qcomm.HostCodecs(
                    other_host=qcomm.QuantizedCommCodecs(
                        qcomm.load_codec(SPEC), qcomm.load_codec(SPEC)
                    ),
                    ranks_per_host=per_host,
                )
            )
            for step in range(CALLS):
                host = rank // per_host
                scale = TINY if host == 1 and step >= DROP else 1.0
                hook(state, Bucket(_data(10 * rank + step, 1000, scale=scale))).wait()
            out[f"ddp {per_host}"] = _history(state)
    out["opened"] = dict(opened)
    return out


@functools.cache
def _hosts(transport: str) -> list[dict[str, Any]]:
    return run_ranks(_by_host, 4, env=transport_env(transport), timeout=180.0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_adaptive_other_host_codec_is_chosen_alike_on_every_rank(transport: str) -> None:
    found = _hosts(transport)
    assert wrong_transport([r["opened"] for r in found], transport) is None
    for per_host in (2, 3):
        key = f"pooled {per_host}"
        _same_on_every_rank([r[key] for r in found], key)
        forward = [r for r in found[0][key] if r[0] == "all_to_all_pooled forward"]
        assert [r[2] for r in forward] == SWITCHED, (per_host, forward)
        assert forward[DROP][3][3] > BUDGET and forward[DROP][4] == "bf16", forward[DROP]
        assert all(e <= BUDGET for e in forward[DROP][3][:3]), forward[DROP]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_ddp_hook_by_host_adapts_between_hosts_alike_on_every_rank(transport: str) -> None:
    found = _hosts(transport)
    # Hosts of two: a hierarchical all-reduce, the codec between hosts only;
    # hosts of three and one: flat, the other host's codec for every peer.
    for per_host, step in (
        (2, "all_reduce reduce-scatter between hosts"),
        (3, "all_reduce reduce-scatter"),
    ):
        key = f"ddp {per_host}"
        _same_on_every_rank([r[key] for r in found], key)
        scatter = [r for r in found[0][key] if r[0] == step]
        assert [r[2] for r in scatter] == SWITCHED, (per_host, found[0][key])
        over = scatter[DROP][3]
        assert not math.isnan(over[3]) and over[3] > BUDGET, (per_host, over)
