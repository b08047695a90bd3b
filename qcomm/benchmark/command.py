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

from qcomm.benchmark.link import parse_rate
from qcomm.benchmark.options import (
    QUICK_SIZES,
    BenchConfig,
    format_size,
    parse_number,
    parse_ops,
    parse_size,
    parse_sizes,
    split_codec_list,
)
from qcomm.benchmark.session import EXIT_CODEC_FAILED, launcher_env
from qcomm.discovery import load_codec
from qcomm.specs import parse_codec_spec
from qcomm.types import CodecError

__all__ = ["add_bench_arguments", "config_from_args", "run_bench"]

_QUICK: dict[str, Any] = {"budget": 0.02, "codec_bytes": 1 << 20, "max_calls": 20, "rounds": 3}


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
    parse_codec_spec(text)  # raises on a malformed spec, naming it
    return [text.strip()]


def _number(option: str, kind: type[float] | type[int], low: float, high: float) -> Any:
    def convert(text: str) -> Any:
        return parse_number(text, option, kind, low, high)

    convert.__name__ = kind.__name__
    return _as_argument(convert)


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
        "--quick",
        action="store_true",
        help="smoke test: sizes 64K,1M, a 1 MiB codec tensor, short timing budgets",
    )
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
        "shaped with tc; needs root. The report gives the link's measured throughput and "
        "each collective's time against the link's bound",
    )
    parser.add_argument(
        "--link-gbps",
        type=_number("--link-gbps", float, 1e-3, 1e6),
        metavar="N",
        help="your cluster's link rate in Gbit/s (each direction, per rank): the report "
        "recommends a codec pair for it, with its expected speed-up and error. "
        "Default: the --link rate, else advice for 1, 10 and 100 Gbit/s",
    )
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
        "round, and the median round is reported with the spread. Default: 5 (--quick: 3)",
    )
    parser.add_argument(
        "--chunk-size",
        type=_as_argument(parse_size),
        metavar="SIZE",
        help="qcomm's pipeline chunk (float32 bytes per message), e.g. 1M. Default: automatic",
    )


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
        config.codecs = [spec for group in args.codecs for spec in group]
        for spec in config.codecs:
            # A codec the user named that cannot be built stops the run here,
            # before any rank starts, rather than after the whole benchmark.
            try:
                load_codec(spec)
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
    if launcher_env():
        if args.link:
            raise ValueError(
                "--link: emulates a link between local ranks; under a launcher the ranks "
                "already run on the real network, leave --link out"
            )
        launched = int(os.environ["WORLD_SIZE"])
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
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
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

    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"qcomm bench: error: {err}", file=sys.stderr)
        return 2
    if not launcher_env():
        return spawn_local(config)
    status = run_distributed(config)
    return 1 if status == EXIT_CODEC_FAILED else status
