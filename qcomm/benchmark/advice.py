r"""
The answer of ``qcomm bench``: which codec pair to use on a link of a given
rate, from the figures of one run (the JSON's content), by the rules of
:doc:`/bench` ("The answer"). The reduce-scatter takes only codecs whose wire
may be summed, because TorchRec sums it (:func:`~qcomm.build_registry`
refuses any other).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qcomm.benchmark.metrics import predicted_time
from qcomm.types import CommOp

__all__ = [
    "ADVICE_RATES",
    "Advice",
    "advice_rates",
    "advise",
    "expected_speedups",
    "registry_string",
    "speedup_at",
]

_BACKWARD = ("bf16", "fp16")
_SUMMABLE = ("noop", "fp16", "bf16")
# Below this expected gain the no-op codec stays: not worth an error.
_WORTH = 1.05
#: the link rates (Gbit/s each way) advised for when the run names none
ADVICE_RATES = [1.0, 10.0, 100.0]


@dataclasses.dataclass
class Advice:
    r"""
    The recommended codec pair of one collective on a link.

    Args:
        op (str): the collective, a :class:`~qcomm.CommOp` value.
        forward (str): the forward codec's spec.
        backward (str): the backward codec's spec.
        speedup (float): expected speed-up of forward and backward together
            over the no-op codec.
        forward_speedup (float): expected speed-up of the forward pass.
        max_rel_error (float): the forward codec's ``max_rel_error``.
        rms_rel_error (float): the forward codec's ``rms_rel_error``.
    """

    op: str
    forward: str
    backward: str
    speedup: float
    forward_speedup: float
    max_rel_error: float
    rms_rel_error: float
    #: ``forward/backward``, as a registry string writes it
    pair: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.pair = f"{self.forward}/{self.backward}"


def _models(results: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    # op -> label -> (link bytes, seconds without a link limit), forward pass
    # at the largest size. Under a launcher the times are those of the real
    # link: link bytes 0 make the model return them as they are.
    real = results["meta"].get("local") is False
    # The registry's collectives only: the all-reduce's codec is the DDP hook's.
    ops = {op.value for op in CommOp}
    points = [
        p
        for p in results["collectives"]
        if p["impl"] == "qcomm"
        and p["op"] in ops
        and p["pass"] == "fwd"
        and p["status"] == "ok"
        and (real or (p.get("unlimited_s") and p.get("link_bytes") is not None))
    ]
    if not points:
        return {}
    size = max(p["size_bytes"] for p in points)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for p in points:
        if p["size_bytes"] == size:
            figures = (0.0, p["latency_s"]) if real else (p["link_bytes"], p["unlimited_s"])
            out.setdefault(p["op"], {})[p["label"]] = figures
    return out


def speedup_at(model: dict[str, tuple[float, float]], label: str, gbit_per_s: float) -> float:
    r"""
    speedup_at(model: dict[str, tuple[float, float]], label: str, gbit_per_s: float) -> float

    The expected speed-up of codec ``label`` over ``noop`` on a link.

    Args:
        model (dict[str, tuple[float, float]]): codec to link bytes and time without a link limit.
        label (str): the codec.
        gbit_per_s (float): the link's rate in Gbit/s.

    Examples::

        >>> model = {"noop": (4e6, 0.003), "int8": (1.25e6, 0.004)}
        >>> round(speedup_at(model, "int8", 1.0), 2)  # 32.1 ms against 10.8 ms
        2.98
    """
    return _seconds(model, "noop", gbit_per_s) / _seconds(model, label, gbit_per_s)


def _seconds(model: dict[str, tuple[float, float]], label: str, gbit_per_s: float) -> float:
    link_bytes, unlimited = model[label]
    return predicted_time(link_bytes, gbit_per_s * 1e9 / 8, unlimited)


def expected_speedups(
    results: dict[str, Any], rates_gbit: list[float]
) -> dict[str, dict[str, list[float]]]:
    r"""
    expected_speedups(results: dict[str, Any], rates_gbit: list[float]) -> dict[str, dict[str, list[float]]]

    Every qcomm codec's expected speed-ups, ``op -> codec -> speed-ups``, at
    the run's largest size (forward pass).

    Args:
        results (dict[str, Any]): the run's JSON content.
        rates_gbit (list[float]): link rates in Gbit/s.
    """
    out: dict[str, dict[str, list[float]]] = {}
    for op, model in _models(results).items():
        if "noop" not in model:
            continue
        out[op] = {label: [speedup_at(model, label, r) for r in rates_gbit] for label in model}
    return out


def advise(results: dict[str, Any], gbit_per_s: float) -> list[Advice]:
    r"""
    advise(results: dict[str, Any], gbit_per_s: float) -> list[Advice]

    The recommended codec pair of every measured collective, in
    :class:`~qcomm.CommOp` order.

    Args:
        results (dict[str, Any]): the run's JSON content.
        gbit_per_s (float): the link's rate in Gbit/s.
    """
    errors = {r["codec"]: r for r in results["codecs"] if r["status"] == "ok"}
    out = []
    for op, model in _models(results).items():
        if "noop" not in model:
            continue
        allowed = [label for label in model if label in errors]
        if op == CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value:
            allowed = [label for label in allowed if label.partition(":")[0] in _SUMMABLE]
        gains = {label: speedup_at(model, label, gbit_per_s) for label in allowed}
        forward = max(gains, key=lambda label: gains[label], default="noop")
        if gains.get(forward, 1.0) < _WORTH:
            forward = "noop"
        casts = [label for label in gains if label in _BACKWARD and gains[label] >= _WORTH]
        backward = max(casts, key=lambda label: gains[label], default="noop")
        times = [_seconds(model, label, gbit_per_s) for label in ("noop", forward, backward)]
        pair = 2 * times[0] / (times[1] + times[2])
        row = errors.get(forward, {})
        out.append(
            Advice(
                op=op,
                forward=forward,
                backward=backward,
                speedup=pair,
                forward_speedup=gains.get(forward, 1.0),
                max_rel_error=row.get("max_rel_error", 0.0),
                rms_rel_error=row.get("rms_rel_error", 0.0),
            )
        )
    order = [op.value for op in CommOp]
    return sorted(out, key=lambda a: order.index(a.op))


def advice_rates(results: dict[str, Any]) -> list[float]:
    r"""
    advice_rates(results: dict[str, Any]) -> list[float]

    The link rates, in Gbit/s each way, the advice is for: the user's link
    (``--link-gbps``), else the emulated one (``--link``), else
    :data:`ADVICE_RATES`.

    Args:
        results (dict[str, Any]): the run's JSON content.
    """
    meta = results["meta"]
    if meta.get("link_gbps"):
        return [float(meta["link_gbps"])]
    link = results.get("link")
    if link and link.get("rate_bps"):
        return [link["rate_bps"] / 1e9]
    return list(ADVICE_RATES)


def registry_string(advice: list[Advice]) -> str:
    r"""
    registry_string(advice: list[Advice]) -> str

    The advice as the string :func:`~qcomm.build_registry` and ``QCOMM_CODECS`` read.

    Args:
        advice (list[Advice]): from :func:`advise`.

    Examples::

        >>> registry_string([Advice("pooled_embeddings_all_to_all", "int8", "bf16", 2.0, 2.5, 0.003, 0.004)])
        'pooled_embeddings_all_to_all=int8/bf16'
    """
    return ",".join(f"{a.op}={a.pair}" for a in advice)
