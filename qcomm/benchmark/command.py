r"""
The ``qcomm bench`` command: its options (:func:`add_bench_arguments`), the
run's settings from them (:func:`config_from_args`) and the run
(:func:`run_bench`). What it measures and how to read it: :doc:`/bench`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from qcomm import config as qcomm_config
from qcomm.benchmark.advice import DEFAULT_MAX_ERROR, parse_max_error, read_loss_gaps
from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.options import (
    QUICK_SIZES,
    TRAIN_COMPILE_BACKENDS,
    TRAIN_DEFAULTS,
    TRAIN_LOOPS,
    TRAIN_MLP_DEFAULTS,
    TRAIN_MLP_QUICK,
    TRAIN_MODELS,
    TRAIN_QUICK,
    TRAIN_SHARDINGS,
    TRAIN_WARM_UP_STEPS,
    BenchConfig,
    check_spec,
    format_size,
    parse_number,
    parse_ops,
    parse_size,
    parse_sizes,
    split_codec_list,
)
from qcomm.benchmark.train_plan import read_plan
from qcomm.config import launch_env
from qcomm.discovery import available_codecs, load_codec
from qcomm.errors import CodecError
from qcomm.specs import parse_host_spec

__all__ = ["add_bench_arguments", "config_from_args", "run_bench"]

#: where examples/train_dlrm.py writes its results by default
DEFAULT_TRAINING_RESULTS = "out/results.json"

# Five rounds even so: the advice tells codecs apart by the rounds' spread.
_QUICK: dict[str, Any] = {"budget": 0.02, "codec_bytes": 1 << 20, "max_calls": 20, "rounds": 5}
_QUICK_TRAIN_ROUNDS = 3


def _link_rate(text: str) -> str:
    parse_rate(text)  # raises on a malformed rate, naming --link
    return text.strip()


def _as_argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    # argparse prints an ArgumentTypeError's message as it is.
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, CodecError) as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    convert.__name__ = parse.__name__
    return convert


def _one_spec(text: str) -> list[str]:
    check_spec(text)  # raises on a malformed spec, naming it
    return [text.strip()]


def _number(option: str, kind: type[float] | type[int], low: float, high: float) -> Any:
    def convert(text: str) -> Any:
        return parse_number(text, option, kind, low, high)

    convert.__name__ = kind.__name__
    return _as_argument(convert)


def _train_default(key: str) -> str:
    # The help's default of a --train-* option, per model where both take it.
    models = [("dlrm", TRAIN_DEFAULTS, TRAIN_QUICK), ("mlp", TRAIN_MLP_DEFAULTS, TRAIN_MLP_QUICK)]
    mine = [(name, plain[key], quick[key]) for name, plain, quick in models if key in plain]
    if len(mine) == 1:
        return f"Default: {mine[0][1]} (--quick: {mine[0][2]})"
    plain = ", ".join(f"{name} {value}" for name, value, _ in mine)
    quick = ", ".join(f"{name} {value}" for name, _, value in mine)
    return f"Default: {plain} (--quick: {quick})"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    r"""
    add_bench_arguments(parser: argparse.ArgumentParser) -> None

    Adds the options of ``qcomm bench`` to a parser.

    Args:
        parser (argparse.ArgumentParser): the sub-command's parser.

    Examples::

        >>> import argparse
        >>> parser = argparse.ArgumentParser()
        >>> add_bench_arguments(parser)
        >>> parser.parse_args(["--codecs", "int8:row_dim=64,fp16", "--codec", "mx4"]).codecs
        [['int8:row_dim=64', 'fp16'], ['mx4']]
    """
    parser.description = (
        "Measure every codec (or those given): encode/decode throughput against a "
        "memory-copy roofline, wire size, error against float32, break-even link "
        "bandwidth, and the three collectives over message sizes. Without a launcher "
        "it spawns --world-size local gloo ranks; under torchrun it uses the "
        "launcher's ranks (NCCL on CUDA)."
    )
    _add_measure_arguments(parser)
    _add_run_arguments(parser)
    _add_advice_arguments(parser)
    _add_timing_arguments(parser)
    _add_train_arguments(parser)


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """What to measure, and on how many ranks."""
    parser.add_argument(
        "--codecs",
        action="append",
        type=_as_argument(split_codec_list),
        metavar="SPECS",
        help="codec specs separated by ',' or ';', e.g. 'int8:row_dim=64,fp16' "
        "(an item 'key=value' continues the options of the spec before it; ';' always "
        "separates); repeatable. Default: every discovered codec. noop is always measured.",
    )
    parser.add_argument(
        "--codec",
        dest="codecs",
        action="append",
        type=_as_argument(_one_spec),
        metavar="SPEC",
        help="one codec spec, commas belonging to its options; repeatable",
    )
    parser.add_argument(
        "--sizes",
        type=_as_argument(parse_sizes),
        metavar="SIZES",
        help="message sizes per rank (float32 bytes), e.g. 64K,1M,64M. "
        "Default: 64K,256K,1M,4M,16M,64M (--quick: 64K,1M)",
    )
    parser.add_argument(
        "--ops",
        type=_as_argument(parse_ops),
        metavar="OPS",
        help="collectives: pooled (a2a), reduce_scatter (rs), sequence (seq), or CommOp "
        "names; and all_reduce (ar), the DDP hook's all-reduce beside PyTorch's hooks. "
        "Default: the three embedding collectives",
    )
    parser.add_argument(
        "--world-size",
        type=_number("--world-size", int, 1, 1024),
        metavar="N",
        help="local ranks to spawn without a launcher (at least 2). Default: 2",
    )
    parser.add_argument(
        "--ranks-per-host",
        type=_number("--ranks-per-host", int, 1, 1024),
        metavar="K",
        help="emulate hosts of K ranks each: ranks r with the same r // K share one (every "
        "rank gets QCOMM_RANKS_PER_HOST=K, which codecs by host such as "
        "'same_host=noop+other_host=int8' follow), and with --link a host's ranks share one "
        "network namespace, talking over its loopback, with the shaped link between hosts. "
        "A divisor of the world size that leaves at least 2 hosts. Default: 1 for local ranks",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: sizes 64K,1M, a 1 MiB codec tensor, short timing budgets",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the figures go, what is left out, how long and on what the run measures."""
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument(
        "--plot", metavar="PATH", help="draw bandwidth and error plots to this PNG (matplotlib)"
    )
    parser.add_argument(
        "--no-fbgemm",
        dest="fbgemm",
        action="store_false",
        help="leave out fbgemm's codecs and TorchRec's all-to-all",
    )
    parser.add_argument(
        "--codec-size",
        type=_as_argument(parse_size),
        metavar="SIZE",
        help="float32 bytes of the tensor each codec encodes. Default: 16M (--quick: 1M)",
    )
    parser.add_argument(
        "--budget",
        type=_number("--budget", float, 1e-4, 3600),
        metavar="SECONDS",
        help="timed seconds per measurement; more repetitions, steadier figures. "
        "Default: 0.25 (--quick: 0.02)",
    )
    parser.add_argument(
        "--timeout",
        type=_number("--timeout", float, 0.1, 86400),
        default=120.0,
        metavar="SECONDS",
        help="seconds a collective may wait for its peers; past it the measurement counts "
        "as failed, and a rank silent for twice as long plus a minute ends the run. "
        "Default: 120",
    )
    parser.add_argument(
        "--seed",
        type=_number("--seed", int, 0, 2**32 - 1),
        default=0,
        help="seed of the inputs, 0 to 2**32-1. Default: 0",
    )
    parser.add_argument(
        "--link",
        type=_as_argument(_link_rate),
        metavar="RATE",
        help="run the local ranks over an emulated link of this rate in each direction "
        "(e.g. 1gbit, 10gbit, 100mbit): a network namespace per rank, veth devices "
        "shaped with tc; needs root or CAP_NET_ADMIN and CAP_SYS_ADMIN. The report gives the link's measured throughput and "
        "each collective's time against the link's bound",
    )


def _add_advice_arguments(parser: argparse.ArgumentParser) -> None:
    """The advice's link rate, error budget, data scale and training results."""
    parser.add_argument(
        "--link-gbps",
        type=_number("--link-gbps", float, 1e-3, 1e6),
        metavar="N",
        help="your cluster's link rate in Gbit/s (each direction, per rank): the report "
        "recommends a codec pair for it, with its expected speed-up and error. "
        "Default: the --link rate, else advice for 1, 10 and 100 Gbit/s",
    )
    parser.add_argument(
        "--max-error",
        metavar="E",
        help="the advice's error budget: the largest RMS error, relative to the data's, a "
        "recommended codec may have (e.g. 1e-2), or a codec to be as good as (e.g. bf16). "
        f"Default: {DEFAULT_MAX_ERROR:g}, and no codec whose loss gap in the training "
        "example's results (--training-results) is significant",
    )
    parser.add_argument(
        "--data-scale",
        type=_number("--data-scale", float, 1e-30, 1e30),
        metavar="S",
        help="the typical magnitude of your data (its standard deviation): the codecs' "
        "errors are measured on standard normal data times S, since a cast's error depends "
        "on it (fp16 loses values under 6e-5 to its subnormal range). Default: 1",
    )
    parser.add_argument(
        "--training-results",
        metavar="PATH",
        help="the results.json of examples/train_dlrm.py: the advice shows each codec's "
        f"held-out loss gap from it. Default: {DEFAULT_TRAINING_RESULTS} if it exists",
    )


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """How the collectives are timed: passes, rounds, chunks."""
    parser.add_argument(
        "--backward",
        action="store_true",
        help="also time every collective's forward and backward pass together",
    )
    parser.add_argument(
        "--rounds",
        type=_number("--rounds", int, 1, 1000),
        metavar="N",
        help="timed rounds per collective and size; the series take turns within each "
        "round, and the median round is reported with the spread. Default: 5",
    )
    parser.add_argument(
        "--chunk-size",
        type=_as_argument(parse_size),
        metavar="SIZE",
        help="qcomm's pipeline chunk (float32 bytes per message), e.g. 1M. Default: automatic",
    )


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of --train and its models, and of --profile."""
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the usual figures: where the time of a qcomm call goes, by phase "
        "(arguments, layout, status, transport, encode, decode, ...), beside TorchRec's call "
        "and the bare exchange, for every codec, size and collective given; set "
        "QCOMM_TRANSPORT to profile the other transport",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="instead of the collectives: time whole training steps of TorchRec's DLRM "
        "under DistributedModelParallel with no codec, TorchRec's codecs, qcomm's registries, "
        "qcomm's DDP hook and the advice's pick, and report step time, speed-ups, the "
        "communication share and the loss (needs TorchRec); or of an MLP (--train-model mlp)",
    )
    parser.add_argument(
        "--train-model",
        choices=TRAIN_MODELS,
        help="with --train: dlrm (TorchRec's DLRM, sharded) or mlp (a plain MLP under "
        "DistributedDataParallel with no comm hook, PyTorch's fp16_compress_hook and qcomm's "
        "int8 hook with error feedback, overlapped and synchronous) or fsdp (the mlp under "
        "FSDP2: float32, bf16 mixed precision and qcomm's int8 gradients with fp8 or int8 "
        "weights). Default: dlrm",
    )
    for key, low, high, what in (
        ("tables", 2, 1024, "dlrm's embedding tables"),
        ("dim", 4, 4096, "every dlrm table's embedding dimension, a multiple of 4"),
        ("layers", 1, 1024, "the mlp's hidden layers (Linear and ReLU)"),
        ("width", 1, 1 << 16, "the mlp's hidden layers' width, and its input features"),
        ("batch", 1, 1 << 20, "samples per rank and step"),
        ("steps", TRAIN_WARM_UP_STEPS + 1, 1 << 20, "training steps per series, the "
         f"{TRAIN_WARM_UP_STEPS} untimed warm-up steps included (at least one more per round)"),
    ):  # fmt: skip
        parser.add_argument(
            f"--train-{key}",
            type=_number(f"--train-{key}", int, low, high),
            metavar="N",
            help=f"with --train: {what}. {_train_default(key)}",
        )
    parser.add_argument(
        "--train-sharding",
        choices=TRAIN_SHARDINGS,
        help="with --train (dlrm): how the tables are sharded: mixed (the first half table-wise, "
        "the rest row-wise: the pooled all-to-all and the reduce-scatter), table_wise or "
        "row_wise. Default: mixed",
    )
    parser.add_argument(
        "--train-plan",
        metavar="FILE",
        help="with --train (dlrm): each table's sharding from a JSON file, as "
        "qcomm.planner.plan_specs writes a planner's plan (see the planner page). "
        "Replaces --train-sharding",
    )
    parser.add_argument(
        "--train-loop",
        choices=TRAIN_LOOPS,
        help="with --train (dlrm): the training loop of every series: pipeline (TorchRec's "
        "TrainPipelineSparseDist, which starts the next batch's input distribution during "
        "this one's step) or plain (forward, backward, optimizer, one batch at a time). "
        "Default: pipeline",
    )
    parser.add_argument(
        "--train-compile",
        choices=TRAIN_COMPILE_BACKENDS,
        help="with --train (dlrm): add compiled twins of the fp32, TorchRec int8/bf16 and qcomm "
        "int8/bf16 series, whose dense part (dense arch, interaction, over arch) runs under "
        "torch.compile with this backend; TorchRec's sharded embeddings stay eager. The "
        "warm-up steps compile. Default: none",
    )


def _advice_config(args: argparse.Namespace, config: BenchConfig) -> None:
    # The error budget is a number or a codec of the run; the training
    # example's results are read now, so that a bad file stops the run early.
    config.data_scale = args.data_scale or 1.0
    if args.max_error is not None:
        text = args.max_error.strip()
        if isinstance(budget := parse_max_error(text), str):
            known = config.codecs if config.codecs is not None else available_codecs()
            if budget not in [*known, "noop"]:
                raise ValueError(
                    f"--max-error: expected a relative RMS error such as 1e-2, or a codec of "
                    f"the run to be as good as ({', '.join(known)}), got {text!r}"
                )
        config.max_error = text
    path = args.training_results
    if path is None and os.path.exists(DEFAULT_TRAINING_RESULTS):
        path = DEFAULT_TRAINING_RESULTS
    if path is not None:
        config.loss_gaps = read_loss_gaps(path)
        config.training_results = path


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    r"""
    config_from_args(args: argparse.Namespace) -> BenchConfig

    The run's settings, with the ``--quick`` defaults where an option was
    not given.

    Args:
        args (argparse.Namespace): parsed by :func:`add_bench_arguments`.

    Raises:
        ValueError: naming the option, if a codec cannot be built, the world
            size or a size does not fit, or an output cannot be written.
    """
    quick: dict[str, Any] = dict(_QUICK) if args.quick else {}
    config = BenchConfig(quick=args.quick, fbgemm=args.fbgemm, timeout=args.timeout, seed=args.seed)
    config.command = list(sys.argv)
    if args.codecs:
        from qcomm.registry import load_pair  # torch: a run needs it anyway

        config.codecs = [spec for group in args.codecs for spec in group]
        for spec in config.codecs:
            # A codec the user named that cannot be built stops the run here,
            # before any rank starts, rather than after the whole benchmark.
            try:
                load_pair(spec) if parse_host_spec(spec) else load_codec(spec)
            except CodecError as err:
                raise ValueError(f"--codecs: {spec!r} cannot be used: {err}") from err
    if args.sizes:
        config.sizes = args.sizes
    elif args.quick:
        config.sizes = list(QUICK_SIZES)
    if args.ops:
        config.ops = [op.value for op in args.ops]
    config.budget = args.budget or quick.get("budget", config.budget)
    config.codec_bytes = args.codec_size or quick.get("codec_bytes", config.codec_bytes)
    config.max_calls = quick.get("max_calls", config.max_calls)
    config.rounds = args.rounds or quick.get("rounds", config.rounds)
    config.backward = args.backward
    config.chunk_bytes = args.chunk_size
    config.link = args.link
    config.link_gbps = args.link_gbps
    _advice_config(args, config)
    _train_config(args, config)
    if args.profile:
        if config.train:
            raise ValueError("--profile: profiles the collectives; leave out --train")
        if args.backward:
            raise ValueError("--profile: profiles the forward call; leave out --backward")
        config.profile = True
    from qcomm.benchmark.session import launcher_env  # torch: a run needs it anyway

    if launcher_env():
        if args.link:
            raise ValueError(
                "--link: emulates a link between local ranks; under a launcher the ranks "
                "already run on the real network, leave --link out"
            )
        launched = int(launch_env("WORLD_SIZE") or 0)
        if args.world_size is not None and args.world_size != launched:
            raise ValueError(
                f"--world-size: the launcher started {launched} ranks, got {args.world_size}; "
                f"leave it out under torchrun"
            )
        config.world_size = launched
    elif args.world_size is not None:
        if args.world_size < 2:
            raise ValueError(
                f"--world-size: expected at least 2 local ranks (a collective needs peers), "
                f"got {args.world_size}"
            )
        config.world_size = args.world_size
    config.ranks_per_host = _ranks_per_host(args.ranks_per_host, config.world_size)
    if config.train and args.train_plan is not None:
        # Read once the world size is known: the plan's ranks must be in it.
        config.train_plan = read_plan(args.train_plan, config.train_tables, config.world_size)
    local_ranks = int(launch_env("LOCAL_WORLD_SIZE") or config.world_size)
    if config.train:
        _check_train_memory(config, local_ranks)
    else:
        _check_memory(config, local_ranks)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot: matplotlib is not installed (pip install matplotlib)")
    # Checked now, not when the figures are written after the whole run.
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            _check_output(option, path)
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        raise ValueError(f"--plot: the same file as --json ({args.json!r}); give two names")
    config.json_path = os.path.abspath(args.json) if args.json else None
    config.plot_path = os.path.abspath(args.plot) if args.plot else None
    return config


def _ranks_per_host(given: int | None, world_size: int) -> int | None:
    """--ranks-per-host checked against the world size; not given, a launcher's layout, if any."""
    from qcomm.benchmark.session import launcher_env

    if given is None:
        if not launcher_env():
            return None
        # The launcher's layout, as qcomm's collectives read it
        # (QCOMM_RANKS_PER_HOST, else torchrun's LOCAL_WORLD_SIZE), if it
        # makes hosts of equal size; else the figures count every rank as a host.
        value = qcomm_config.get().ranks_per_host
        if value is None:
            return None
        equal = value >= 1 and world_size % value == 0 and world_size // value >= 2
        return value if equal else None
    fits = [k for k in range(1, world_size // 2 + 1) if world_size % k == 0]
    if given not in fits:
        raise ValueError(
            f"--ranks-per-host: expected a divisor of the world size {world_size} that leaves "
            f"at least 2 hosts ({', '.join(map(str, fits)) or 'none'}), got {given}"
        )
    return given


# A rank holds at least the shared input, its own input, the expected output
# and a gradient of every message size (and more for each series measured);
# measuring a codec, its input, a copy, the wire and the decoded tensor.
_TENSORS_PER_SIZE = 4


def _check_memory(config: BenchConfig, local_ranks: int) -> None:
    """Refuses sizes that this machine cannot hold on its local ranks."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    for option, size in (("--sizes", max(config.sizes)), ("--codec-size", config.codec_bytes)):
        need = size * _TENSORS_PER_SIZE * local_ranks
        if need > memory:
            raise ValueError(
                f"{option}: {format_size(size)} per rank needs at least {need / 2**30:.1f} GiB "
                f"of memory ({_TENSORS_PER_SIZE} tensors of that size on each of {local_ranks} "
                f"local ranks), and this machine has {memory / 2**30:.1f} GiB"
            )


# The --train-* options of one model only.
_MODEL_OPTIONS = {
    "dlrm": ("tables", "dim", "sharding", "plan", "loop", "compile"),
    "mlp": ("layers", "width"),
    "fsdp": ("layers", "width"),
}


def _train_config(args: argparse.Namespace, config: BenchConfig) -> None:
    """The settings of --train; refuses options that belong to the other mode or model."""
    keys = [*TRAIN_DEFAULTS, *(k for k in TRAIN_MLP_DEFAULTS if k not in TRAIN_DEFAULTS)]
    given = {key: getattr(args, f"train_{key}") for key in keys}
    if not args.train:
        extra = {
            "model": args.train_model,
            "sharding": args.train_sharding,
            "plan": args.train_plan,
            "loop": args.train_loop,
            "compile": args.train_compile,
        }
        for key, value in {**extra, **given}.items():
            if value is not None:
                raise ValueError(f"--train-{key}: applies to --train only; add --train")
        return
    others = {
        "--codecs": args.codecs,
        "--sizes": args.sizes,
        "--ops": args.ops,
        "--codec-size": args.codec_size,
        "--budget": args.budget,
        "--chunk-size": args.chunk_size,
        "--backward": args.backward or None,
        "--plot": args.plot,
    }
    for option, value in others.items():
        if value is not None:
            raise ValueError(
                f"{option}: measures the collectives on their own and does not apply to "
                f"--train; leave it out"
            )
    model = args.train_model or "dlrm"
    if args.quick and not args.rounds:
        # A smoke run of a few steps: three rounds, where the collectives take five.
        config.rounds = _QUICK_TRAIN_ROUNDS
    if model in ("mlp", "fsdp"):
        defaults = TRAIN_MLP_QUICK if args.quick else TRAIN_MLP_DEFAULTS
    else:
        defaults = TRAIN_QUICK if args.quick else TRAIN_DEFAULTS
    given_all = {
        **given,
        "sharding": args.train_sharding,
        "plan": args.train_plan,
        "loop": args.train_loop,
        "compile": args.train_compile,
    }
    for other, options in _MODEL_OPTIONS.items():
        for key in options:
            if other != model and key not in _MODEL_OPTIONS[model] and given_all[key] is not None:
                takers = " or ".join(m for m, keys in _MODEL_OPTIONS.items() if key in keys)
                raise ValueError(
                    f"--train-{key}: applies to --train-model {takers} only, and this run "
                    f"trains {model}; leave it out or give --train-model {other}"
                )
    if model in ("mlp", "fsdp"):
        # The MLP has neither TorchRec's codecs to leave out nor an advice to give.
        for option, value in (("--no-fbgemm", not args.fbgemm), ("--link-gbps", args.link_gbps)):
            if value not in (None, False):
                raise ValueError(
                    f"{option}: applies to the collectives and the DLRM of --train, not to "
                    f"--train-model {model}; leave it out"
                )
    config.train = True
    config.train_model = model
    # The model's sizes: given, else its defaults (the DLRM's after the check below).
    for key in ("batch", "steps", *(_MODEL_OPTIONS[model] if model != "dlrm" else ())):
        setattr(config, f"train_{key}", given[key] or defaults[key])
    if model == "dlrm":
        missing = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"--train: needs {' and '.join(missing)}, not installed here "
                f"(see CONTRIBUTING.md, 'Versions'); --train-model mlp does not"
            )
        for key in ("tables", "dim"):
            setattr(config, f"train_{key}", given[key] or defaults[key])
        config.train_sharding = args.train_sharding or "mixed"
        if args.train_plan is not None and args.train_sharding is not None:
            raise ValueError("--train-plan: shards every table; leave --train-sharding out")
        config.train_loop = args.train_loop or "pipeline"
        config.train_compile = args.train_compile
        if config.train_dim % 4:
            # fbgemm's embedding kernels take rows of whole 4-element groups.
            raise ValueError(f"--train-dim: expected a multiple of 4, got {config.train_dim}")
    least = TRAIN_WARM_UP_STEPS + config.rounds
    if config.train_steps < least:
        raise ValueError(
            f"--train-steps: expected at least {least} ({TRAIN_WARM_UP_STEPS} warm-up steps, "
            f"then one per round of --rounds {config.rounds}), got {config.train_steps}"
        )


def _check_train_memory(config: BenchConfig, local_ranks: int) -> None:
    """Refuses a --train model that this machine cannot hold on its local ranks."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    # The model says what it needs (it imports torch: only --train asks).
    if config.train_model == "mlp":
        from qcomm.benchmark.train_mlp import Mlp

        estimate = Mlp().memory(config)
    elif config.train_model == "fsdp":
        from qcomm.benchmark.train_fsdp import Fsdp

        estimate = Fsdp().memory(config)
    else:
        from qcomm.benchmark.train import Dlrm

        estimate = Dlrm().memory(config)
    need = estimate.bytes_per_rank * local_ranks
    if need > memory:
        raise ValueError(
            f"{estimate.options}: {estimate.what} need about {need / 2**30:.1f} GiB on "
            f"{local_ranks} local ranks, and this machine has {memory / 2**30:.1f} GiB"
        )


def _check_output(option: str, path: str) -> None:
    """Refuses an output path that cannot be written; leaves nothing behind."""
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path!r} is a folder; give a file name in it")
    # The report is written through a symbolic link, so its target is what
    # must be writable; the link itself is never touched.
    target = os.path.realpath(path)
    link = f" (a link to {target!r})" if target != os.path.abspath(path) else ""
    if not os.path.isdir(os.path.dirname(target)):
        raise ValueError(f"{option}: the folder of {path!r}{link} does not exist")
    try:
        if os.path.exists(target):
            with open(target, "a"):
                pass
        else:
            # O_EXCL: a file someone else creates meanwhile is theirs, not removed.
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.remove(target)
    except OSError as err:
        raise ValueError(f"{option}: cannot write {path!r}{link}: {err.strerror or err}") from None


def run_bench(args: argparse.Namespace) -> int:
    r"""
    run_bench(args: argparse.Namespace) -> int

    Runs ``qcomm bench``: on the launcher's ranks under ``torchrun``,
    otherwise on ``--world-size`` spawned local ranks.

    Args:
        args (argparse.Namespace): the parsed options.

    Returns:
        int: ``0`` when every codec ran; ``1`` when the run completed but a
        qcomm codec failed somewhere (shown in the table); ``2`` when the
        options are wrong or the run could not complete.
    """
    # The measuring machinery loads only for a run: `qcomm list` and
    # `qcomm check` build this command's parser too.
    from qcomm.benchmark.launch import run_distributed, spawn_local
    from qcomm.benchmark.session import EXIT_CODEC_FAILED, launcher_env

    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"qcomm bench: error: {err}", file=sys.stderr)
        return 2
    if not launcher_env():
        return spawn_local(config)
    status = run_distributed(config)
    return 1 if status == EXIT_CODEC_FAILED else status
