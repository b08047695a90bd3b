r"""
The tables' sharding of ``qcomm bench --train --train-plan FILE`` (see
:doc:`/planner`): a JSON object from each table's name (``t0``, ``t1``, ...)
to its sharding as :func:`~qcomm.plan_specs` writes it, so that the
step benchmark runs the plan a planner made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["parse_plan", "read_plan", "table_generators"]

_KINDS = ("table_wise", "row_wise", "column_wise")


def parse_plan(data: Any, tables: int, world_size: int) -> dict[str, str]:
    r"""
    parse_plan(data: Any, tables: int, world_size: int) -> dict[str, str]

    The checked plan of the ``tables`` tables of a DLRM on ``world_size`` ranks.

    Args:
        data (Any): the JSON's content.
        tables (int): the model's tables, ``t0`` to ``t{tables - 1}``.
        world_size (int): the ranks.

    Returns:
        dict[str, str]: each table's sharding, by table name.

    Raises:
        ValueError: naming ``--train-plan`` and the table, for a plan that
            misses a table, names another, or gives a sharding or rank that
            is not one.

    Examples::

        >>> parse_plan({"t0": "table_wise:1", "t1": "row_wise"}, 2, 2)
        {'t0': 'table_wise:1', 't1': 'row_wise'}
    """
    if not isinstance(data, Mapping):
        raise ValueError(
            f"--train-plan: expected a JSON object from table names to shardings, got {data!r}"
        )
    names = [f"t{t}" for t in range(tables)]
    if sorted(data) != sorted(names):
        raise ValueError(
            f"--train-plan: expected the tables {', '.join(names)}, got {', '.join(map(str, data))}"
        )
    plan = {}
    for name in names:
        spec = data[name]
        kind, _, ranks = str(spec).partition(":")
        wants_ranks = kind in ("table_wise", "column_wise")
        try:
            parsed = [int(r) for r in ranks.split(",")] if ranks else []
        except ValueError:
            parsed = [-1]
        if (
            kind not in _KINDS
            or wants_ranks != bool(parsed)
            or (kind == "table_wise" and len(parsed) != 1)
            or any(not 0 <= r < world_size for r in parsed)
        ):
            raise ValueError(
                f"--train-plan: table {name}: expected table_wise:RANK, column_wise:RANK,... "
                f"or row_wise with ranks in [0, {world_size}), got {spec!r}"
            )
        plan[name] = spec
    return plan


def read_plan(path: str, tables: int, world_size: int) -> dict[str, str]:
    r"""
    read_plan(path: str, tables: int, world_size: int) -> dict[str, str]

    The plan in the JSON file ``path`` (:func:`parse_plan`).

    Args:
        path (str): the file.
        tables (int): the model's tables.
        world_size (int): the ranks.

    Returns:
        dict[str, str]: each table's sharding, by table name.

    Raises:
        ValueError: for a file that cannot be read or a plan that does not fit.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--train-plan: cannot read {path!r}: {err}") from None
    return parse_plan(data, tables, world_size)


def table_generators(plan: Mapping[str, str]) -> dict[str, Any]:
    r"""
    table_generators(plan: Mapping[str, str]) -> dict[str, Any]

    TorchRec's sharding of each table of ``plan`` (a
    ``ParameterShardingGenerator``), for
    ``construct_module_sharding_plan``, with the fused kernel.

    Args:
        plan (Mapping[str, str]): the checked plan (:func:`parse_plan`).

    Returns:
        dict[str, Any]: each table's generator, by table name.
    """
    from torchrec.distributed.sharding_plan import (
        column_wise,
        row_wise,
        table_wise,
    )

    out = {}
    for name, spec in plan.items():
        kind, _, ranks = spec.partition(":")
        parsed = [int(r) for r in ranks.split(",")] if ranks else []
        if kind == "table_wise":
            out[name] = table_wise(rank=parsed[0], compute_kernel="fused")
        elif kind == "column_wise":
            out[name] = column_wise(ranks=parsed, compute_kernel="fused")
        else:
            out[name] = row_wise(compute_kernel="fused")
    return out
