r"""
The answer of ``qcomm bench``: which codec pair to use on a link of a given
rate, from the figures of one run (the JSON's content), by the rules of
:doc:`/bench` ("The answer"):

- only codecs within an error budget (``--max-error``) are candidates;
- a speed-up is the one measured where the run measured that link, the
  model's prediction elsewhere, and never more than the codec's bytes allow
  (a figure above its compression ratio is noise, and is not used);
- of the codecs as fast as the fastest within the run's own spread between
  rounds (:func:`run_spread`), the one with the least error wins (the no-op
  codec's is none), so that noise does not decide between codecs, nor
  between a codec and none.

The reduce-scatter takes only codecs whose wire may be summed
(``CodecInfo.summable``), as :func:`~qcomm.build_registry` requires.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from qcomm import adaptive
from qcomm.benchmark.metrics import predicted_time, relative_spread
from qcomm.benchmark.options import LossGap
from qcomm.benchmark.results import (
    Advice,
    AdviceRate,
    Results,
    RunAdvice,
    codec_rows,
    pair_spec,
    points,
    record_json,
)
from qcomm.benchmark.rows import CodecRow, Point
from qcomm.errors import CodecError
from qcomm.ops import CommOp
from qcomm.specs import parse_pair_spec, parse_registry_string

__all__ = [
    "ADVICE_RATES",
    "DEFAULT_MAX_ERROR",
    "NOISE_MARGIN",
    "Advice",
    "Speedup",
    "SpeedupTable",
    "advice_json",
    "advice_rates",
    "advise",
    "cpu_limits",
    "error_budget",
    "expected_speedups",
    "is_noise",
    "pair_spec",
    "parse_max_error",
    "read_loss_gaps",
    "registry_string",
    "run_advice",
    "run_spread",
    "speedup_at",
    "speedup_table",
    "speedups",
]

#: the link rates (Gbit/s each way) advised for when the run names none
ADVICE_RATES = [1.0, 10.0, 100.0]
#: the default error budget (an RMS error relative to the data's RMS; an
#: adaptive codec's too); the training example finds no significant loss gap
#: for the codecs under it (fp16, bf16, int8, fp8_e4m3; over 10 seeds for the
#: first three), and one for mx4, far over it
DEFAULT_MAX_ERROR = adaptive.DEFAULT_MAX_ERROR
#: a speed-up over the no-op codec this far above the codec's compression
#: ratio cannot come from its bytes: it is the run's noise
NOISE_MARGIN = 1.05
# Gradients' errors add up from step to step: the backward codec puts 16
# bits or more per element on the wire (a 16-bit cast, or none).
_BACKWARD_BITS = 16
# Below this expected gain the no-op codec stays: not worth an error.
_WORTH = 1.05


@dataclasses.dataclass(frozen=True)
class Speedup:
    r"""
    A codec's speed-up over the no-op codec at one link rate.

    Args:
        value (float): the no-op codec's median time over the codec's.
        measured (bool): measured on this link in this run, not predicted.
        ratio (float): the codec's compression ratio, the most its bytes allow.
    """

    value: float
    measured: bool
    ratio: float

    @property
    def noise(self) -> bool:
        r"""
        noise() -> bool

        Whether the figure exceeds what the codec's bytes allow (:func:`is_noise`).
        """
        return is_noise(self.value, self.ratio)


def is_noise(speedup: float, ratio: float | None) -> bool:
    r"""
    is_noise(speedup: float, ratio: float | None) -> bool

    Whether a speed-up over the no-op codec is more than a codec with this
    compression ratio can give, by more than :data:`NOISE_MARGIN`.

    Args:
        speedup (float): the figure.
        ratio (float, optional): the codec's compression ratio; ``None`` if unknown.

    Examples::

        >>> is_noise(2.26, 2.0), is_noise(2.05, 2.0), is_noise(3.0, None)
        (True, False, False)
    """
    return ratio is not None and speedup > ratio * NOISE_MARGIN


def _largest_forward(results: Results | Mapping[str, Any]) -> dict[str, dict[str, Point]]:
    # op -> label -> qcomm's forward point at the run's largest size. The
    # registry's collectives only: the all-reduce's codec is the DDP hook's.
    ops = {op.value for op in CommOp}
    ours = [
        p
        for p in points(results)
        if p.impl == "qcomm" and p.op in ops and p.passes == "fwd" and p.status == "ok"
    ]
    if not ours:
        return {}
    size = max(p.size_bytes for p in ours)
    out: dict[str, dict[str, Point]] = {}
    for p in ours:
        if p.size_bytes == size:
            out.setdefault(p.op, {})[p.label] = p
    return out


def _measured_at(results: Results | Mapping[str, Any], gbit_per_s: float) -> bool:
    # A launcher's ranks ran on the cluster's link; --link emulated one rate.
    results = Results.of(results)
    if results.meta.local is False:
        return True
    rate = results.link.rate_bps if results.link else None
    return rate is not None and math.isclose(rate / 1e9, gbit_per_s, rel_tol=1e-6)


def _times(p: Point, gbit_per_s: float, measured: bool, floor: float = 0.0) -> list[float] | None:
    # Seconds of a call on the link: the median round first, then every round.
    # Predicted, a call's time without a link limit counts as at least
    # `floor`, the no-op codec's: a codec adds encoding and decoding, and what
    # loopback saves by copying fewer bytes is not the user's network's (on
    # this CPU it moves from run to run and made the advice flip).
    if measured:
        return None if p.latency_s is None else [p.latency_s, *(p.samples_s or [])]
    cpu, link_bytes = p.unlimited_s, p.link_bytes
    if not cpu or link_bytes is None:
        return None
    rate = gbit_per_s * 1e9 / 8
    rounds = p.unlimited_samples_s or []
    return [predicted_time(link_bytes, rate, max(s, floor)) for s in (cpu, *rounds)]


def _floor(points: dict[str, Point]) -> float:
    # The no-op codec's time without a link limit (_times).
    noop = points.get("noop")
    return float(noop.unlimited_s or 0.0) if noop is not None else 0.0


def speedups(
    results: Results | Mapping[str, Any], gbit_per_s: float, *, predicted: bool = False
) -> dict[str, dict[str, Speedup]]:
    r"""
    speedups(results: Results | Mapping[str, Any], gbit_per_s: float, *, predicted: bool = False) -> dict[str, dict[str, Speedup]]

    Every qcomm codec's speed-up over the no-op codec, ``op -> codec ->
    figure``, forward pass at the run's largest size: measured where the run
    measured this link, predicted by the model elsewhere.

    Args:
        results (dict[str, Any]): the run's JSON content.
        gbit_per_s (float): the link's rate in Gbit/s each way.
        predicted (bool, optional): the model's figures even where this link
            was emulated and measured (a launcher's run has only measured
            ones). Default: ``False``.
    """
    results = Results.of(results)
    real = results.meta.local is False
    measured = real or (not predicted and _measured_at(results, gbit_per_s))
    out: dict[str, dict[str, Speedup]] = {}
    for op, by_label in _largest_forward(results).items():
        noop = by_label.get("noop")
        base = _times(noop, gbit_per_s, measured) if noop is not None else None
        if base is None:
            continue
        figures = {}
        for label, p in by_label.items():
            floor = 0.0 if label == "noop" else _floor(by_label)
            times = _times(p, gbit_per_s, measured, floor)
            if times is None:
                continue
            ratio = 1.0 if label == "noop" else p.compression_ratio or 1.0
            figures[label] = Speedup(base[0] / times[0], measured, ratio)
        out[op] = figures
    return out


@dataclasses.dataclass(frozen=True)
class SpeedupTable:
    r"""
    The speed-ups the advice chose from, of one collective at every rate
    advised for (:func:`speedup_table`).

    Args:
        op (str): the collective, a :class:`~qcomm.CommOp` value.
        rates (list[float]): the link rates, Gbit/s each way.
        rows (dict[str, list[Speedup]]): per codec, its speed-up at each rate.
        measured (bool): measured on the link in this run, not predicted.
    """

    op: str
    rates: list[float]
    rows: dict[str, list[Speedup]]
    measured: bool


def speedup_table(results: Results | Mapping[str, Any], rates: list[float]) -> SpeedupTable | None:
    r"""
    speedup_table(results: Results | Mapping[str, Any], rates: list[float]) -> SpeedupTable | None

    Every qcomm codec's speed-up over the no-op codec (:func:`speedups`) at
    each of ``rates``, for the first collective measured at all of them;
    ``None`` under a launcher (one link, the advice has it) or where there
    is none.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
        rates (list[float]): the link rates, Gbit/s each way.
    """
    results = Results.of(results)
    if results.meta.local is False or not rates:
        return None
    figures = [speedups(results, gbit) for gbit in rates]
    op = next((op for op in figures[0] if all(op in f for f in figures)), None)
    if op is None:
        return None
    rows = {label: [f[op][label] for f in figures] for label in figures[0][op]}
    measured = any(figure.measured for figure in rows.get("noop", [])[:1])
    return SpeedupTable(op=op, rates=list(rates), rows=rows, measured=measured)


def run_spread(results: Results | Mapping[str, Any], gbit_per_s: float) -> float:
    r"""
    run_spread(results: Results | Mapping[str, Any], gbit_per_s: float) -> float

    How far this run's rounds disagree at a link rate, as a factor: one plus
    the spread (interquartile range over median of the rounds, measured or
    predicted from the times without a link limit) that nine in ten of the
    qcomm series the advice weighs stay within. Speed-ups closer than this
    factor are not told apart: on a busy machine the medians of a few rounds
    move by that much from run to run.

    Args:
        results (dict[str, Any]): the run's JSON content.
        gbit_per_s (float): the link's rate in Gbit/s each way.
    """
    measured = _measured_at(results, gbit_per_s)
    spreads = []
    for by_label in _largest_forward(results).values():
        for p in by_label.values():
            times = _times(p, gbit_per_s, measured)
            if times is not None:
                spreads.append(relative_spread(times[1:]))
    if not spreads:
        return 1.0
    spreads.sort()
    return 1.0 + spreads[math.ceil(0.9 * len(spreads)) - 1]


def cpu_limits(results: Results | Mapping[str, Any]) -> dict[str, float]:
    r"""
    cpu_limits(results: Results | Mapping[str, Any]) -> dict[str, float]

    Per collective, the link rate in Gbit/s at which the no-op codec's bytes
    take as long on the link as its call takes without a link limit: above
    it this machine's CPU, not the link, bounds every codec, and the
    speed-ups flatten. Empty under a launcher (no model there).

    Args:
        results (dict[str, Any]): the run's JSON content.
    """
    if Results.of(results).meta.local is False:
        return {}
    out = {}
    for op, by_label in _largest_forward(results).items():
        noop = by_label.get("noop")
        if noop is not None and noop.unlimited_s and noop.link_bytes:
            out[op] = noop.link_bytes * 8 / noop.unlimited_s / 1e9
    return out


def speedup_at(model: dict[str, tuple[float, float]], label: str, gbit_per_s: float) -> float:
    r"""
    speedup_at(model: dict[str, tuple[float, float]], label: str, gbit_per_s: float) -> float

    The model's speed-up of codec ``label`` over ``noop`` on a link.

    Args:
        model (dict[str, tuple[float, float]]): codec to link bytes and time without a link limit.
        label (str): the codec.
        gbit_per_s (float): the link's rate in Gbit/s.

    Examples::

        >>> model = {"noop": (4e6, 0.003), "int8": (1.25e6, 0.004)}
        >>> round(speedup_at(model, "int8", 1.0), 2)  # 32.1 ms against 10.8 ms
        2.98
    """
    rate = gbit_per_s * 1e9 / 8
    noop, codec = model["noop"], model[label]
    return predicted_time(noop[0], rate, noop[1]) / predicted_time(codec[0], rate, codec[1])


def expected_speedups(
    results: Results | Mapping[str, Any], rates_gbit: list[float]
) -> dict[str, dict[str, list[float | None]]]:
    r"""
    expected_speedups(results: Results | Mapping[str, Any], rates_gbit: list[float]) -> dict[str, dict[str, list[Optional[float]]]]

    Every qcomm codec's speed-ups predicted by the model, ``op -> codec ->
    speed-ups``, at the run's largest size (forward pass); ``None`` where the
    figure is noise (:func:`is_noise`). Under a launcher, the measured ones.

    Args:
        results (dict[str, Any]): the run's JSON content.
        rates_gbit (list[float]): link rates in Gbit/s.
    """
    out: dict[str, dict[str, list[float | None]]] = {}
    for rate in rates_gbit:
        for op, figures in speedups(results, rate, predicted=True).items():
            for label, f in figures.items():
                out.setdefault(op, {}).setdefault(label, []).append(None if f.noise else f.value)
    return out


def error_budget(
    results: Results | Mapping[str, Any], max_error: str | float | None = None
) -> tuple[float, str]:
    r"""
    error_budget(results: Results | Mapping[str, Any], max_error: str | float | None = None) -> tuple[float, str]

    The largest RMS error, relative to the data's, a recommended codec may
    have, and how the report names it.

    Args:
        results (dict[str, Any]): the run's JSON content.
        max_error (str | float, optional): a number, or a codec of the run
            (``"bf16"``: as good as bf16 on this run's data). Default:
            :data:`DEFAULT_MAX_ERROR`.

    Raises:
        ValueError: if ``max_error`` is neither a positive number nor a codec
            this run measured.

    Examples::

        >>> error_budget({"codecs": []}, "1e-2")
        (0.01, 'RMS error at most 0.01 (--max-error)')
    """
    if max_error is None:
        return DEFAULT_MAX_ERROR, f"RMS error at most {DEFAULT_MAX_ERROR:g} (the default)"
    budget = parse_max_error(max_error)
    if isinstance(budget, float):
        return budget, f"RMS error at most {budget:g} (--max-error)"
    rows = _measured(results)
    if budget not in rows:
        raise ValueError(
            f"--max-error: expected a relative RMS error such as 1e-2, or a codec this "
            f"run measured ({', '.join(rows)}), got {max_error!r}"
        )
    limit = rows[budget][1]
    return limit, f"as good as {budget} (RMS error at most {limit:.2g}, --max-error)"


def parse_max_error(text: str | float) -> float | str:
    r"""
    parse_max_error(text: str | float) -> float | str

    ``--max-error`` read: a positive number, or the name of a codec to be
    as good as (which the caller looks up).

    Args:
        text (str | float): the option's value.

    Raises:
        ValueError: naming ``--max-error``, for a number that is not positive
            and finite.

    Examples::

        >>> parse_max_error("1e-2"), parse_max_error(" bf16 ")
        (0.01, 'bf16')
    """
    try:
        limit = float(text)
    except ValueError:
        return str(text).strip()
    if not 0 < limit < math.inf:
        raise ValueError(f"--max-error: expected a positive number, got {text!r}")
    return limit


def _measured(results: Results | Mapping[str, Any]) -> dict[str, tuple[CodecRow, float]]:
    # The codecs measured, each with its RMS error.
    return {
        r.codec: (r, r.rms_rel_error)
        for r in codec_rows(results)
        if r.status == "ok" and r.rms_rel_error is not None
    }


def _bits(row: CodecRow) -> float:
    return 0.0 if row.bits_per_element is None else row.bits_per_element


def _max_error(row: CodecRow) -> float:
    return math.nan if row.max_rel_error is None else row.max_rel_error


def _pick(
    labels: list[str], figures: dict[str, Speedup], errors: dict[str, float], spread: float
) -> tuple[str, list[str]]:
    # Only a codec faster than the no-op codec by a clear margin (_WORTH)
    # over the run's spread is worth its error: a figure just above the
    # spread is as likely noise. Of those, every one within the spread of
    # the fastest is as fast as far as this run can tell: the least error
    # wins, so that noise does not decide between codecs of one size on the
    # wire. Also returns the codecs faster than the pick that lost to their
    # error or to the spread.
    clear = [label for label in labels if figures[label].value >= spread * _WORTH]
    if not clear:
        faster = [label for label in labels if figures[label].value > 1.0 and label != "noop"]
        return "noop", faster
    best = max(figures[label].value for label in clear)
    close = [label for label in clear if figures[label].value * spread >= best]
    pick = min(close, key=lambda label: (errors[label], -figures[label].value, label))
    faster = [label for label in labels if figures[label].value > figures[pick].value]
    return pick, faster


def _left_out_text(label: str, figure: Speedup, why: str) -> str:
    return f"{label} (x{figure.value:.2f}, {why})"


def advise(
    results: Results | Mapping[str, Any],
    gbit_per_s: float,
    *,
    max_error: str | float | None = None,
    loss_gaps: dict[str, dict[str, LossGap]] | None = None,
) -> list[Advice]:
    r"""
    advise(results: Results | Mapping[str, Any], gbit_per_s: float, *, max_error: str | float | None = None, loss_gaps: dict | None = None) -> list[Advice]

    The recommended codec pair of every measured collective, in
    :class:`~qcomm.CommOp` order.

    Args:
        results (dict[str, Any]): the run's JSON content.
        gbit_per_s (float): the link's rate in Gbit/s.
        max_error (str | float, optional): the error budget
            (:func:`error_budget`). Default: :data:`DEFAULT_MAX_ERROR`, which
            also leaves out codecs whose training loss gap is significant.
        loss_gaps (dict, optional): the training example's gaps
            (:func:`read_loss_gaps`). Default: ``None``.
    """
    limit, _ = error_budget(results, max_error)
    rows = _measured(results)
    spread = run_spread(results, gbit_per_s)
    out = []
    for op, figures in speedups(results, gbit_per_s).items():
        gaps = (loss_gaps or {}).get(op, {})
        noise = [label for label, f in figures.items() if f.noise]
        left_out, allowed = [], []
        for label, figure in figures.items():
            measured = rows.get(label)
            if measured is None or label in noise:
                continue
            row, rms = measured
            gap = gaps.get(label)
            if op == CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value and not row.summable:
                continue  # not a candidate at all: the wire would be summed
            if rms > limit:
                why = f"RMS error {rms:.2g} over {limit:.2g}"
                left_out.append((label, _left_out_text(label, figure, why)))
            elif max_error is None and gap and gap.significant and gap.held_out_gap > 0:
                why = f"training loss gap +{gap.held_out_gap:.4f}, significant"
                left_out.append((label, _left_out_text(label, figure, why)))
            else:
                allowed.append(label)
        if "noop" not in allowed:
            continue
        errors = {label: rows[label][1] for label in allowed}
        forward, close = _pick(allowed, figures, errors, spread)
        casts = [label for label in allowed if _bits(rows[label][0]) >= _BACKWARD_BITS]
        backward, _ = _pick(casts, figures, errors, spread)
        f, b = figures[forward].value, figures[backward].value
        best = figures[forward]
        out.append(
            Advice(
                op=op,
                forward=forward,
                backward=backward,
                speedup=2 / (1 / f + 1 / b),
                forward_speedup=f,
                max_rel_error=_max_error(rows[forward][0]),
                rms_rel_error=rows[forward][1],
                gbit_per_s=gbit_per_s,
                measured=best.measured,
                # What the budget traded: codecs that would have gained 5% more.
                left_out=[text for label, text in left_out if figures[label].value >= f * _WORTH],
                noise=noise,
                close=close,
                spread=spread,
                loss_gap=gaps.get(forward),
            )
        )
    order = [op.value for op in CommOp]
    return sorted(out, key=lambda a: order.index(a.op))


def advice_rates(results: Results | Mapping[str, Any]) -> list[float]:
    r"""
    advice_rates(results: Results | Mapping[str, Any]) -> list[float]

    The link rates, in Gbit/s each way, the advice is for: the user's link
    (``--link-gbps``), else the emulated one (``--link``), else
    :data:`ADVICE_RATES`.

    Args:
        results (dict[str, Any]): the run's JSON content.
    """
    results = Results.of(results)
    meta, link = results.bench_meta, results.link
    if meta.link_gbps:
        return [float(meta.link_gbps)]
    if link and link.rate_bps:
        return [link.rate_bps / 1e9]
    return list(ADVICE_RATES)


def run_advice(
    results: Results | Mapping[str, Any],
    *,
    max_error: str | float | None = None,
    loss_gaps: dict[str, dict[str, LossGap]] | None = None,
    training_results: str | None = None,
) -> RunAdvice:
    r"""
    run_advice(results: Results | Mapping[str, Any], *, max_error: str | float | None = None, loss_gaps: dict | None = None, training_results: str | None = None) -> RunAdvice

    The advice of a run, as its results hold it: the error budget, and per
    link rate the registry string, the run's spread (:func:`run_spread`),
    whether the advice is ``provisional`` (a candidate faster than a pick is
    within that spread of it, or of no codec, so the figures cannot separate
    them) and per collective the pair, its spec, its expected speed-up and
    error, and whether it was measured or predicted.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
        max_error (str | float, optional): the error budget. Default: the default.
        loss_gaps (dict, optional): the training example's gaps. Default: ``None``.
        training_results (str, optional): the file they came from. Default: ``None``.
    """
    results = Results.of(results)
    limit, budget = error_budget(results, max_error)
    rates = []
    for rate in advice_rates(results):
        advice = advise(results, rate, max_error=max_error, loss_gaps=loss_gaps)
        rates.append(
            AdviceRate(
                gbit_per_s=rate,
                registry=registry_string(advice),
                collectives=advice,
                spread=run_spread(results, rate),
                # A faster candidate within the run's spread of a pick: the
                # figures cannot separate them, and more rounds (or a run
                # without --quick) may pick otherwise.
                provisional=any(a.close for a in advice),
            )
        )
    return RunAdvice(
        max_rms_error=limit, budget=budget, training_results=training_results, rates=rates
    )


def advice_json(
    results: Results | Mapping[str, Any],
    *,
    max_error: str | float | None = None,
    loss_gaps: dict[str, dict[str, LossGap]] | None = None,
    training_results: str | None = None,
) -> dict[str, Any]:
    r"""
    advice_json(results: Results | Mapping[str, Any], *, max_error: str | float | None = None, loss_gaps: dict | None = None, training_results: str | None = None) -> dict[str, Any]

    The advice as the JSON's ``advice`` key: :func:`run_advice` as dicts.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
        max_error (str | float, optional): the error budget. Default: the default.
        loss_gaps (dict, optional): the training example's gaps. Default: ``None``.
        training_results (str, optional): the file they came from. Default: ``None``.
    """
    advice = run_advice(
        results, max_error=max_error, loss_gaps=loss_gaps, training_results=training_results
    )
    return record_json(advice)  # type: ignore[no-any-return]


def read_loss_gaps(path: str) -> dict[str, dict[str, LossGap]]:
    r"""
    read_loss_gaps(path: str) -> dict[str, dict[str, LossGap]]

    The held-out loss gaps to float32 the training example
    (``examples/train_dlrm.py``) wrote in its ``results.json``, ``op ->
    forward codec -> {config, held_out_gap, ci95, significant}``; the
    configurations of the dense hook are left out.

    Args:
        path (str): the example's ``results.json``.

    Raises:
        ValueError: if the file cannot be read or is not the example's.
    """
    try:
        with open(path) as f:
            data = json.load(f)
        runs, summary = data["runs"], data["summary"]
        out: dict[str, dict[str, LossGap]] = {}
        for name, seeds in runs.items():
            config = seeds[0]
            if config.get("dense") or not config.get("registry") or name not in summary:
                continue
            row = summary[name]
            for op, pair in parse_registry_string(config["registry"]).items():
                forward = parse_pair_spec(pair, f"{op.value} of {name}")[0]
                gap = LossGap(
                    config=name,
                    held_out_gap=row["held_out_gap"],
                    ci95=row["held_out_gap_ci95"],
                    significant=bool(row["significant"]),
                )
                out.setdefault(op.value, {}).setdefault(forward, gap)
        return out
    except (
        OSError,
        ValueError,
        CodecError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
    ) as err:
        raise ValueError(
            f"--training-results: cannot read the training example's results from {path!r}: "
            f"{type(err).__name__}: {err}"
        ) from None


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
    return ",".join(a.spec for a in advice)
