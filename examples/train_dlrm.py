r"""
Train a small DLRM on synthetic data on local ranks, once with plain float32
comms and once per qcomm codec registry, and compare the loss curves.

Every run starts from the same weights and sees the same batches; only the
codecs on TorchRec's embedding collectives differ. The four tables are
sharded table-wise (two), row-wise (one; TorchRec's pooled reduce-scatter) and
column-wise (one, in 8-column shards that block codecs must pad), so both
pooled collectives carry quantized traffic, forward and backward.

Usage::

    python examples/train_dlrm.py                       # all configurations, into out/
    python examples/train_dlrm.py --out /tmp/run --steps 100 --configs fp32,int8
    python examples/train_dlrm.py --add "e5m2=pooled_embeddings_all_to_all=fp8_e5m2"

Writes, under ``--out``:

- ``loss_curves.png``: smoothed training loss per configuration (left) and
  its difference to float32 (right).
- ``results.json``: the arguments, every configuration's registry spec,
  per-step training loss, final training loss (mean of the last 50 steps),
  held-out loss, their gaps to float32, and wall time.

and prints the final loss gaps as a table.
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

# Registry specs in qcomm's string form (see qcomm.build_registry). The
# reduce-scatter takes only summable codecs, so the scaled formats ride the
# all-to-all and a 16-bit cast carries the reduce-scatter.
A2A, RS = "pooled_embeddings_all_to_all", "pooled_embeddings_reduce_scatter"
CONFIGS: dict[str, str | None] = {
    "fp32": None,
    "fp16": f"{A2A}=fp16/fp16,{RS}=fp16/fp16",
    "bf16": f"{A2A}=bf16/bf16,{RS}=bf16/bf16",
    "int8": f"{A2A}=int8/int8,{RS}=fp16/fp16",
    "fp8": f"{A2A}=fp8_e4m3/fp8_e5m2,{RS}=fp16/fp16",
    "mx4": f"{A2A}=mx4/mx4,{RS}=bf16/bf16",
}

NUM_DENSE = 13
EMB_DIM = 16
ROWS = 500
TABLES = ["t0", "t1", "t2", "t3"]
TAIL = 50  # steps averaged for the final training loss


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
    scores = torch.randn(len(TABLES), ROWS, generator=gen)
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
    registry: dict[str, qcomm.QuantizedCommCodecs] | None, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The sharded DLRM with the same initial weights on every call, and the
    optimizer of its dense part (the tables' optimizer is fused into them)."""
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
    torch.manual_seed(args.seed)  # the dense layers' initial weights
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
    # The tables' initial weights, drawn like TorchRec's default init but
    # from the seed, so that every configuration starts from the same point.
    gen = torch.Generator().manual_seed(args.seed + 1)
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


def train(spec: str | None, data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: the loss of every step (mean over ranks) and the
    held-out loss after training."""
    rank, world = dist.get_rank(), dist.get_world_size()
    registry = qcomm.build_registry(spec) if spec else None
    model, opt = build_model(registry, args)
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
    return {
        "spec": spec,
        "losses": losses,
        "final_train_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
        "held_out_loss": float(held_out) / (world * args.eval_batches),
        "seconds": time.perf_counter() - start,
    }


def _rank_main(
    rank: int, args: argparse.Namespace, configs: dict[str, str | None], tmp: str
) -> None:
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
        data = make_data(n, args.seed)  # the same on every rank and for every run
        runs = {name: train(spec, data, args) for name, spec in configs.items()}
        if rank == 0:
            with open(os.path.join(tmp, "runs.json"), "w") as f:
                json.dump({"bayes_loss": data.bayes_loss, "runs": runs}, f)
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


def plot(results: dict[str, Any], path: str) -> None:
    """Loss curves side by side: smoothed loss, and its difference to fp32."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = _smooth(runs["fp32"]["losses"]) if "fp32" in runs else None
    for name, run in runs.items():
        smooth = _smooth(run["losses"])
        left.plot(smooth, label=name, linewidth=1.2)
        if base is not None:
            right.plot([a - b for a, b in zip(smooth, base)], label=name, linewidth=1.2)
    left.axhline(
        results["bayes_loss"], color="gray", linestyle="--", label="teacher (best possible)"
    )
    left.set(xlabel="step", ylabel="training loss (BCE, 20-step mean)", title="DLRM on 2 ranks")
    right.set(xlabel="step", ylabel="loss - fp32 loss", title="gap to float32 comms")
    right.axhline(0.0, color="gray", linewidth=0.8)
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="out", help="output folder (default: out/)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank and step")
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches per rank")
    parser.add_argument("--world-size", type=int, default=2, help="local ranks, at least 2")
    parser.add_argument("--lr", type=float, default=0.05, help="tables' row-wise Adagrad")
    parser.add_argument("--dense-lr", type=float, default=3e-3, help="dense layers' Adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {', '.join(CONFIGS)}",
    )
    parser.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="one more configuration: a name and a qcomm registry string (repeatable)",
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.eval_batches) < 1 or args.world_size < 2:
        parser.error("--steps, --batch-size and --eval-batches must be >= 1, --world-size >= 2")

    configs: dict[str, str | None] = {}
    for name in filter(None, (c.strip() for c in args.configs.split(","))):
        if name not in CONFIGS:
            parser.error(f"--configs: unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
        configs[name] = CONFIGS[name]
    for item in args.add:
        name, eq, spec = item.partition("=")
        if not eq or not name or not spec:
            parser.error(f"--add expects NAME=SPEC, got {item!r}")
        configs[name] = spec
    for name, spec in configs.items():
        try:  # fail here, before spawning, on a bad spec
            qcomm.build_registry(spec) if spec else None
        except qcomm.CodecError as err:
            parser.error(f"configuration {name!r}: {err}")

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, configs, tmp), nprocs=args.world_size)
        with open(os.path.join(tmp, "runs.json")) as f:
            results = json.load(f)

    runs = results["runs"]
    base = runs.get("fp32")
    for run in runs.values():
        run["train_gap"] = run["final_train_loss"] - base["final_train_loss"] if base else None
        run["held_out_gap"] = run["held_out_loss"] - base["held_out_loss"] if base else None
    results["args"] = vars(args)
    results["total_seconds"] = time.perf_counter() - start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "loss_curves.png"))

    print(f"{'config':<8} {'train loss':>10} {'gap':>9} {'held-out':>9} {'gap':>9} {'time s':>7}")
    for name, run in runs.items():
        gaps = [run["train_gap"], run["held_out_gap"]]
        tg, hg = (f"{g:+9.4f}" if g is not None else f"{'-':>9}" for g in gaps)
        print(
            f"{name:<8} {run['final_train_loss']:>10.4f} {tg} {run['held_out_loss']:>9.4f} {hg} "
            f"{run['seconds']:>7.1f}"
        )
    print(f"teacher's own loss (best possible): {results['bayes_loss']:.4f}")
    print(f"total {results['total_seconds']:.0f} s; wrote {args.out}/loss_curves.png, results.json")
    return results


if __name__ == "__main__":
    main()
