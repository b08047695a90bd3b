r"""
Train a small DLRM on synthetic data on local ranks, with plain float32 comms
and with qcomm codecs on the embedding collectives or on the dense
gradients' all-reduce, over several seeds, and say what each codec costs in
held-out loss, with a confidence interval.

Within a seed every configuration starts from the same weights and sees the
same batches; only the codecs differ, so the gap of a codec to float32 is
measured pair by pair, seed by seed, and the seeds give its spread: the table
shows the mean gap and its 95% confidence interval (Student's t over the
seeds), and calls a gap significant when the interval leaves out zero. The
four tables are sharded table-wise (two), row-wise (one; TorchRec's pooled
reduce-scatter) and column-wise (one, in 8-column shards that block codecs
must pad), so both pooled collectives carry quantized traffic, forward and
backward. The synthetic target puts most of its signal in the embeddings, so
that what a codec does to them shows.

The ``adaptive`` configuration puts ``adaptive:mx4|int8|bf16`` (a
``qcomm.AdaptiveCodec`` at the default error budget) on both embedding
collectives, forward and backward: each call measures the relative RMS error
of every candidate on a sample of what it sends, and the next call takes the
cheapest one that stayed within budget on every rank over the last calls.
After each seed's training (and held-out evaluation), rank 0 reads
``qcomm.error_history`` of the registry: per collective and pass (e.g.
``all_to_all_pooled forward``), how many calls each codec carried, the
switches, the last call's codec, and each candidate's measured error. The
table is followed by each codec's share of the calls over all seeds.

The ``dense-*`` configurations keep the embeddings in float32 and put qcomm's
DDP communication hook (``qcomm.ddp_comm_hook``) on the dense part, which
``DistributedModelParallel`` wraps in ``DistributedDataParallel``: its
gradients are all-reduced with int8 or MX4, with error feedback (``+ef``) or
without.

Usage::

    python examples/train_dlrm.py                       # fp32 and the registries, 5 seeds, into out/
    python examples/train_dlrm.py --configs dense       # fp32 and the dense-* ones
    python examples/train_dlrm.py --configs all         # every configuration
    python examples/train_dlrm.py --out /tmp/run --steps 100 --seeds 3 --configs fp32,int8
    python examples/train_dlrm.py --add "e5m2=pooled_embeddings_all_to_all=fp8_e5m2"
    python examples/train_dlrm.py --add "all-int8=pooled_embeddings_all_to_all=int8/int8;dense=int8+ef"

``--configs`` takes configuration names and the groups ``embeddings`` (fp32
and the registries, the default), ``dense`` (fp32 and the dense hooks) and
``all``; each configuration adds about a minute per 5 seeds on 2 CPU cores,
the dense ones (a hook call per step) a little more. ``--add`` takes
a name and a qcomm registry string, ``dense=CODEC`` (``+ef`` for error
feedback), or both joined by ``;``.

Writes, under ``--out``:

- ``loss_curves.png``: the first seed's smoothed training loss per
  configuration (left) and every configuration's held-out gap to float32 with
  its confidence interval (right).
- ``results.json``: the arguments, every configuration's codecs, and
  per seed the per-step training loss, final training loss (mean of the last
  50 steps), held-out loss and their gaps to float32; per configuration the
  mean gaps, their 95% confidence intervals and wall time. An adaptive
  configuration's seeds have ``codecs_used`` (per collective and pass: its
  ``calls``, the calls per codec, the ``last`` call's codec, the
  ``switches`` as [call number, codec taken], and per candidate the median
  and largest of its measured error, the worst rank's), and its summary the
  seeds' together with each codec's ``shares`` of the calls.

and prints the gaps as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qcomm


@dataclasses.dataclass(frozen=True)
class Config:
    """What a configuration changes: the embedding collectives' registry (in
    qcomm's string form, see qcomm.build_registry) and the codec of the DDP
    hook on the dense part (a codec spec), with or without error feedback."""

    registry: str | None = None
    dense: str | None = None
    error_feedback: bool = False


# The reduce-scatter takes only summable codecs, so the scaled formats ride
# the all-to-all and a 16-bit cast carries the reduce-scatter.
A2A, RS = "pooled_embeddings_all_to_all", "pooled_embeddings_reduce_scatter"
ADAPTIVE = "adaptive:mx4|int8|bf16"
CONFIGS: dict[str, Config] = {
    "fp32": Config(),
    "fp16": Config(f"{A2A}=fp16/fp16,{RS}=fp16/fp16"),
    "bf16": Config(f"{A2A}=bf16/bf16,{RS}=bf16/bf16"),
    "int8": Config(f"{A2A}=int8/int8,{RS}=fp16/fp16"),
    "fp8": Config(f"{A2A}=fp8_e4m3/fp8_e5m2,{RS}=fp16/fp16"),
    "mx4": Config(f"{A2A}=mx4/mx4,{RS}=bf16/bf16"),
    # Each call's codec chosen by the error it measures, within the default
    # budget; qcomm's exchange sums the reduce-scatter in float32, so MX4 and
    # int8 may ride it too.
    "adaptive": Config(f"{A2A}={ADAPTIVE},{RS}={ADAPTIVE}"),
    "dense-int8+ef": Config(dense="int8", error_feedback=True),
    "dense-mx4+ef": Config(dense="mx4", error_feedback=True),
    "dense-mx4": Config(dense="mx4"),
}
GROUPS = {
    "embeddings": [name for name, c in CONFIGS.items() if c.dense is None],
    "dense": ["fp32", *(name for name, c in CONFIGS.items() if c.dense is not None)],
    "all": list(CONFIGS),
}


def parse_config(text: str) -> Config:
    """A registry string, ``dense=CODEC[+ef]``, or both joined by ``;``."""
    registry, dense, feedback = None, None, False
    for part in filter(None, (p.strip() for p in text.split(";"))):
        if part.startswith("dense="):
            dense = part.removeprefix("dense=").strip()
            if dense.endswith("+ef"):
                dense, feedback = dense.removesuffix("+ef").strip(), True
        else:
            registry = part
    return Config(registry, dense or None, feedback)


NUM_DENSE = 13
EMB_DIM = 16
ROWS = 100
TABLES = ["t0", "t1", "t2", "t3"]
TAIL = 50  # steps averaged for the final training loss
# How strongly the ids drive the label, against the dense features' logit
# (standard deviation about 1.8): most of what there is to learn goes
# through the embeddings and so through the codecs.
EMBEDDING_SIGNAL = 5.0
# Student's t at 97.5% for 1..30 degrees of freedom (two-sided 95% intervals).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


@dataclasses.dataclass
class Data:
    """Synthetic click data: dense features, bags of ids per table, labels."""

    dense: torch.Tensor  # [n, NUM_DENSE]
    lengths: torch.Tensor  # [tables, n]
    offsets: torch.Tensor  # [tables, n + 1]
    ids: list[torch.Tensor]  # per table
    labels: torch.Tensor  # [n]
    bayes_loss: float  # expected loss of the teacher itself


def make_data(n: int, seed: int) -> Data:
    """Labels drawn from a hidden teacher: a score per id of every table (the
    bag's mean) plus a linear function of the dense features."""
    gen = torch.Generator().manual_seed(seed)
    scores = EMBEDDING_SIGNAL * torch.randn(len(TABLES), ROWS, generator=gen)
    lengths = torch.randint(1, 4, (len(TABLES), n), generator=gen)
    offsets = torch.zeros(len(TABLES), n + 1, dtype=torch.long)
    offsets[:, 1:] = lengths.cumsum(1)
    # Skewed ids (small ids are frequent), as in real traffic.
    ids = [
        (ROWS * torch.rand(int(lengths[t].sum()), generator=gen) ** 3).long()
        for t in range(len(TABLES))
    ]
    dense = torch.randn(n, NUM_DENSE, generator=gen)
    logit = dense @ (0.5 * torch.randn(NUM_DENSE, generator=gen))
    for t in range(len(TABLES)):
        bag = torch.repeat_interleave(torch.arange(n), lengths[t])
        logit += torch.zeros(n).index_add_(0, bag, scores[t][ids[t]]) / lengths[t]
    p = torch.sigmoid(logit)
    labels = torch.bernoulli(p, generator=gen)
    entropy = -(p * p.clamp_min(1e-12).log() + (1 - p) * (1 - p).clamp_min(1e-12).log())
    return Data(dense, lengths, offsets, ids, labels, float(entropy.mean()))


def batch(data: Data, lo: int, hi: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Samples ``lo..hi-1`` as (dense, KeyedJaggedTensor, labels)."""
    from torchrec import KeyedJaggedTensor

    values = torch.cat(
        [data.ids[t][data.offsets[t, lo] : data.offsets[t, hi]] for t in range(len(TABLES))]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{t}" for t in TABLES], values=values, lengths=data.lengths[:, lo:hi].reshape(-1)
    )
    return data.dense[lo:hi], kjt, data.labels[lo:hi]


def make_sharder(registry: dict[str, qcomm.QuantizedCommCodecs] | None, lr: float) -> Any:
    """TorchRec's EBC sharder with ``registry``, fused row-wise Adagrad, and
    row-wise sharding allowed on CPU (TorchRec leaves it out there)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class Sharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            row_wise = ShardingType.ROW_WISE.value
            return types if row_wise in types else [*types, row_wise]

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr}
    return Sharder(fused_params=fused, qcomm_codecs_registry=registry)


def build_model(
    config: Config,
    registry: dict[str, qcomm.QuantizedCommCodecs] | None,
    args: argparse.Namespace,
    seed: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The sharded DLRM with the same initial weights on every call, the
    embedding collectives' ``registry``, the configuration's dense hook, and
    the optimizer of its dense part (the tables' optimizer is fused into them)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    world = dist.get_world_size()
    torch.manual_seed(seed)  # the dense layers' initial weights
    configs = [
        EmbeddingBagConfig(
            name=t, embedding_dim=EMB_DIM, num_embeddings=ROWS, feature_names=[f"f_{t}"]
        )
        for t in TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, EMB_DIM],
        over_arch_layer_sizes=[64, 32, 1],
        dense_device=torch.device("cpu"),
    )
    sharder = make_sharder(registry, args.lr)
    per_table = {
        "t0": table_wise(rank=0, compute_kernel="fused"),
        "t1": table_wise(rank=1 % world, compute_kernel="fused"),
        "t2": row_wise(compute_kernel="fused"),
        "t3": column_wise(ranks=list(range(world)), compute_kernel="fused"),
    }
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    if config.dense is not None:
        # DistributedModelParallel wraps the dense part in DistributedDataParallel:
        # its gradients' all-reduce takes qcomm's hook.
        from torch.nn.parallel import DistributedDataParallel

        ddp = next(m for m in dmp.modules() if isinstance(m, DistributedDataParallel))
        state, hook = qcomm.ddp_comm_hook(config.dense, error_feedback=config.error_feedback)
        ddp.register_comm_hook(state, hook)
    # The tables' initial weights, drawn like TorchRec's default init but
    # from the seed, so that every configuration starts from the same point.
    gen = torch.Generator().manual_seed(seed + 1)
    bound = math.sqrt(1.0 / ROWS)
    full = {t: (torch.rand(ROWS, EMB_DIM, generator=gen) * 2 - 1) * bound for t in TABLES}
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            table = key.split(".")[-2]
            if table in full and hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[table][r0 : r0 + nr, c0 : c0 + nc])
    dense = [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
    return dmp, torch.optim.Adam(dense, lr=args.dense_lr)


def codecs_used(registry: dict[str, qcomm.QuantizedCommCodecs]) -> dict[str, dict[str, Any]]:
    """Per collective and pass of ``registry``'s adaptive codecs (e.g.
    ``"all_to_all_pooled forward"``): its calls, how many each codec
    carried, the codec of the last call, the switches (call number and the
    codec taken from the next call on), and per candidate the median and the
    largest over calls of its relative RMS error (the worst rank's),
    measured on every call whichever codec carried it."""
    out: dict[str, dict[str, Any]] = {}
    codecs = {id(c): c for p in registry.values() for c in (p.forward, p.backward)}
    for codec in codecs.values():
        if not isinstance(codec, qcomm.AdaptiveCodec):
            continue
        for r in qcomm.error_history(codec):
            row = out.setdefault(
                r.collective,
                {"calls": 0, "codecs": {}, "last": None, "switches": [], "errors": {}},
            )
            row["calls"] += 1
            row["codecs"][r.codec] = row["codecs"].get(r.codec, 0) + 1
            row["last"] = r.codec
            if r.switched_to is not None:
                row["switches"].append([r.number, r.switched_to])
            for name, error in zip(codec.names, r.candidates):
                if not math.isnan(error):
                    row["errors"].setdefault(name, []).append(error)
    for row in out.values():
        row["errors"] = {name: _median_max(v) for name, v in row["errors"].items()}
    return out


def _median_max(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "max": ordered[-1]}


def adaptive(registry: dict[str, qcomm.QuantizedCommCodecs] | None) -> bool:
    """Whether a codec of ``registry`` is chosen call by call (or guarded)."""
    pairs = (registry or {}).values()
    return any(isinstance(c, qcomm.AdaptiveCodec) for p in pairs for c in (p.forward, p.backward))


def train(config: Config, data: Data, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One configuration: the loss of every step (mean over ranks), the
    held-out loss after training and, for an adaptive registry, the codecs
    its calls used (training and held-out alike; every rank chose alike)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    registry = qcomm.build_registry(config.registry) if config.registry else None
    model, opt = build_model(config, registry, args, seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    b = args.batch_size
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        lo = (step * world + rank) * b
        dense, kjt, labels = batch(data, lo, lo + b)
        loss = loss_fn(model(dense, kjt).squeeze(1), labels)
        opt.zero_grad()
        loss.backward()  # the tables' fused optimizer steps in here
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    held_out = torch.zeros(())
    first = args.steps * world * b
    with torch.no_grad():
        for i in range(args.eval_batches):
            lo = first + (i * world + rank) * b
            dense, kjt, labels = batch(data, lo, lo + b)
            held_out += loss_fn(model(dense, kjt).squeeze(1), labels)
    dist.all_reduce(held_out)
    used = codecs_used(registry) if registry is not None and adaptive(registry) else None
    return {
        **dataclasses.asdict(config),
        "codecs_used": used,
        "losses": losses,
        "final_train_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
        "held_out_loss": float(held_out) / (world * args.eval_batches),
        "seconds": time.perf_counter() - start,
    }


def _rank_main(rank: int, args: argparse.Namespace, configs: dict[str, Config], tmp: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        n = (args.steps + args.eval_batches) * args.world_size * args.batch_size
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        bayes = []
        for k in range(args.seeds):
            seed = args.seed + 1000 * k
            data = make_data(n, seed)  # the same on every rank and for every configuration
            bayes.append(data.bayes_loss)
            for name, config in configs.items():
                runs[name].append(train(config, data, args, seed))
        if rank == 0:
            with open(os.path.join(tmp, "runs.json"), "w") as f:
                json.dump({"bayes_loss": sum(bayes) / len(bayes), "runs": runs}, f)
    finally:
        dist.destroy_process_group()
    # All is written: leave without the interpreter's teardown, in which the
    # TorchRec stack sometimes aborts ("terminate called without an active
    # exception", about one run in eight here) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _smooth(values: list[float], window: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def interval(gaps: list[float]) -> tuple[float, float]:
    """Mean of paired gaps and the half-width of its 95% confidence interval
    (Student's t; infinite for a single seed)."""
    mean = sum(gaps) / len(gaps)
    if len(gaps) < 2:
        return mean, math.inf
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    t = T975[min(len(gaps) - 1, len(T975)) - 1]
    return mean, t * sd / math.sqrt(len(gaps))


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration: mean losses, and gaps to fp32 (seed by seed) with
    their confidence intervals."""
    base = runs.get("fp32")
    out = {}
    for name, seeds in runs.items():
        row: dict[str, Any] = {
            "final_train_loss": sum(r["final_train_loss"] for r in seeds) / len(seeds),
            "held_out_loss": sum(r["held_out_loss"] for r in seeds) / len(seeds),
            "seconds": sum(r["seconds"] for r in seeds),
        }
        for key in ("final_train_loss", "held_out_loss"):
            gap = key.replace("final_", "").replace("_loss", "") + "_gap"
            if base is None:
                row[gap] = row[gap + "_ci95"] = None
                continue
            gaps = [r[key] - b[key] for r, b in zip(seeds, base)]
            for r, g in zip(seeds, gaps):
                r[gap] = g
            mean, half = interval(gaps)
            # JSON has no infinity: one seed gives no interval at all.
            row[gap], row[gap + "_ci95"] = mean, None if math.isinf(half) else half
        half = row["held_out_gap_ci95"]
        row["significant"] = half is not None and abs(row["held_out_gap"]) > half
        used = [r["codecs_used"] for r in seeds if r.get("codecs_used")]
        if used:
            row["codecs_used"] = merge_codecs_used(used)
        out[name] = row
    return out


def merge_codecs_used(seeds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The seeds' :func:`codecs_used` together: per collective and pass, the
    calls, each codec's share of them, the switches, the last call's codec
    per seed, and per candidate the median of the seeds' median errors and
    the largest error."""
    out: dict[str, dict[str, Any]] = {}
    for used in seeds:
        for collective, row in used.items():
            into = out.setdefault(
                collective, {"calls": 0, "codecs": {}, "switches": 0, "last": [], "errors": {}}
            )
            into["calls"] += row["calls"]
            for codec, calls in row["codecs"].items():
                into["codecs"][codec] = into["codecs"].get(codec, 0) + calls
            into["switches"] += len(row["switches"])
            into["last"].append(row["last"])
            for name, error in row["errors"].items():
                into["errors"].setdefault(name, []).append(error)
    for row in out.values():
        row["shares"] = {codec: calls / row["calls"] for codec, calls in row["codecs"].items()}
        row["errors"] = {
            name: {
                "median": _median_max([e["median"] for e in errors])["median"],
                "max": max(e["max"] for e in errors),
            }
            for name, errors in row["errors"].items()
        }
    return out


def format_codecs_used(name: str, used: dict[str, dict[str, Any]]) -> list[str]:
    """The printed lines of a configuration's codecs per collective and pass."""
    lines = []
    for collective, row in sorted(used.items()):
        shares = ", ".join(
            f"{codec} {100 * share:.0f}%"
            for codec, share in sorted(row["shares"].items(), key=lambda item: -item[1])
        )
        last = ", ".join(sorted(set(row["last"])))
        errors = ", ".join(
            f"{codec} {e['median']:.3g} ({e['max']:.3g})" for codec, e in row["errors"].items()
        )
        lines.append(
            f"  {name}  {collective}: {shares} of {row['calls']} calls; {row['switches']} "
            f"switches; last call: {last}; errors {errors}"
        )
    return lines


def plot(results: dict[str, Any], path: str) -> None:
    """The first seed's loss curves, and every codec's held-out gap with its
    confidence interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, summary = results["runs"], results["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, seeds in runs.items():
        left.plot(_smooth(seeds[0]["losses"]), label=name, linewidth=1.2)
    left.axhline(
        results["bayes_loss"], color="gray", linestyle="--", label="teacher (best possible)"
    )
    left.set(
        xlabel="step", ylabel="training loss (BCE, 20-step mean)", title="DLRM on 2 ranks, seed 1"
    )
    names = [n for n in summary if summary[n]["held_out_gap"] is not None and n != "fp32"]
    gaps = [summary[n]["held_out_gap"] for n in names]
    errors = [summary[n]["held_out_gap_ci95"] or 0.0 for n in names]
    right.errorbar(range(len(names)), gaps, yerr=errors, fmt="o", capsize=5)
    right.set_xticks(range(len(names)), names)
    right.axhline(0.0, color="gray", linewidth=0.8)
    seeds = len(next(iter(runs.values())))
    right.set(
        ylabel="held-out loss - fp32's (same seed)",
        title=f"what each codec costs: mean gap, 95% interval over {seeds} seeds",
    )
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="out", help="output folder (default: out/)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank and step")
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches per rank")
    parser.add_argument("--world-size", type=int, default=2, help="local ranks, at least 2")
    parser.add_argument("--lr", type=float, default=0.1, help="tables' row-wise Adagrad")
    parser.add_argument("--dense-lr", type=float, default=3e-3, help="dense layers' Adam")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--seeds", type=int, default=5, help="seeds per configuration, paired (default: 5)"
    )
    parser.add_argument(
        "--configs",
        default="embeddings",
        help=f"comma-separated subset of {', '.join(CONFIGS)}, or the groups "
        f"{', '.join(GROUPS)} (default: embeddings)",
    )
    parser.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="one more configuration: a name and a qcomm registry string, dense=CODEC[+ef] "
        "for the dense hook, or both joined by ';' (repeatable)",
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.eval_batches, args.seeds) < 1 or args.world_size < 2:
        parser.error(
            "--steps, --batch-size, --eval-batches and --seeds must be >= 1, --world-size >= 2"
        )

    configs: dict[str, Config] = {}
    for item in filter(None, (c.strip() for c in args.configs.split(","))):
        for name in GROUPS.get(item, [item]):
            if name not in CONFIGS:
                known = ", ".join([*CONFIGS, *GROUPS])
                parser.error(f"--configs: unknown configuration {name!r}; known: {known}")
            configs[name] = CONFIGS[name]
    for item in args.add:
        name, eq, spec = item.partition("=")
        if not eq or not name or not spec:
            parser.error(f"--add expects NAME=SPEC, got {item!r}")
        configs[name] = parse_config(spec)
    for name, config in configs.items():
        try:  # fail here, before spawning, on a bad spec
            qcomm.build_registry(config.registry) if config.registry else None
            qcomm.ddp_comm_hook(config.dense) if config.dense else None
        except qcomm.CodecError as err:
            parser.error(f"configuration {name!r}: {err}")

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, configs, tmp), nprocs=args.world_size)
        with open(os.path.join(tmp, "runs.json")) as f:
            results = json.load(f)

    results["summary"] = summarize(results["runs"])
    results["args"] = vars(args)
    results["total_seconds"] = time.perf_counter() - start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "loss_curves.png"))

    seeds = args.seeds
    width = max(8, *(len(name) for name in results["summary"]))
    print(
        f"{'config':<{width}} {'train loss':>10} {'gap':>9} {'held-out':>9} {'gap':>9} "
        f"{'95% interval':>19} {'significant':>11} {'time s':>7}"
    )
    for name, row in results["summary"].items():
        gaps = [row["train_gap"], row["held_out_gap"]]
        tg, hg = (f"{g:+9.4f}" if g is not None else f"{'-':>9}" for g in gaps)
        half = row["held_out_gap_ci95"]
        if row["held_out_gap"] is None or half is None or name == "fp32":
            ci, sig = f"{'-':>19}", f"{'-':>11}"
        else:
            lo, hi = row["held_out_gap"] - half, row["held_out_gap"] + half
            ci, sig = f"[{lo:+.4f}, {hi:+.4f}]", f"{'yes' if row['significant'] else 'no':>11}"
        print(
            f"{name:<{width}} {row['final_train_loss']:>10.4f} {tg} {row['held_out_loss']:>9.4f} {hg} "
            f"{ci:>19} {sig} {row['seconds']:>7.1f}"
        )
    print(
        f"gaps: the configuration's loss minus fp32's on the same seed, mean over {seeds} "
        f"seed(s); significant: the 95% interval leaves out 0"
    )
    print(f"teacher's own loss (best possible): {results['bayes_loss']:.4f}")
    used = [(n, r["codecs_used"]) for n, r in results["summary"].items() if "codecs_used" in r]
    if used:
        print(
            "codecs per call, all seeds: each codec's share of the calls, the switches, the "
            "last call's codec; each candidate's relative RMS error (worst rank), median over "
            "calls (largest):"
        )
        for name, row in used:
            print("\n".join(format_codecs_used(name, row)))
    print(f"total {results['total_seconds']:.0f} s; wrote {args.out}/loss_curves.png, results.json")
    return results


if __name__ == "__main__":
    main()
