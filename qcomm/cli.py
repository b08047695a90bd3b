r"""
The ``qcomm`` console script: ``list``, ``check`` and ``bench``.

``qcomm list`` reads package metadata only; ``--details`` imports each codec
to show what it declares. ``qcomm check SPEC`` runs the conformance kit
(:mod:`qcomm.testing`) in a worker process, each rule with a deadline
(``--timeout``), so that a codec that hangs or crashes fails the check rather
than stopping it; ``qcomm bench`` measures codecs and collectives
(:mod:`qcomm.benchmark.command`).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from qcomm._table import format_table
from qcomm.benchmark.children import describe, end_with_parent, exit_status, stop_on_signals
from qcomm.benchmark.command import add_bench_arguments, run_bench
from qcomm.benchmark.options import parse_number
from qcomm.discovery import codec_entries, load_codec
from qcomm.errors import CodecError

if TYPE_CHECKING:  # the front end imports no torch: ``qcomm list`` answers at once
    from qcomm.types import CodecInfo


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
    if args.details:  # only --details loads codecs, and torch with them
        from qcomm.types import codec_info
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
    print(format_table(header, rows))
    return 0


# Seconds a fresh check process may take to import torch and qcomm.
_STARTUP_S = 120.0
_DEFAULT_TIMEOUT_S = 60.0


def _check_worker(conn: Connection, parent: int) -> None:
    """Runs the kit on each spec it receives, saying which step it is at."""
    # A codec that hangs never returns to Python: the kernel ends the worker
    # with the command, and Ctrl-C reaches the command, which kills it.
    end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from qcomm.testing import check_codec

    conn.send(("ready", ""))
    for spec in iter(conn.recv, None):
        conn.send(("step", "loading the codec"))
        try:
            codec = load_codec(spec)
            report = check_codec(codec, progress=lambda rule: conn.send(("step", f"rule {rule!r}")))
        except Exception as err:
            text = str(err) if isinstance(err, CodecError) else f"{type(err).__name__}: {err}"
            conn.send(("fail", text))
        else:
            conn.send(("ok", report.summary()))


def _start_worker() -> tuple[Any, Connection]:
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=_check_worker, args=(child, os.getpid()), daemon=True)
    process.start()
    child.close()
    return process, conn


def _check_one(process: Any, conn: Connection, spec: str, timeout: float) -> tuple[str, str]:
    """("ok" or "fail", text) from the worker; ("dead", why) if it hangs or ends first."""
    step, limit = "starting the check process", _STARTUP_S
    try:
        conn.send(spec)
    except OSError:
        return "dead", f"the check process ended (exit code {process.exitcode})"
    while conn.poll(limit):
        try:
            kind, text = conn.recv()
        except EOFError:
            process.join(5)
            return "dead", f"the check ended (exit code {process.exitcode}) during {step}"
        if kind not in ("ready", "step"):
            return kind, text
        step, limit = text or step, timeout
    return "dead", f"{step} did not finish within {limit:g} s (--timeout); the codec hangs"


def _check(args: argparse.Namespace) -> int:
    # The kit runs in a worker process: a codec call that never returns cannot
    # be interrupted in-thread, but a process can be killed, and a crash in a
    # codec's native code ends only the worker.
    status = 0
    worker = None
    try:
        for spec in args.specs:
            worker = worker or _start_worker()
            kind, text = _check_one(*worker, spec, args.timeout)
            if kind == "dead":
                worker[0].kill()
                worker[0].join()
                worker = None
            print(f"{'ok  ' if kind == 'ok' else 'FAIL'} {spec}: {text}", flush=True)
            status |= kind != "ok"
    except BaseException:
        # Interrupted or stopped: the worker may be stuck in the codec.
        if worker is not None:
            worker[0].kill()
        raise
    finally:
        if worker is not None:
            with contextlib.suppress(OSError):
                worker[1].send(None)
            worker[0].join(5)
            worker[0].kill()
    return status


def _timeout(text: str) -> float:
    try:
        return float(parse_number(text, "--timeout", float, 0.1, 86400))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def build_parser() -> argparse.ArgumentParser:
    r"""
    build_parser() -> argparse.ArgumentParser

    The argument parser of the ``qcomm`` command, with its three sub-commands.
    """
    parser = argparse.ArgumentParser(
        prog="qcomm",
        description="qcomm's console script: list the codecs installed, check a codec "
        "against the contract, measure codecs and collectives (bench).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_list = sub.add_parser(
        "list", help="list the codecs installed (imports no codec, and no torch)"
    )
    p_list.add_argument(
        "--details", action="store_true", help="import each codec and show what it declares"
    )
    p_list.set_defaults(func=_list)

    p_check = sub.add_parser("check", help="run the conformance kit on codec specs")
    p_check.add_argument(
        "specs", nargs="+", metavar="SPEC", help="codec spec, e.g. int8:row_dim=64"
    )
    p_check.add_argument(
        "--timeout",
        type=_timeout,
        default=_DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds each rule (and loading the codec) may take before the codec counts "
        f"as hung and the check fails, naming the rule. Default: {_DEFAULT_TIMEOUT_S:g}",
    )
    p_check.set_defaults(func=_check)

    p_bench = sub.add_parser("bench", help="measure codecs and collectives")
    add_bench_arguments(p_bench)
    p_bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    r"""
    main(argv: Sequence[str] | None = None) -> int

    Entry point of the ``qcomm`` console script: runs a command and returns
    its exit status.

    Args:
        argv (Sequence[str], optional): the arguments. Default: ``sys.argv[1:]``.

    Returns:
        int: the command's status; ``2`` for a codec error, and 128 plus the
        signal's number when Ctrl-C, SIGTERM or SIGHUP stopped it (after
        every worker and rank it started has ended).
    """
    args = build_parser().parse_args(argv)
    try:
        # SIGTERM and SIGHUP unwind like Ctrl-C, so that no worker or rank
        # outlives the command.
        with stop_on_signals():
            return int(args.func(args))
    except CodecError as err:
        print(f"qcomm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"qcomm: {describe(err)}", file=sys.stderr)
        return exit_status(err)


if __name__ == "__main__":
    sys.exit(main())
