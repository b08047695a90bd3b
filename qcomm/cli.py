r"""
The ``qcomm`` console script: ``list``, ``check`` and ``bench``.

``qcomm list`` reads package metadata only; ``--details`` imports each codec
to show what it declares. ``qcomm check SPEC`` runs the conformance kit
(:mod:`qcomm.testing`); ``qcomm bench`` measures codecs and collectives
(:mod:`qcomm.bench`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qcomm.registry import codec_entries, load_codec
from qcomm.types import CodecError, CodecInfo, codec_info


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe_bound(info: CodecInfo) -> str:
    scale = "|x|" if info.error_block == 1 else f"max|block of {info.error_block}|"
    text = f"{info.rel_error_bound:.3g} x {scale}"
    if info.abs_error_bound:
        text += f" + {info.abs_error_bound:.3g}"
    if info.max_abs_input != float("inf"):
        text += f" for |x| <= {info.max_abs_input:.3g}"
    return text


def _list(args: argparse.Namespace) -> int:
    rows = []
    for name, entries in codec_entries().items():
        dist = "; ".join(f"{e.distribution} {e.version}" for e in entries)
        row = [name, dist]
        if args.details:
            try:
                info = codec_info(load_codec(name))
                row += [
                    f"{info.bits_per_element:g}",
                    "yes" if info.summable else "no",
                    _describe_bound(info),
                ]
            except CodecError as err:
                row += ["error", "", str(err)]
        rows.append(row)
    header = ["codec", "distribution"]
    if args.details:
        header += ["bits/elem", "summable", "error bound"]
    print(_format_table(header, rows))
    return 0


def _check(args: argparse.Namespace) -> int:
    from qcomm.testing import check_codec

    status = 0
    for spec in args.specs:
        try:
            report = check_codec(load_codec(spec))
        except (CodecError, AssertionError) as err:
            print(f"FAIL {spec}: {err}")
            status = 1
        else:
            print(f"ok   {spec}: {report.summary}")
    return status


def _bench(args: argparse.Namespace) -> int:
    from qcomm.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    r"""
    build_parser() -> argparse.ArgumentParser

    The argument parser of the ``qcomm`` command, with its three sub-commands.

    Returns:
        argparse.ArgumentParser: the parser.
    """
    parser = argparse.ArgumentParser(prog="qcomm", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_list = sub.add_parser("list", help="list the codecs installed (imports nothing)")
    p_list.add_argument(
        "--details", action="store_true", help="import each codec and show what it declares"
    )
    p_list.set_defaults(func=_list)

    p_check = sub.add_parser("check", help="run the conformance kit on codec specs")
    p_check.add_argument(
        "specs", nargs="+", metavar="SPEC", help="codec spec, e.g. int8:row_dim=64"
    )
    p_check.set_defaults(func=_check)

    p_bench = sub.add_parser("bench", help="measure codecs and collectives")
    from qcomm.bench import add_bench_arguments

    add_bench_arguments(p_bench)
    p_bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    r"""
    main(argv: Sequence[str] | None = None) -> int

    Entry point of the ``qcomm`` console script.

    Args:
        argv (Sequence[str], optional): arguments; ``sys.argv[1:]`` when ``None``.
            Default: ``None``.

    Returns:
        int: the exit status.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CodecError as err:
        print(f"qcomm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
