"""Each call's error, measured and carried in its statuses, and the codecs that act
on it, on 3 gloo ranks and both transports (one spawn each, every case in it):

- ``adaptive:fp16|bf16`` switches to bf16 from the call after one rank's data
  drops below fp16's range, on every rank alike, and no later call is over
  budget;
- ``adaptive:mx4|int8`` moves to int8 once one rank's rows carry outliers;
- a guard raises (``on_exceed=raise``) or warns once, naming the collective,
  the rank and the error;
- ranks given different candidates, budgets or windows raise on their first
  call;
- a plain codec's calls are recorded with every rank's error where the
  setting ``measure_errors`` is on (off by default), ranks differing in it
  included;
- an adaptive registry built here and handed to the spawned ranks adapts
  there as a codec made in the rank does.

Every rank's record of every call is the same: each reads the others' errors
from their statuses.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import TRANSPORTS, run_ranks, transport_env

import qcomm
from qcomm import config

WORLD = 3
ROWS, DIM = 8, 64  # per rank and block: two int8/mx4 scale blocks per row


def _data(rank: int, call: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(ROWS * WORLD, DIM, generator=gen) * scale


def _outliers(x: torch.Tensor) -> torch.Tensor:
    """One value in 32 made 16 times larger: rows with heavy-tailed outliers."""
    x = x.clone()
    x[:, ::32] = 16 * x[:, ::32].sign() * x[:, ::32].abs().clamp(min=1.0)
    return x


def _pooled(x: torch.Tensor, codec: Any) -> torch.Tensor:
    pair = qcomm.QuantizedCommCodecs(forward=codec)
    return qcomm.all_to_all_pooled(x, [ROWS] * WORLD, [DIM] * WORLD, codecs=pair).wait()


def _used(records: list[Any]) -> list[tuple[str, float]]:
    return [(r.codec, r.worst) for r in records]


def _underflow(rank: int, codec: Any = None) -> dict[str, Any]:
    """Rank 1's data drops below fp16's range at call 5."""
    if codec is None:
        codec = qcomm.load_codec("adaptive:fp16|bf16,max_error=0.01,window=2")
    exact = []
    for call in range(10):
        x = _data(rank, call, 1e-9 if rank == 1 and call >= 5 else 1.0)
        out = _pooled(x, codec)
        # What every rank's codec made of its block: within bf16's rounding,
        # except fp16's call on the underflowing data (zeros).
        exact.append(bool(torch.allclose(out, _reordered(x, rank), rtol=1e-2, atol=0.0)))
    return {"records": qcomm.error_history(codec), "exact": exact}


def _reordered(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The pooled all-to-all's output computed in float32 from every rank's input."""
    inputs = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(inputs, x)
    return torch.cat([inputs[s][rank * ROWS : (rank + 1) * ROWS] for s in range(WORLD)], dim=1)


def _heavy_tails(rank: int) -> list[Any]:
    """Rank 2's rows get outliers at call 4: mx4 goes over its budget, int8 does not."""
    codec = qcomm.load_codec("adaptive:mx4|int8,max_error=0.14,window=2")
    pair = qcomm.QuantizedCommCodecs(forward=codec)
    for call in range(8):
        x = _data(rank, call)
        if rank == 2 and call >= 4:
            x = _outliers(x)
        qcomm.reduce_scatter_pooled(x, codecs=pair).wait()
    return qcomm.error_history(codec)


def _guard_raises(rank: int) -> dict[str, Any]:
    codec = qcomm.load_codec("int8:max_error=1e-4,on_exceed=raise")
    pair = qcomm.QuantizedCommCodecs(forward=codec)
    x = _data(rank, 0)
    splits = [ROWS] * WORLD
    try:
        qcomm.all_to_all_sequence(x, input_splits=splits, output_splits=splits, codecs=pair).wait()
        said = None
    except qcomm.CodecError as err:
        said = str(err)
    # The ranks are in step: the next call goes through (with a budget it meets).
    fine = qcomm.load_codec("bf16:max_error=0.1,on_exceed=raise")
    out = qcomm.all_to_all_sequence(
        x,
        input_splits=splits,
        output_splits=splits,
        codecs=qcomm.QuantizedCommCodecs(forward=fine),
    ).wait()
    return {"said": said, "worst": qcomm.error_history(codec)[0].worst, "rows": out.shape[0]}


def _guard_warns(rank: int) -> dict[str, Any]:
    codec = qcomm.load_codec("fp16:max_error=1e-6")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):
            _pooled(_data(rank, call), codec)
    said = [str(w.message) for w in caught if "max_error" in str(w.message)]
    return {"said": said, "calls": len(qcomm.error_history(codec))}


def _disagreement(rank: int) -> dict[str, str | None]:
    """Each on a group of its own, so that it is the group's first call."""
    cases = {
        "candidates": ("adaptive:mx4|int8", "adaptive:int8|mx4"),
        "budget": ("adaptive:mx4|int8,max_error=0.1", "adaptive:mx4|int8,max_error=0.2"),
        "window": ("adaptive:mx4|int8,window=2", "adaptive:mx4|int8,window=3"),
        "guard": ("int8:max_error=0.1", "int8:max_error=0.1,on_exceed=raise"),
    }
    out: dict[str, str | None] = {}
    for name, (mine, theirs) in cases.items():
        group = dist.new_group(list(range(WORLD)))
        codec = qcomm.load_codec(mine if rank != 1 else theirs)
        try:
            qcomm.all_to_all_pooled(
                _data(rank, 0),
                [ROWS] * WORLD,
                [DIM] * WORLD,
                group=group,
                codecs=qcomm.QuantizedCommCodecs(forward=codec),
            ).wait()
            out[name] = None
        except qcomm.CodecError as err:
            out[name] = str(err)
    return out


def _plain(rank: int) -> dict[str, Any]:
    pair = qcomm.QuantizedCommCodecs(forward=qcomm.load_codec("int8"))
    qcomm.reduce_scatter_pooled(_data(rank, 0), codecs=pair).wait()  # not measured
    before = qcomm.error_history(pair)
    # Ranks may differ in the setting: rank 2 measures, the others do not.
    with config.configured(measure_errors=True):
        qcomm.reduce_scatter_pooled(_data(rank, 1), codecs=pair).wait()
    with config.configured(measure_errors=rank == 2):
        qcomm.reduce_scatter_pooled(_data(rank, 2), codecs=pair).wait()
    return {"before": before, "records": qcomm.error_history(pair)}


def _worker(rank: int, world: int, registry: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    # ``registry`` was built in the pytest process and pickled by the spawn.
    spawned = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward
    return {
        "spawned": _underflow(rank, spawned) | {"type": type(spawned).__name__},
        "underflow": _underflow(rank),
        "heavy_tails": _heavy_tails(rank),
        "guard_raises": _guard_raises(rank),
        "guard_warns": _guard_warns(rank),
        "disagreement": _disagreement(rank),
        "plain": _plain(rank),
    }


@pytest.fixture(scope="module", params=TRANSPORTS)
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    registry = qcomm.build_registry(
        forward="adaptive:fp16|bf16,max_error=0.01,window=2", backward="bf16"
    )
    return run_ranks(_worker, WORLD, registry, timeout=300.0, env=transport_env(request.param))


def test_fp16_switches_to_bf16_from_the_call_after_one_ranks_data_underflows(
    results: list[dict[str, Any]],
) -> None:
    records = [r["underflow"]["records"] for r in results]
    used = [r.codec for r in records[0]]
    # bf16 until fp16 has been measured within budget twice, fp16 until rank
    # 1's data underflows at call 5, bf16 from call 6 on.
    assert used == ["bf16", "bf16"] + ["fp16"] * 4 + ["bf16"] * 4, used
    over = records[0][5]
    assert over.errors[1] == pytest.approx(1.0) and over.switched_to == "bf16"
    assert over.errors[0] < 0.01 and over.errors[2] < 0.01
    # Every later call is within budget, and fp16 still would not be.
    for r in records[0][6:]:
        assert r.worst <= 0.01 and r.candidates[0] == pytest.approx(1.0), r
    for rank in range(WORLD):
        assert [_key(r) for r in records[rank]] == [_key(r) for r in records[0]], rank
        exact = results[rank]["underflow"]["exact"]
        assert exact == [True] * 5 + [rank == 1] + [True] * 4, (rank, exact)


def test_an_adaptive_registry_handed_to_spawned_ranks_adapts_there(
    results: list[dict[str, Any]],
) -> None:
    # Built in this process, pickled by the spawn: each rank's copy starts
    # afresh and switches exactly as a codec made in the rank does.
    for rank in range(WORLD):
        spawned = results[rank]["spawned"]
        assert spawned["type"] == "AdaptiveCodec"
        # The same calls, ten call numbers apart (they ran first).
        mine = [
            _key(r._replace(number=r.number - 10)) for r in results[rank]["underflow"]["records"]
        ]
        assert [_key(r) for r in spawned["records"]] == mine, rank
        assert spawned["exact"] == results[rank]["underflow"]["exact"], rank
    used = [r.codec for r in results[0]["spawned"]["records"]]
    assert used == ["bf16", "bf16"] + ["fp16"] * 4 + ["bf16"] * 4, used


def _key(record: Any) -> tuple[Any, ...]:
    return (record.collective, record.number, record.codec, record.errors, record.switched_to)


def test_mx4_moves_to_int8_once_one_ranks_rows_carry_outliers(
    results: list[dict[str, Any]],
) -> None:
    records = results[0]["heavy_tails"]
    assert [r.codec for r in records] == ["int8", "int8"] + ["mx4"] * 3 + ["int8"] * 3
    assert all(r.collective == "reduce_scatter_pooled forward" for r in records)
    # mx4 on normal rows stays within 0.14; on rank 2's outliers it does not.
    assert all(r.candidates[0] <= 0.14 for r in records[:4]), records
    assert records[4].errors[2] > 0.14 and records[4].errors[0] <= 0.14, records[4]
    assert all(r.worst <= 0.14 for r in records[5:]), records
    for rank in range(WORLD):
        assert [_key(r) for r in results[rank]["heavy_tails"]] == [_key(r) for r in records]


def test_a_guard_that_raises_names_collective_rank_and_error_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    said = [r["guard_raises"]["said"] for r in results]
    assert said[0] is not None and all(s == said[0] for s in said), said
    worst = results[0]["guard_raises"]["worst"]
    assert worst > 1e-4
    assert said[0].startswith(
        f"all_to_all_sequence forward: int8's relative RMS error {worst:.3g} on rank "
    ), said[0]
    assert said[0].endswith("exceeds the budget 0.0001 (max_error)")
    assert all(r["guard_raises"]["rows"] == ROWS * WORLD for r in results)


def test_a_guard_that_warns_does_so_once_per_collective(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        warned = r["guard_warns"]
        assert warned["calls"] == 3, (rank, warned)
        assert len(warned["said"]) == 1, (rank, warned)
        assert warned["said"][0].startswith(
            "qcomm: all_to_all_pooled forward: fp16's relative RMS error "
        ), warned


@pytest.mark.parametrize("case", ["candidates", "budget", "window", "guard"])
def test_ranks_given_different_adaptive_codecs_raise_on_the_first_call(
    results: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(results):
        said = r["disagreement"][case]
        assert said is not None and "codecs.forward" in said, (rank, said)


def test_a_plain_codecs_calls_are_recorded_where_measuring_is_on(
    results: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(results):
        assert r["plain"]["before"] == [], (rank, r["plain"])
        records = r["plain"]["records"]
        assert len(records) == (2 if rank == 2 else 1), (rank, records)
        measured = records[0]
        assert measured.codec == "int8" and measured.collective == "reduce_scatter_pooled forward"
        assert all(0 < e < 0.02 for e in measured.errors), measured
        assert measured.errors == results[0]["plain"]["records"][0].errors
        # Each rank sends two blocks of ROWS x DIM: int8 makes 40 bytes of 32 values.
        assert (measured.wire_bytes, measured.data_bytes) == (
            2 * ROWS * DIM * 40 // 32,
            2 * ROWS * DIM * 4,
        )
        if rank == 2:  # only its own error is known: the others did not measure
            mixed = records[1].errors
            assert math.isnan(mixed[0]) and math.isnan(mixed[1]) and 0 < mixed[2] < 0.02
