r"""
``qcomm bench``: what each codec buys in bandwidth and costs in accuracy.
"""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    r"""
    add_bench_arguments(parser: argparse.ArgumentParser) -> None

    Adds the options of ``qcomm bench`` to ``parser``.

    Args:
        parser (argparse.ArgumentParser): the ``bench`` sub-command's parser.
    """


def run_bench(args: argparse.Namespace) -> int:
    r"""
    run_bench(args: argparse.Namespace) -> int

    Runs ``qcomm bench``.

    Args:
        args (argparse.Namespace): parsed options.

    Returns:
        int: the exit status.
    """
    raise NotImplementedError("qcomm bench is not written yet (issue 6)")
