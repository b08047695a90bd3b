"""`qcomm bench` as the tests run it: its options parsed as the command does
(:func:`bench_config`), and a quick ``--train`` run on 2 local ranks with its
JSON read back strictly (:func:`spawn_train`), whatever launcher variables
the test process has."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from qcomm.benchmark.command import config_from_args
from qcomm.benchmark.launch import spawn_local
from qcomm.benchmark.options import BenchConfig
from qcomm.cli import build_parser

__all__ = ["LAUNCHER_VARS", "bench_config", "spawn_train", "strict_json"]

#: what a launcher (torchrun) sets, which would make the command join it
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE")


def bench_config(*argv: str) -> BenchConfig:
    """The settings ``qcomm bench ARGV`` runs with."""
    return config_from_args(build_parser().parse_args(["bench", *argv]))


def strict_json(path: pathlib.Path) -> Any:
    """A JSON file, refusing NaN and infinities (the report writes ``null`` for them)."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def spawn_train(
    tmp_path_factory: pytest.TempPathFactory, *argv: str
) -> tuple[BenchConfig, int, Any]:
    """``qcomm bench --train --quick ARGV`` on 2 local ranks: its settings, exit status and JSON."""
    out = tmp_path_factory.mktemp("train") / "train.json"
    with pytest.MonkeyPatch.context() as mp:
        for name in LAUNCHER_VARS:
            mp.delenv(name, raising=False)
        config = bench_config("--train", "--quick", *argv, "--json", str(out))
        status = spawn_local(config)
    return config, status, strict_json(out)
