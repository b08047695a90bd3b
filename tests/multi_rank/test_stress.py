"""Stress: 3 gloo ranks, a few hundred overlapped asynchronous calls of random
collectives, codecs and splits, every output and input gradient checked.

All ranks draw the same call list and the same schedule from one seed: calls
are started in windows of up to 16, waited for in a shuffled order while the
rest of the window is in flight, then one backward pass runs over the whole
window. Codec objects are shared by all calls that use the same codec, so
per-call state must live in the per-call context. Some windows are bursts of
large calls (1 MiB and more) of one op and codec, whose receive buffers are
the ones kept for reuse: no two calls in flight may share one. References are computed without qcomm from data every
rank generates for every rank; tolerances come from each codec's declared
bound (exact for no codec and the foreign identity codec).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from typing import Any

import torch
from collective_checks import (
    LOCAL_CODECS,
    ForeignIdentityCodec,
    assert_equal,
    assert_within,
    finite_info,
    gen,
    magnitude,
    offsets,
    sum_bound,
)
from dist_utils import run_ranks

import qcomm
from qcomm import QuantizedCommCodecs

WORLD = 3
CALLS = 400
SEED = 20240607
CODECS = [None, "foreign", "fp16", "bf16", "int8", "fp8_e4m3", "mx4:group_size=16", *LOCAL_CODECS]
FLOAT_WIRE = [None, "foreign", "fp16", "bf16", "test_fp16"]


@dataclasses.dataclass
class Call:
    label: str
    x: torch.Tensor
    pending: Any
    g: torch.Tensor
    out: torch.Tensor
    out_bound: torch.Tensor | None  # None: exact
    grad: torch.Tensor
    grad_bound: torch.Tensor | None


def codec_pairs() -> dict[str, QuantizedCommCodecs]:
    pairs = {"foreign": QuantizedCommCodecs(ForeignIdentityCodec(), ForeignIdentityCodec())}
    for name in CODECS:
        if name is None or name in pairs:
            continue
        make: Callable[[], Any] = LOCAL_CODECS.get(name) or functools.partial(
            qcomm.load_codec, name
        )
        pairs[name] = QuantizedCommCodecs(make(), make())
    return pairs


def draw_windows(rng: random.Random) -> list[list[dict[str, Any]]]:
    """Windows of calls in flight together. Some are bursts: several large
    calls of one op and codec, whose receive buffers (same dtype, similar
    sizes) are the ones kept for reuse."""
    windows: list[list[dict[str, Any]]] = []
    i = 0
    while i < CALLS:
        if rng.random() < 0.15:
            # Two bursts in a row: the second one's calls are offered the
            # buffers the first one gave back. Float wires, whose buffers
            # pass the 1 MiB above which they are kept.
            op = rng.choice(["pooled", "reduce_scatter", "sequence"])
            codec = rng.choice(FLOAT_WIRE)
            for _ in range(2):
                size = min(rng.randint(2, 4), CALLS - i)
                windows.append([draw_call(rng, i + k, op, codec, big=True) for k in range(size)])
                i += size
        else:
            size = min(rng.randint(1, 16), CALLS - i)
            windows.append([draw_call(rng, i + k) for k in range(size)])
            i += size
    return [w for w in windows if w]


def draw_call(
    rng: random.Random, i: int, op: str | None = None, codec: Any = "", big: bool | None = None
) -> dict[str, Any]:
    if big is None:
        big = rng.random() < 0.05
    op = op or rng.choice(["pooled", "reduce_scatter", "sequence"])
    spec: dict[str, Any] = {"i": i, "op": op, "codec": rng.choice(CODECS) if codec == "" else codec}
    if op == "pooled":
        spec["batches"] = [
            rng.randint(300, 340) if big else rng.randint(0, 5) for _ in range(WORLD)
        ]
        spec["dims"] = [rng.randint(900, 960) if big else rng.randint(0, 40) for _ in range(WORLD)]
    elif op == "reduce_scatter":
        spec["splits"] = rng.choice([None, [rng.randint(0, 5) for _ in range(WORLD)]])
        spec["rest"] = (rng.randint(800, 900),) if big else rng.choice([(), (3,), (17,), (2, 5)])
        if big:
            spec["splits"] = [rng.randint(100, 120) for _ in range(WORLD)]
    else:
        spec["matrix"] = [
            [rng.randint(100, 120) if big else rng.randint(0, 4) for _ in range(WORLD)]
            for _ in range(WORLD)
        ]
        spec["rest"] = (rng.randint(800, 900),) if big else rng.choice([(1,), (8,), (33,), (2, 3)])
    return spec


def bound(blocks: list[torch.Tensor], codec: Any, cat_dim: int) -> torch.Tensor:
    info = finite_info(codec)
    s = torch.cat([magnitude(b, info) for b in blocks], dim=cat_dim)
    return info.rel_error_bound * s + info.abs_error_bound


def start(rank: int, spec: dict[str, Any], pairs: dict[str, QuantizedCommCodecs]) -> Call:
    name = spec["codec"]
    codecs = pairs[name] if name is not None else None
    exact = name in (None, "foreign")
    tag, op = f"st{spec['i']}", spec["op"]
    label = f"call {spec['i']} ({op}, {name})"
    if op == "pooled":
        batches, dims = spec["batches"], spec["dims"]
        xs = [gen(f"{tag}:x{k}", (sum(batches), dims[k]), exact) for k in range(WORLD)]
        gs = [gen(f"{tag}:g{r}", (batches[r], sum(dims)), exact) for r in range(WORLD)]
        x = xs[rank].clone().requires_grad_(True)
        pending = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs)
        rows, cols = offsets(batches), offsets(dims)
        outs = [xk[rows[rank] : rows[rank + 1]] for xk in xs]
        grads = [gr[:, cols[rank] : cols[rank + 1]] for gr in gs]
        out, grad = torch.cat(outs, dim=1), torch.cat(grads, dim=0)
        if exact:
            return Call(label, x, pending, gs[rank], out, None, grad, None)
        assert codecs is not None
        return Call(
            label,
            x,
            pending,
            gs[rank],
            out,
            bound(outs, codecs.forward, 1),
            grad,
            bound(grads, codecs.backward, 0),
        )
    if op == "reduce_scatter":
        rest = spec["rest"]
        sizes = spec["splits"] if spec["splits"] is not None else [2] * WORLD
        xs = [gen(f"{tag}:x{k}", (sum(sizes), *rest), exact) for k in range(WORLD)]
        gs = [gen(f"{tag}:g{r}", (sizes[r], *rest), exact) for r in range(WORLD)]
        x = xs[rank].clone().requires_grad_(True)
        pending = qcomm.reduce_scatter_pooled(x, input_splits=spec["splits"], codecs=codecs)
        o = offsets(sizes)
        blocks = [xk[o[rank] : o[rank + 1]] for xk in xs]
        out = torch.stack(blocks).double().sum(0).float()
        grad = torch.cat(gs, dim=0)
        if exact:
            return Call(label, x, pending, gs[rank], out, None, grad, None)
        assert codecs is not None
        fwd = finite_info(codecs.forward)
        ss = [magnitude(b, fwd) for b in blocks]
        out_bound = sum_bound(blocks, ss, fwd, native=fwd.summable)
        return Call(
            label, x, pending, gs[rank], out, out_bound, grad, bound(gs, codecs.backward, 0)
        )
    matrix, rest = spec["matrix"], spec["rest"]
    column = [[matrix[k][r] for k in range(WORLD)] for r in range(WORLD)]
    xs = [gen(f"{tag}:x{k}", (sum(matrix[k]), *rest), exact) for k in range(WORLD)]
    gs = [gen(f"{tag}:g{r}", (sum(column[r]), *rest), exact) for r in range(WORLD)]
    x = xs[rank].clone().requires_grad_(True)
    pending = qcomm.all_to_all_sequence(
        x, input_splits=matrix[rank], output_splits=column[rank], codecs=codecs
    )
    send = [offsets(matrix[k]) for k in range(WORLD)]
    recv = [offsets(column[r]) for r in range(WORLD)]
    pieces = [xs[k][send[k][rank] : send[k][rank + 1]] for k in range(WORLD)]
    grads = [gs[r][recv[r][rank] : recv[r][rank + 1]] for r in range(WORLD)]
    out, grad = torch.cat(pieces), torch.cat(grads)
    if exact:
        return Call(label, x, pending, gs[rank], out, None, grad, None)
    assert codecs is not None
    return Call(
        label,
        x,
        pending,
        gs[rank],
        out,
        bound(pieces, codecs.forward, 0),
        grad,
        bound(grads, codecs.backward, 0),
    )


def check(call: Call, out: torch.Tensor) -> None:
    assert call.x.grad is not None, f"{call.label}: no input gradient"
    if call.out_bound is None or call.grad_bound is None:
        assert_equal(f"{call.label} output", out.detach(), call.out)
        assert_equal(f"{call.label} input gradient", call.x.grad, call.grad)
    else:
        assert_within(f"{call.label} output", out.detach(), call.out, call.out_bound)
        assert_within(f"{call.label} input gradient", call.x.grad, call.grad, call.grad_bound)


def stress(rank: int, world: int) -> dict[str, int]:
    rng = random.Random(SEED)
    pairs = codec_pairs()
    failures: list[str] = []
    done: dict[str, int] = {}
    for window in draw_windows(rng):
        calls = [start(rank, spec, pairs) for spec in window]
        order = list(range(len(calls)))
        rng.shuffle(order)
        outs: dict[int, torch.Tensor] = {j: calls[j].pending.wait() for j in order}
        loss = sum((outs[j] * calls[j].g).sum() for j in order)
        loss.backward()  # type: ignore[union-attr]
        for j, call in enumerate(calls):
            try:
                check(call, outs[j])
            except AssertionError as err:
                failures.append(str(err))
            key = f"{window[j]['op']}/{window[j]['codec']}"
            done[key] = done.get(key, 0) + 1
    assert not failures, f"{len(failures)} of {CALLS} calls wrong:\n" + "\n".join(failures[:10])
    return done


def test_overlapped_random_calls_on_three_ranks() -> None:
    done = run_ranks(stress, WORLD, timeout=300.0, pg_timeout=60.0)
    assert all(d == done[0] for d in done)
    assert sum(done[0].values()) == CALLS
    # Every op ran with every codec at least once.
    ops = ("pooled", "reduce_scatter", "sequence")
    missing = [f"{op}/{c}" for op in ops for c in CODECS if f"{op}/{c}" not in done[0]]
    assert not missing, f"never drawn: {missing}"
