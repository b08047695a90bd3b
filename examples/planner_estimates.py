r"""
TorchRec's planner with and without qcomm's estimator, against measured
times: for the DLRM tables of ``qcomm bench --train`` (by default 16 tables
of dimension 128, a batch of 2048 per rank, 2 ranks), all table-wise and all
row-wise, the pooled all-to-all (table-wise) and reduce-scatter (row-wise)
milliseconds per step, forward and backward, as :class:`qcomm.CodecPerfEstimator`
estimates them, as TorchRec's own estimator does (on the same link rates, and
on its default ones), and as ``qcomm bench`` measured them; then the plan of
each estimator for those tables, written as ``qcomm bench --train-plan``
reads it. The figures of ``docs/planner.rst`` come from this script.

The bench file must hold the pooled all-to-all at the table-wise size and the
reduce-scatter at the row-wise one (each rank's float32 buffer: 16M and 32M
for the defaults), forward and with ``--backward``, for ``noop`` and each
forward and backward codec::

    qcomm bench --link 1gbit --ops pooled,rs --sizes 16M,32M --codecs int8,mx4,bf16 \
        --backward --no-fbgemm --json bench.json
    python examples/planner_estimates.py bench.json [bench2.json ...] --plans /tmp/plans
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from typing import Any

import torch

import qcomm
from qcomm.benchmark.results import points

PAIRS = ("noop/noop", "int8/bf16", "mx4/bf16")
_A2A = qcomm.CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
_RS = qcomm.CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER


def _topology_cls() -> Any:
    from torchrec.distributed.planner.types import Topology

    return Topology


def _tables(args: argparse.Namespace) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=args.dim, num_embeddings=4096, feature_names=[f"f{t}"]
        )
        for t in range(args.tables)
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def _sharder(registry: Any) -> Any:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    # TorchRec's sharder leaves row-wise out on CPU, as the step benchmark's does not.
    class Sharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types: list[str] = super().sharding_types(compute_device_type)
            return types if "row_wise" in types else [*types, "row_wise"]

    return Sharder(qcomm_codecs_registry=registry)


def _constraints(tables: int, kinds: list[str]) -> dict[str, Any]:
    from torchrec.distributed.planner.types import ParameterConstraints

    # The bench's bags hold 1 to 7 ids: 4 on average.
    return {
        f"t{t}": ParameterConstraints(sharding_types=kinds, pooling_factors=[4.0])
        for t in range(tables)
    }


def _estimators(topology: Any, registry: Any, profile: Any, constraints: Any) -> dict[str, Any]:
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator

    return {
        "qcomm": qcomm.CodecPerfEstimator(
            topology, registry, profile=profile, constraints=constraints
        ),
        "torchrec": EmbeddingPerfEstimator(topology=topology, constraints=constraints),
    }


def _per_step_ms(args: argparse.Namespace, estimator: Any, registry: Any, kind: str) -> list[float]:
    # One rank's forward and backward milliseconds for the whole model
    # sharded `kind`: a table-wise rank holds tables / world tables, a
    # row-wise one a shard of every table.
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    constraints = _constraints(1, [kind])
    topology = estimator._topology
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=args.batch, constraints=constraints, estimator=estimator
    )
    args_one = argparse.Namespace(**{**vars(args), "tables": 1})
    (option,) = enumerator.enumerate(_tables(args_one), [_sharder(registry)])
    perf = option.shards[0].perf
    count = args.tables // args.world_size if kind == "table_wise" else args.tables
    return [count * perf.fwd_comms, count * perf.bwd_comms]


def _measured_ms(rows: list[Any], op: Any, size: int, pair: str) -> list[float | None]:
    forward, backward = pair.split("/")

    def latency(codec: str, passes: str) -> float | None:
        for p in rows:
            if (p.op, p.impl, p.codec, p.passes, p.size_bytes) == (
                op.value,
                "qcomm",
                codec,
                passes,
                size,
            ) and p.latency_s:
                return float(p.latency_s)
        return None

    fwd = latency(forward, "fwd")
    both, alone = latency(backward, "fwd+bwd"), latency(backward, "fwd")
    bwd = both - alone if both is not None and alone is not None else None
    return [None if v is None else 1e3 * v for v in (fwd, bwd)]


def _plan(
    args: argparse.Namespace, name: str, profile: Any, topology: Any, registry: Any
) -> dict[str, str]:
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

    constraints = _constraints(args.tables, ["table_wise", "row_wise", "column_wise"])
    estimators = _estimators(topology, registry, profile, constraints)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=args.batch,
        constraints=constraints,
        estimator=[estimators[name], EmbeddingStorageEstimator(topology, constraints=constraints)],
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=args.batch, enumerator=enumerator, constraints=constraints
    )
    return qcomm.plan_specs(planner.plan(_tables(args), [_sharder(registry)]))


def _rows(args: argparse.Namespace, path: str) -> dict[tuple[str, str], list[list[float | None]]]:
    # Each (sharding, pair)'s forward and backward milliseconds: qcomm's
    # estimate, TorchRec's on the measured link, on its default one, measured.
    with open(path) as f:
        data = json.load(f)
    profile = qcomm.profile_from_bench(data)
    rows = points(data)
    # One rank per host, as the bench's --link runs without --ranks-per-host.
    topology = qcomm.planner_topology(
        args.world_size, compute_device="cpu", local_world_size=1, profile=profile
    )
    default = qcomm.planner_topology(args.world_size, compute_device="cpu", local_world_size=1)
    print(f"{path}: link {profile.inter_host_Bps / 1e6:.1f} MB/s; codecs (GB/s encode/decode): "
          + ", ".join(f"{n} {profile.encode_Bps[n] / 1e9:.2f}/{profile.decode_Bps.get(n, 0) / 1e9:.2f}"
                      for n in sorted(profile.encode_Bps) if n != "noop")
          + f"; load {data['meta'].get('load_before')}")  # fmt: skip
    elements = args.batch * args.world_size * args.dim * 4
    out: dict[tuple[str, str], list[list[float | None]]] = {}
    for kind, op, size in (
        ("table_wise", _A2A, elements * args.tables // args.world_size),
        ("row_wise", _RS, elements * args.tables),
    ):
        for pair in PAIRS:
            registry = qcomm.build_registry({op.name: pair}, allow_unsummable_reduce_scatter=True)
            ours = _estimators(topology, registry, profile, None)["qcomm"]
            own = _estimators(topology, registry, profile, None)["torchrec"]
            own_default = _estimators(default, registry, profile, None)["torchrec"]
            cells: list[list[float | None]] = [
                list(_per_step_ms(args, e, registry, kind)) for e in (ours, own, own_default)
            ]
            out[kind, pair] = [*cells, _measured_ms(rows, op, size, pair)]
    return out


def _median(values: list[float | None], digits: int = 1) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "-"
    mid = statistics.median(known)
    if len(known) == 1 or known[0] == known[-1]:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({known[0]:.{digits}f}-{known[-1]:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "bench", nargs="+", help="qcomm bench --json files (see above): one per run"
    )
    parser.add_argument("--tables", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--plan-tables", type=int, default=3, help="the tables the plans are for")
    parser.add_argument(
        "--plan-registry",
        default="pooled_embeddings_all_to_all=int8/bf16,pooled_embeddings_reduce_scatter=bf16/bf16",
        help="the registry the plans are for (default: the bench's advice at 1 Gbit/s)",
    )
    parser.add_argument("--plans", help="folder to write each estimator's plan to (JSON)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    runs = [_rows(args, path) for path in args.bench]
    print("ms per step of one rank, median (range) over the runs, forward | backward:")
    names = ("qcomm", "TorchRec, measured link", "TorchRec, default link", "measured")
    for key in runs[0]:
        print(f"  {key[0]} {key[1]}")
        for i, name in enumerate(names):
            fwd, bwd = ([run[key][i][j] for run in runs] for j in (0, 1))
            line = f"    {name:24} {_median(fwd):>22} | {_median(bwd):>22}"
            if i < 3:
                ratios = [
                    [
                        e / m if e is not None and m else None
                        for e, m in zip(run[key][i], run[key][3], strict=True)
                    ]
                    for run in runs
                ]
                line += "   est/measured " + " | ".join(
                    _median([r[j] for r in ratios], 2) for j in (0, 1)
                )
            print(line)
    if args.plans:
        os.makedirs(args.plans, exist_ok=True)
        with open(args.bench[0]) as f:
            profile = qcomm.profile_from_bench(json.load(f))
        registry = qcomm.build_registry(args.plan_registry, allow_unsummable_reduce_scatter=True)
        plan_args = argparse.Namespace(**{**vars(args), "tables": args.plan_tables})
        topologies = {
            "qcomm": qcomm.planner_topology(
                args.world_size, compute_device="cpu", local_world_size=1, profile=profile
            ),
            # What TorchRec plans with by default: its own estimator and rates.
            "torchrec": _topology_cls()(world_size=args.world_size, compute_device="cpu"),
        }
        for name, topo in topologies.items():
            specs = _plan(plan_args, name, profile, topo, registry)
            path = os.path.join(args.plans, f"{name}.json")
            with open(path, "w") as f:
                json.dump(specs, f, indent=1)
            print(f"plan of {name}'s estimator ({path}): {specs}")


if __name__ == "__main__":
    main()
