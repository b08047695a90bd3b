"""Where the benchmark's names live: its own enums in the benchmark, not in
qcomm.ops (whose CommOp is public), and the command line reaching the
benchmark through public names only."""

from __future__ import annotations

import ast
import pathlib

import qcomm.cli
import qcomm.ops
from qcomm import CommOp
from qcomm.benchmark.options import BenchOp, DenseOp, parse_ops


def test_the_bench_enums_live_in_the_benchmark() -> None:
    assert qcomm.ops.__all__ == ["CommOp"] and qcomm.ops.CommOp is CommOp
    assert not hasattr(qcomm.ops, "DenseOp") and not hasattr(qcomm.ops, "BenchOp")
    assert parse_ops("a2a,ar") == [CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, DenseOp.ALL_REDUCE]
    assert BenchOp == CommOp | DenseOp


def test_the_command_line_imports_no_private_name_of_the_benchmark() -> None:
    tree = ast.parse(pathlib.Path(qcomm.cli.__file__).read_text())
    imported = [
        (node.module or "", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qcomm.benchmark")
        for alias in node.names
    ]
    assert len(imported) >= 4  # it reaches the benchmark (the names checked below)
    private = [
        f"{module}.{name}"
        for module, name in imported
        if name.startswith("_") or any(part.startswith("_") for part in module.split("."))
    ]
    assert private == []


def test_the_benchmark_reads_and_sets_no_environment_variable_itself() -> None:
    # Launcher variables through qcomm.config.launch_env, children's through
    # child_env, qcomm's settings through qcomm.config.
    import qcomm.benchmark

    files = sorted(pathlib.Path(qcomm.benchmark.__file__).parent.glob("*.py"))
    assert len(files) > 20
    found = [
        f"{path.name}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "os.environ" in line
    ]
    assert found == []
