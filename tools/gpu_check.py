#!/usr/bin/env python3
r"""
qcomm on one CUDA GPU, checked end to end: ``make gpu-check``, or
``python tools/gpu_check.py --out out/gpu_check.json [--quick | --dry-run]``.

For every codec of :data:`CODECS` it runs the three collectives (forward and
backward), the all-reduce and a DDP model with qcomm's hook, against float64
references computed without qcomm, within the bound the codec declares; on
NCCL at world size 1 (NCCL takes one rank per GPU), on gloo at 2 ranks sharing
the GPU, and again on gloo with ``QCOMM_TRANSPORT=all_to_all`` (CUDA and CPU
tensors). On CUDA it also counts host syncs, waits for a call on another
stream than the one that issued it, and times each codec's encode and decode
against fbgemm-gpu's codecs through TorchRec. ``--dry-run`` runs the same
logic on CPU with tiny sizes. Exit status: 0 all passed, 1 a check failed,
2 no CUDA (without ``--dry-run``). See docs/gpu_check.rst.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import importlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import qcomm
from qcomm._table import format_table
from qcomm.collectives.all_reduce import all_reduce

CODECS = ("noop", "fp16", "bf16", "int8", "fp8_e4m3", "mx4")
COLLECTIVES = ("pooled", "reduce_scatter", "sequence", "all_reduce", "ddp")
# fbgemm's codec for each qcomm codec, as TorchRec builds it: (SparseType, row_dim);
# row_dim 32 makes fbgemm's FP8 row-wise like fp8_e4m3 (10 bits per element).
FBGEMM = {"fp16": ("FP16", None), "bf16": ("BF16", None), "int8": ("INT8", None),
          "fp8_e4m3": ("FP8", 32), "mx4": ("MX4", None)}  # fmt: skip
ENV = "QCOMM_TRANSPORT"
U32 = 2.0**-24  # float32's unit roundoff
# (sizes scale, MiB timed, timing repetitions) of each mode.
MODES = {"dry-run": (1, [1 / 16], 3), "quick": (16, [16.0], 10), "full": (128, [16.0, 64.0], 30)}
TIMING = ("qcomm_encode_gbps", "fbgemm_encode_gbps", "ratio_encode",
          "qcomm_decode_gbps", "fbgemm_decode_gbps", "ratio_decode")  # fmt: skip
Row = dict[str, Any]
Built = tuple[Callable[[], list[Any]], list[tuple[Any, Any]], dict[str, Callable[[], object]]]


def offsets(sizes: list[int]) -> list[int]:
    """Start of each part, then the end."""
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


def gen(tag: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The same tensor on every rank for the same tag; rows of different magnitudes."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    x = torch.randn(shape, generator=g)
    rows = torch.rand((shape[0],) + (1,) * (len(shape) - 1), generator=g) * 4 + 0.1
    return (x * rows).to(device)


def magnitude(block: torch.Tensor, info: qcomm.CodecInfo) -> torch.Tensor:
    """``s`` of the declared bound for each element of a block encoded on its own."""
    a = block.detach().abs().double()
    if info.error_block == 1 or a.numel() == 0:
        return a
    # Every scale block lies within the block: its largest magnitude bounds theirs.
    return torch.full_like(a, a.max().item())


def expect_cat(parts: list[torch.Tensor], dim: int, info: qcomm.CodecInfo) -> tuple[Any, Any]:
    """Reference and bound of parts that each travel encoded on their own, concatenated."""
    s = torch.cat([magnitude(p, info) for p in parts], dim)
    bound = info.rel_error_bound * s + info.abs_error_bound
    return torch.cat([p.double() for p in parts], dim), bound


def sum_bound(blocks: list[torch.Tensor], info: qcomm.CodecInfo) -> Any:
    """Bound of a reduce-scatter's sum: each rank's encoding error, then each addition's rounding."""
    r, a, world = info.rel_error_bound, info.abs_error_bound, len(blocks)
    ss = [magnitude(b, info) for b in blocks]
    partial = sum(b.abs().double() + r * s + a for b, s in zip(blocks, ss))
    # A summable wire is summed by the backend in its own format, rounding as the codec does.
    native = r * (1 + r) ** world * (partial + world * a) + a if info.summable else 0.0
    return sum(r * s + a for s in ss) + (world - 1) * (native + U32 * partial)


def mean_bound(gs: list[torch.Tensor], info: qcomm.CodecInfo) -> Any:
    """Bound of the all-reduce's average (an encoded reduce-scatter, then all-gather)."""
    n, r, a = len(gs), info.rel_error_bound, info.abs_error_bound
    e1 = sum(r * magnitude(g, info) + a for g in gs) / n
    e2 = r * magnitude(torch.stack(gs).double().mean(0).abs() + e1, info) + a
    return e1 + e2 + 8 * U32 * (sum(g.abs().double() for g in gs) + n * (e1 + e2))


def score(got: list[Any], expect: list[tuple[Any, Any]]) -> dict[str, float]:
    """Largest error; error, bound and their ratio where the ratio is worst (NaN counts as inf)."""
    worst = {"max_error": 0.0, "error": 0.0, "bound": 0.0, "ratio": 0.0}
    for g, (ref, bound) in zip(got, expect):
        if g is None or tuple(g.shape) != tuple(ref.shape):
            raise AssertionError(f"shape {None if g is None else tuple(g.shape)}, not {ref.shape}")
        err = (g.detach().double() - ref).abs().nan_to_num(nan=math.inf).reshape(-1)
        b = bound.expand_as(ref).reshape(-1)
        ratio = torch.where(err == 0, torch.zeros_like(err), err / b)
        if ratio.numel():
            i = int(ratio.argmax())
            worst["max_error"] = max(worst["max_error"], float(err.max()))
            if float(ratio[i]) >= worst["ratio"]:
                worst.update(error=float(err[i]), bound=float(b[i]), ratio=float(ratio[i]))
    return worst


def count_syncs(fn: Callable[[], object]) -> int:
    """Host syncs while ``fn`` runs, as ``set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median time of ``fn`` after two warm-up calls (CUDA events on CUDA)."""
    for _ in range(2):
        fn()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < reps:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        # A slow path (a fallback) gets fewer repetitions rather than minutes.
        if len(times) >= 3 and time.perf_counter() - began > 5:
            break
    return statistics.median(times)


def throughput(codec: Any, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """Encode and decode GB/s, counted in float32 bytes of ``x``."""
    ctx = codec.create_context()
    wire = codec.encode(x, ctx)
    enc = median_seconds(lambda: codec.encode(x, ctx), reps, x.device)
    dec = median_seconds(lambda: codec.decode(wire, ctx), reps, x.device)
    return x.numel() * 4 / enc / 1e9, x.numel() * 4 / dec / 1e9


def fbgemm_codec(kind: str, row_dim: int | None) -> Any:
    """fbgemm-gpu's codec of a format, as TorchRec builds it."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.distributed.fbgemm_qcomm_codec import FbgemmQuantizedCommCodec

    return FbgemmQuantizedCommCodec(getattr(SparseType, kind), row_dim=row_dim)


def time_codec(name: str, mib: float, dev: torch.device, reps: int) -> Row:
    """qcomm's and fbgemm's encode and decode GB/s on ``mib`` MiB of float32 [rows, 128]."""
    x = torch.randn(int(mib * 2**20) // 512, 128, device=dev)
    kind, row_dim = FBGEMM[name]
    entry: Row = {"codec": name, "mib": mib, "device": dev.type, "fbgemm": kind}
    makers = {
        "qcomm": lambda: qcomm.load_codec(name),
        "fbgemm": lambda: fbgemm_codec(kind, row_dim),
    }
    for who, make in makers.items():
        try:
            entry[f"{who}_encode_gbps"], entry[f"{who}_decode_gbps"] = throughput(make(), x, reps)
        except Exception as err:
            entry[f"{who}_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    for op in ("encode", "decode"):
        if f"qcomm_{op}_gbps" in entry and f"fbgemm_{op}_gbps" in entry:
            entry[f"ratio_{op}"] = entry[f"qcomm_{op}_gbps"] / entry[f"fbgemm_{op}_gbps"]
    return entry


def codecs_of(name: str) -> tuple[Any, qcomm.CodecInfo]:
    """The forward/backward pair of ``name`` (``None`` for noop) and its info."""
    if name == "noop":
        return None, qcomm.codec_info(qcomm.NoOpQuantizedCommCodec())
    pair = qcomm.QuantizedCommCodecs(
        forward=qcomm.load_codec(name), backward=qcomm.load_codec(name)
    )
    return pair, qcomm.codec_info(pair.forward)


def autograd_step(call: Callable[[Any], Any], x0: torch.Tensor, g: torch.Tensor) -> Any:
    """A collective's call, wait() and backward pass; returns its output and input gradient."""

    def step() -> list[Any]:
        x = x0.clone().requires_grad_(True)
        out = call(x).wait()
        (out * g).sum().backward()
        return [out.detach(), x.grad]

    return step


def build_pooled(
    rank: int, world: int, name: str, dev: torch.device, n: int, streams: bool = False
) -> Built:
    codecs, info = codecs_of(name)
    batches, dims = [8 * n + 3 * r for r in range(world)], [96 + 33 * k for k in range(world)]
    xs = [gen(f"px{k}", (sum(batches), dims[k]), dev) for k in range(world)]
    gs = [gen(f"pg{r}", (batches[r], sum(dims)), dev) for r in range(world)]
    rows, cols = offsets(batches), offsets(dims)
    call = lambda x: qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs)  # noqa: E731
    mine = slice(rows[rank], rows[rank + 1])
    out = expect_cat([x[mine] for x in xs], 1, info)
    if streams:
        return lambda: [cross_stream(call, xs[rank], dev)], [out], {}
    grads = [g[:, cols[rank] : cols[rank + 1]] for g in gs]
    return autograd_step(call, xs[rank], gs[rank]), [out, expect_cat(grads, 0, info)], {}


def cross_stream(call: Callable[[Any], Any], x0: torch.Tensor, dev: torch.device) -> Any:
    """The call issued on one stream, waited for and its output used on another."""
    issue, use = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = x0.clone()
    issue.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(issue):
        # Late work on the issuing stream: a wait() that orders nothing reads garbage.
        torch.cuda._sleep(20_000_000)
        pending = call(x)
    with torch.cuda.stream(use):
        out = pending.wait() * 1.0
    torch.cuda.current_stream(dev).wait_stream(use)
    torch.cuda.synchronize()  # before x and out go back to the caching allocator
    return out


def build_reduce_scatter(rank: int, world: int, name: str, dev: torch.device, n: int) -> Built:
    codecs, info = codecs_of(name)
    sizes = [8 * n + r for r in range(world)]
    xs = [gen(f"rx{k}", (sum(sizes), 100), dev) for k in range(world)]
    gs = [gen(f"rg{r}", (sizes[r], 100), dev) for r in range(world)]
    call = lambda x: qcomm.reduce_scatter_pooled(x, input_splits=sizes, codecs=codecs)  # noqa: E731
    o = offsets(sizes)
    blocks = [x[o[rank] : o[rank + 1]] for x in xs]
    ref = (torch.stack(blocks).double().sum(0), sum_bound(blocks, info))
    return autograd_step(call, xs[rank], gs[rank]), [ref, expect_cat(gs, 0, info)], {}


def build_sequence(rank: int, world: int, name: str, dev: torch.device, n: int) -> Built:
    codecs, info = codecs_of(name)
    matrix = [[4 * n + k + 2 * r for r in range(world)] for k in range(world)]  # k sends to r
    column = [[matrix[k][r] for k in range(world)] for r in range(world)]
    xs = [gen(f"sx{k}", (sum(matrix[k]), 72), dev) for k in range(world)]
    gs = [gen(f"sg{r}", (sum(column[r]), 72), dev) for r in range(world)]
    call = lambda x: qcomm.all_to_all_sequence(  # noqa: E731
        x, input_splits=matrix[rank], output_splits=column[rank], codecs=codecs
    )
    send, recv = [offsets(m) for m in matrix], [offsets(c) for c in column]
    pieces = [xs[k][send[k][rank] : send[k][rank + 1]] for k in range(world)]
    grads = [gs[r][recv[r][rank] : recv[r][rank + 1]] for r in range(world)]
    step = autograd_step(call, xs[rank], gs[rank])
    return step, [expect_cat(pieces, 0, info), expect_cat(grads, 0, info)], {}


def build_all_reduce(rank: int, world: int, name: str, dev: torch.device, n: int) -> Built:
    codecs, info = codecs_of(name)
    gs = [gen(f"ag{k}", (1000 * n + 7,), dev) for k in range(world)]
    fwd, bwd = (codecs.forward, codecs.backward) if codecs is not None else (None, None)
    step = lambda: [  # noqa: E731
        all_reduce(gs[rank].clone(), reduce_codec=fwd, gather_codec=bwd, average=True)
    ]
    return step, [(torch.stack(gs).double().mean(0), mean_bound(gs, info))], {}


def build_ddp(rank: int, world: int, name: str, dev: torch.device, n: int) -> Built:
    info = codecs_of(name)[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = model.to(dev)
    xs = [gen(f"dx{k}", (8 * n, 16), dev) for k in range(world)]

    def grads(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        m.zero_grad()
        m(x).square().mean().backward()
        return torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])

    # Every rank's own gradients, as DDP computes them before its hook averages them.
    local = [grads(copy.deepcopy(model), x) for x in xs]
    ids = [dev.index] if dev.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=ids)
    ddp.register_comm_hook(*qcomm.ddp_comm_hook(None if name == "noop" else name))
    ref = (torch.stack(local).double().mean(0), mean_bound(local, info))
    return lambda: [grads(ddp, xs[rank])], [ref], {}


def build_encode_decode(rank: int, world: int, name: str, dev: torch.device, n: int) -> Built:
    codec = qcomm.load_codec(name)
    x, ctx = gen("cx", (64 * n, 128), dev), codec.create_context()
    wire = codec.encode(x, ctx)
    step = lambda: [codec.decode(codec.encode(x, ctx), ctx).reshape(x.shape)]  # noqa: E731
    parts: dict[str, Callable[[], object]] = {"encode": lambda: codec.encode(x, ctx)}
    parts["decode"] = lambda: codec.decode(wire, ctx)
    return step, [expect_cat([x], 0, qcomm.codec_info(codec))], parts


BUILDERS: dict[str, Callable[[int, int, str, torch.device, int], Built]] = {
    "pooled": build_pooled,
    "reduce_scatter": build_reduce_scatter,
    "sequence": build_sequence,
    "all_reduce": build_all_reduce,
    "ddp": build_ddp,
    "cross_stream": functools.partial(build_pooled, streams=True),
    "encode_decode": build_encode_decode,
}


def check_one(
    kind: str, name: str, rank: int, world: int, dev: torch.device, n: int, syncs: str | None
) -> Row:
    """One check on this rank; ``syncs``: why host syncs are not counted (``None``: count them)."""
    row: Row = {"check": kind, "codec": name, "status": "fail", "host_syncs": syncs}
    try:
        devices = qcomm.codec_info(qcomm.load_codec(name)).devices
        if dev.type not in devices:
            return {**row, "status": "skipped", "message": f"CodecInfo.devices {devices}"}
        step, expect, parts = BUILDERS[kind](rank, world, name, dev, n)
        row.update(score(step(), expect))
        row["status"] = "pass" if row["ratio"] <= 1 else "fail"
        if syncs is None and kind != "cross_stream":
            # Counted on a second call: the first one's agreement and set-up are not the steady state.
            row["host_syncs"] = {k: count_syncs(fn) for k, fn in (parts or {"call": step}).items()}
    except Exception as err:
        row["message"] = f"{type(err).__name__}: {err}"[:1500]
    return row


def kinds_of(setup: Row) -> tuple[str, ...]:
    """The checks a setup runs: the cross-stream one on CUDA; a setup without a backend, codecs alone."""
    if not setup["backend"]:
        return ("encode_decode",)
    return COLLECTIVES + (("cross_stream",) if setup["device"] == "cuda" else ())


def rank_checks(
    rank: int,
    setup: Row,
    emit: Callable[[Row], None],
    names: list[str],
    n: int,
    syncs: str | None,
    mibs: list[float],
    reps: int,
) -> Row:
    """Every check of a setup on this rank, then the codecs' timing where asked for."""
    dev = torch.device(setup["device"], 0) if setup["device"] == "cuda" else torch.device("cpu")
    passed = []
    for kind in kinds_of(setup):
        for name in names:
            emit(row := check_one(kind, name, rank, setup["world"], dev, n, syncs))
            passed += [name] if row["status"] == "pass" else []
    timing = [time_codec(c, mib, dev, reps) for c in passed if c in FBGEMM for mib in mibs]
    opened = getattr(importlib.import_module("qcomm.collectives._transport"), "opened", None)
    return {"opened": dict(opened) if opened is not None else None, "timing": timing}


def setups(dry: bool) -> list[Row]:
    """Backend, world size, device and environment of each run; the last one times the codecs."""
    runs = [("gloo", 1, "cpu", ""), ("gloo", 2, "cpu", ""), ("gloo", 2, "cpu", "all_to_all")]
    if not dry:
        runs = [("nccl", 1, "cuda", ""), ("gloo", 2, "cuda", ""),
                ("gloo", 2, "cuda", "all_to_all"), ("gloo", 2, "cpu", "all_to_all")]  # fmt: skip
    out = [{"name": f"{b}/{w} {d}" + (" a2a" if e else ""), "backend": b, "world": w, "device": d,
            "env": {ENV: e} if e else {}} for b, w, d, e in runs]  # fmt: skip
    device = "cpu" if dry else "cuda"
    return out + [
        {"name": f"codec {device}", "backend": "", "world": 1, "device": device, "env": {}}
    ]


def worker(rank: int, setup: Row, tmp: str, pg_timeout: float, args: tuple[Any, ...]) -> None:
    """A spawned rank: its setup's environment and process group, then its checks."""
    os.environ.pop(ENV, None)
    os.environ.update(setup["env"])
    if setup["device"] == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    else:
        torch.cuda.set_device(0)
    if setup["backend"]:
        store = dist.FileStore(os.path.join(tmp, "store"), setup["world"])
        timeout = datetime.timedelta(seconds=pg_timeout)
        dist.init_process_group(
            setup["backend"], store=store, rank=rank, world_size=setup["world"], timeout=timeout
        )
    # Rows go to a file as they come: a rank killed later has still reported them.
    with open(os.path.join(tmp, f"rows{rank}"), "a") as rows:
        emit = lambda row: print(json.dumps(row), file=rows, flush=True)  # noqa: E731
        done = rank_checks(rank, setup, emit, *args)
    if setup["backend"]:
        dist.destroy_process_group()
    Path(tmp, f"done{rank}").write_text(json.dumps(done))


def run_job(
    setup: Row, args: tuple[Any, ...], timeout: float, pg_timeout: float
) -> tuple[list[list[Row]], list[Row | None], str | None]:
    """The setup's ranks, spawned; all are killed at ``timeout``, or 10 s after one fails."""
    tmp, error = tempfile.mkdtemp(prefix="qcomm-gpu-check-"), None
    spawn = torch.multiprocessing.spawn
    ranks = spawn(worker, (setup, tmp, pg_timeout, args), nprocs=setup["world"], join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ranks.join(timeout=1, grace_period=10):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout:.0f} s"
                break
    except Exception as err:  # a rank raised or died; join() has ended the others
        error = str(err)[-3000:]
    finally:
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    read = lambda name: Path(tmp, name).read_text() if Path(tmp, name).exists() else ""  # noqa: E731
    rows = [
        [json.loads(line) for line in read(f"rows{r}").splitlines()] for r in range(setup["world"])
    ]
    done = [json.loads(read(f"done{r}") or "null") for r in range(setup["world"])]
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, done, error


def merge_rows(
    setup: str, keys: list[tuple[str, str]], per_rank: list[list[Row]], error: str | None
) -> list[Row]:
    """One row per check and codec from every rank's: it passes only where every rank passed."""
    merged = []
    for check, codec in keys:
        rows = [r for rank in per_rank for r in rank if (r["check"], r["codec"]) == (check, codec)]
        row: Row = {"check": check, "setup": setup, "codec": codec, "status": "fail"}
        if not per_rank or len(rows) < len(per_rank):
            merged.append({**row, "message": f"not reported by every rank; {error}"[:2000]})
            continue
        statuses = {r["status"] for r in rows}
        row["status"] = statuses.pop() if len(statuses) == 1 else "fail"
        if scored := [r for r in rows if r.get("ratio") is not None]:
            worst = max(scored, key=lambda r: r["ratio"])
            row.update({k: worst[k] for k in ("error", "bound", "ratio")})
            row["max_error"] = max(r["max_error"] for r in scored)
        row["host_syncs"] = rows[0]["host_syncs"]
        notes = [f"rank {i}: {r['message']}" for i, r in enumerate(rows) if r.get("message")]
        row.update({"message": "\n".join(notes)} if notes else {})
        merged.append(row)
    return merged


def cell(row: Row | None) -> str:
    """A summary cell: error / bound where worst, then host syncs where counted."""
    if row is None or row["status"] == "skipped":
        return "-" if row is None else "skip"
    if row.get("ratio") is None:
        return "FAIL"
    text = ("FAIL " if row["status"] == "fail" else "") + f"{row['ratio']:.2g}"
    syncs = row.get("host_syncs")
    return text + (" s" + "+".join(map(str, syncs.values())) if isinstance(syncs, dict) else "")


def summary(report: Row) -> str:
    """The one-screen text: checks per setup and codec, transports, failures, timing."""
    names, checks, timing = report["codecs"], report["checks"], report["timing"]
    found = {(r["check"], r["setup"], r["codec"]): r for r in checks}
    pairs = dict.fromkeys((r["check"], r["setup"]) for r in checks)
    body = [[c, s, *(cell(found.get((c, s, name))) for name in names)] for c, s in pairs]
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [f"qcomm GPU check ({report['mode']}, {report['device']}): {verdict}", ""]
    lines += [format_table(["check", "backend/world", *names], body, 2), ""]
    lines.append("cell: max error / declared bound where worst (pass <= 1; noop: exact);")
    lines.append(
        f"  sN: host syncs of the whole call, sE+D: of encode and decode ({report['host_syncs'] or 'counted'})"
    )
    for s in report["setups"]:
        env = " ".join(f"{k}={v}" for k, v in s["env"].items()) or "-"
        trouble = f"; {s['error'].splitlines()[-1][:120]}" if s["error"] else ""
        lines.append(f"{s['name']}: env {env}; transports opened {s['transports_opened']}{trouble}")
    for r in [r for r in checks if r["status"] == "fail"][:8]:
        last = (str(r.get("message") or "beyond the bound").splitlines() or [""])[-1]
        lines.append(f"FAILED {r['check']} {r['setup']} {r['codec']}: {last[:200]}")
    note = timing["note"] + (f"; {timing['error'].splitlines()[-1]}" if timing["error"] else "")
    lines += ["", f"encode/decode GB/s on {timing['device']} ({note})"]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    head = ["codec", "MiB", "enc", "fbgemm enc", "ratio", "dec", "fbgemm dec", "ratio", "fbgemm"]
    rows = [
        [
            t["codec"],
            fmt(t["mib"]),
            *(fmt(t.get(k)) for k in TIMING),
            (t.get("qcomm_error") or t.get("fbgemm_error") or t["fbgemm"])[:60],
        ]
        for t in timing["rows"]
    ]
    return "\n".join([*lines, format_table(head, rows, 1)])


def run_all(args: argparse.Namespace, cuda: bool) -> Row:
    """Every setup in turn, within the global ``--timeout``; the report."""
    began = time.monotonic()
    mode = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    n, mibs, reps = MODES[mode]
    names = [c.strip() for c in args.codecs.split(",") if c.strip()]
    no_syncs = None if not args.dry_run else f"skipped ({'dry run' if cuda else 'no CUDA'})"
    device = "cpu" if args.dry_run else torch.cuda.get_device_name(0)
    report: Row = {"mode": mode, "device": device, "torch": torch.__version__, "codecs": names}
    report.update(host_syncs=no_syncs, setups=[], checks=[])
    for setup in setups(args.dry_run):
        started, left = time.monotonic(), args.timeout - (time.monotonic() - began)
        syncs = no_syncs if setup["device"] == "cuda" or no_syncs else "n/a (CPU tensors)"
        job = (names, n, syncs, [] if setup["backend"] else mibs, reps)
        rows: list[list[Row]] = []
        done: list[Row | None] = [None]
        error: str | None = "not run: the global --timeout ran out"
        if left > 10:
            pg_timeout = 30 if args.dry_run else 60
            rows, done, error = run_job(setup, job, min(left, args.timeout / 2), pg_timeout)
        keys = [(k, c) for k in kinds_of(setup) for c in names]
        report["checks"] += merge_rows(setup["name"], keys, rows, error)
        if not setup["backend"]:
            note = "CUDA events" if no_syncs is None else f"CUDA timing {no_syncs}; CPU, tiny size"
            timing = done[0]["timing"] if done[0] is not None else []
            report["timing"] = {"device": setup["device"], "note": note, "rows": timing}
            report["timing"]["error"] = error
            continue
        found = [d["opened"] for d in done if d is not None and d["opened"] is not None]
        counts: list[Counter[str]] = [Counter(c) for c in found]
        opened = dict(sum(counts, Counter())) if counts else None
        wall = time.monotonic() - started
        report["setups"].append(
            {**setup, "transports_opened": opened, "error": error, "wall_s": wall}
        )
    report["passed"] = all(r["status"] != "fail" for r in report["checks"])
    report["wall_s"] = time.monotonic() - began
    return report


def main(argv: list[str] | None = None) -> int:
    """Runs the checks, writes the JSON, prints the summary; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="out/gpu_check.json", help="the JSON report")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, tiny sizes, no CUDA needed")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds for everything")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "--dry-run checks the logic on CPU", file=sys.stderr)  # fmt: skip
        return 2
    report = run_all(args, cuda)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))
    print(f"\nwrote {args.out} in {report['wall_s']:.0f} s")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
