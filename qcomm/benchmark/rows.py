r"""
The rows of ``qcomm bench``'s report, typed: a codec on its own
(:class:`CodecRow`), one series of a collective at one size and pass
(:class:`Point`), and a series of ``--train`` (:class:`DlrmRow`, or
:class:`MlpRow` with ``--train-model mlp``).

Each field says what it means beside it (:func:`column`); the JSON's
``units`` are made from those texts (:func:`units`). A new column is one
field. The records become the JSON's dicts in :func:`to_json` and come back
from them in :func:`from_json`; the results around them are typed in
:mod:`qcomm.benchmark.results`, whose readers take either. No torch here: the
command line's advice reads these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = [
    "CodecRow",
    "DlrmRow",
    "MlpRow",
    "Point",
    "TrainRow",
    "column",
    "from_json",
    "to_json",
    "units",
]

_Row = TypeVar("_Row", "CodecRow", "Point", "DlrmRow", "MlpRow")


def column(
    unit: str,
    *,
    key: str | None = None,
    measured: bool = False,
    ops: tuple[str, ...] | None = None,
    required: bool = False,
) -> Any:
    r"""
    column(unit: str, *, key: str | None = None, measured: bool = False, ops: tuple[str, ...] | None = None, required: bool = False) -> dataclasses.Field

    A row's field with what it means, ``None`` until set unless ``required``.

    Args:
        unit (str): what the figure is and its unit, the JSON's ``units`` entry.
        key (str, optional): its JSON key, where it is not the field's name.
            Default: ``None``.
        measured (bool, optional): a row that did not run (status other than
            ``"ok"``) leaves it out of the JSON when it has no value.
            Default: ``False``.
        ops (tuple[str, ...], optional): only rows of these collectives have
            it in the JSON. Default: ``None`` (every row).
        required (bool, optional): no default: the row is made, and read
            back, with it. Default: ``False``.
    """
    metadata = {"unit": unit, "key": key, "measured": measured, "ops": ops}
    if required:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=None, metadata=metadata)


# Texts of the columns a codec row and a collective's share: the JSON has one
# `units` entry for both.
_CODEC = (
    "the codec's spec (collectives: the series' codec, TorchRec's 'none', or the bare call's "
    "or PyTorch hook's name)"
)
_STATUS = "'ok', or 'failed' (error says why); --train: also 'skipped'"
_ERROR = "why the row failed, null when it did not"
_MAX_REL = "max |decoded - x| / max |x| (collectives: against the exact output)"
_RATIO = (
    "4 / wire_bytes_per_element (codecs by host: of the elements that cross hosts); "
    "collectives: what the series' bytes between hosts are to noop's, the codec row's but for "
    "codecs by host (of both passes' codecs, and times the ranks per host on the all-reduce, "
    "which they make hierarchical); 1 for no codec and bare calls"
)
_SPREAD = (
    "interquartile range over median of the repetitions (codecs: the larger of encode's and "
    "decode's; collectives and --train: of the rounds)"
)
_SAMPLES = "seconds per call of each round (the slowest rank's), in the order run"


@dataclasses.dataclass(kw_only=True)
class CodecRow:
    r"""
    One codec on its own: throughput, wire size and error (``codecs`` in the
    JSON). Its fields and their units: :func:`units`.
    """

    codec: str = column(_CODEC, required=True)
    source: str = column("'qcomm', or 'fbgemm' (fbgemm's codec of that format)", required=True)
    summable: bool | None = column(
        "the codec declares that the backend may sum its wire (CodecInfo.summable)"
    )
    status: str = column(_STATUS, required=True)
    error: str | None = column(_ERROR)
    elements: int | None = column("float32 elements encoded", measured=True)
    wire_dtype: str | None = column("the wire tensor's dtype", measured=True)
    wire_elements: int | None = column("elements of the wire tensor", measured=True)
    calc_quantized_size: int | None = column(
        "the codec's calc_quantized_size for the elements", measured=True
    )
    wire_bytes_per_element: float | None = column(
        "bytes encode puts on the wire per float32 element", measured=True
    )
    bits_per_element: float | None = column("8 * wire_bytes_per_element", measured=True)
    declared_bits_per_element: float | None = column(
        "CodecInfo.bits_per_element, what the codec declares", measured=True
    )
    compression_ratio: float | None = column(_RATIO, measured=True)
    encode_s: float | None = column("median seconds per encode, the slowest rank's", measured=True)
    decode_s: float | None = column("median seconds per decode, the slowest rank's", measured=True)
    encode_GBps: float | None = column(
        "float32 bytes encoded per second, 1e9 bytes/s", measured=True
    )
    decode_GBps: float | None = column(
        "float32 bytes decoded per second, 1e9 bytes/s", measured=True
    )
    encode_roofline_fraction: float | None = column(
        "encode's throughput / memory-copy throughput of the same float32 tensor", measured=True
    )
    decode_roofline_fraction: float | None = column(
        "decode's throughput / memory-copy throughput of the same float32 tensor", measured=True
    )
    max_rel_error: float | None = column(_MAX_REL, measured=True)
    rms_rel_error: float | None = column(
        "sqrt(sum (decoded - x)^2 / sum x^2) (collectives: the output against the exact one, "
        "the worst rank's)",
        measured=True,
    )
    sqnr_db: float | None = column(
        "10 log10(sum x^2 / sum (decoded - x)^2); null when exact (infinite)", measured=True
    )
    encode_samples_s: list[list[float]] | None = column(
        "per rank, seconds per encode of each repetition", measured=True
    )
    decode_samples_s: list[list[float]] | None = column(
        "per rank, seconds per decode of each repetition", measured=True
    )
    spread: float | None = column(_SPREAD, measured=True)
    break_even_GBps: float | None = column(
        "codec alone, no overlap: (1 - wire/logical) / ((encode_s + decode_s) / logical bytes), "
        "1e9 bytes/s (codecs by host: wire and logical bytes of what crosses hosts)",
        measured=True,
    )
    crossing_share: float | None = column(
        "codecs by host: the share of a rank's elements sent to other hosts, (n - K) / n with "
        "K ranks per host, which go through the other_host codec (the rest through the "
        "same_host codec); null for one codec",
        measured=True,
    )
    backward_compression_ratio: float | None = column(
        "codecs by host: 4 / wire bytes per element of the other_host backward codec; null for "
        "one codec (its compression_ratio both ways)",
        measured=True,
    )


@dataclasses.dataclass(kw_only=True)
class Point:
    r"""
    One series of one collective at one size and pass: its times, bandwidths
    and what they are worth (``collectives`` in the JSON). Its fields and
    their units: :func:`units`.
    """

    op: str = column("the collective, a CommOp value or 'all_reduce'", required=True)
    impl: str = column(
        "'qcomm', 'torchrec', 'pytorch' (PyTorch's DDP hooks) or 'bare' (the backend's calls)",
        required=True,
    )
    codec: str = column(_CODEC, required=True)
    label: str = column(
        "the series' name: codec, torchrec[codec], pytorch[hook] or bare:call", required=True
    )
    passes: str = column(
        "'fwd': the collective; 'fwd+bwd': the collective and its backward pass together",
        key="pass",
        required=True,
    )
    size_bytes: int = column("each rank's float32 buffer (nccl-tests' S), bytes", required=True)
    status: str = column(_STATUS, required=True)
    error: str | None = column(_ERROR)
    max_rel_error: float | None = column(_MAX_REL, measured=True)
    rms_rel_error: float | None = column(
        "sqrt(sum (decoded - x)^2 / sum x^2) (collectives: the output against the exact one, "
        "the worst rank's)",
        measured=True,
    )
    calls: int | None = column("calls timed, over every round", measured=True)
    latency_s: float | None = column(
        "median over blocks of the slowest rank's seconds per call", measured=True
    )
    latency_min_s: float | None = column("fastest of the timed rounds (samples_s)", measured=True)
    latency_max_s: float | None = column("slowest of the timed rounds (samples_s)", measured=True)
    samples_s: list[float] | None = column(_SAMPLES, measured=True)
    spread: float | None = column(_SPREAD, measured=True)
    algbw_GBps: float | None = column("size_bytes / latency_s, in 1e9 bytes/s", measured=True)
    busbw_GBps: float | None = column(
        "algbw_GBps * (n - 1) / n, as nccl-tests for all-to-all and reduce-scatter", measured=True
    )
    baseline: str | None = column(
        "the label of the row speedup compares with: the first series of the implementation "
        "and pass"
    )
    speedup: float | None = column(
        "latency of the baseline (the row named by 'baseline') / latency_s"
    )
    compression_ratio: float | None = column(_RATIO)
    link_bound_s: float | None = column(
        "float32 bytes crossing a host's port (K ranks per host; K = 1: a rank's), "
        "K * size_bytes * (n - K) / n (twice for fwd+bwd and for the all-reduce), over the "
        "emulated link's rate, divided by the series' compression ratio"
    )
    x_link_bound: float | None = column("latency_s / link_bound_s (1.0: the wire's limit)")
    link_bytes: float | None = column(
        "wire bytes through a host's port per call (a rank's with one rank per host), over "
        "the link's measured efficiency (TCP_EFFICIENCY without a measured link)"
    )
    unlimited_s: float | None = column(
        "seconds per call with no link limit: loopback, or the emulated link with its rate "
        "limit lifted"
    )
    unlimited_samples_s: list[float] | None = column(
        "seconds per call of each round with no link limit"
    )
    predicted_s: float | None = column(
        "sqrt((link_bytes / rate)^2 + unlimited_s^2), at the emulated link's rate"
    )
    measured_over_predicted: float | None = column("latency_s / predicted_s")
    vs_torchrec: float | None = column(
        "latency of TorchRec's alltoall_pooled with fbgemm's codec of the same format / latency_s"
    )
    break_even_gbit_per_s: float | None = column(
        "link rate (Gbit/s) below which the codec beats qcomm's noop by the model; null when "
        "pays_at_every_rate"
    )
    pays_at_every_rate: bool | None = column(
        "the codec beats qcomm's noop at every link rate, by the model"
    )
    vs_allreduce_hook: float | None = column(
        "latency of PyTorch's allreduce_hook (DDP's default) / latency_s", ops=("all_reduce",)
    )
    vs_fp16_compress_hook: float | None = column(
        "latency of PyTorch's fp16_compress_hook / latency_s", ops=("all_reduce",)
    )

    @property
    def key(self) -> tuple[str, int, str, str]:
        r"""
        key() -> tuple[str, int, str, str]

        ``(op, size_bytes, pass, label)``: the point, among a run's.
        """
        return self.op, self.size_bytes, self.passes, self.label


@dataclasses.dataclass(kw_only=True)
class TrainRow:
    r"""
    What a series of ``--train`` has of either model: its timings, speed-ups
    and losses. Its fields and their units: :func:`units`.
    """

    label: str = column("the series' name", required=True)
    kind: str = column(
        "'fp32', 'torchrec', 'qcomm', 'pytorch' or 'local' (each rank alone)", required=True
    )
    ddp_hook: str | None = column(
        "the dense part's DDP communication hook, null for DDP's own all-reduce"
    )
    status: str = column(_STATUS, required=True)
    error: str | None = column(_ERROR)
    step_s: float | None = column(
        "median over rounds of the slowest rank's seconds per training step (forward, backward, "
        "optimizers)",
        measured=True,
    )
    step_min_s: float | None = column("fastest round (samples_s)", measured=True)
    step_max_s: float | None = column("slowest round (samples_s)", measured=True)
    samples_s: list[float] | None = column(
        "seconds per step of each round (the slowest rank's), in the order run", measured=True
    )
    spread: float | None = column(_SPREAD, measured=True)
    speedup: float | None = column("step_s of fp32 / step_s")
    comm_share: float | None = column("1 - step_s of 'one rank, no collective' / step_s")
    loss: float | None = column(
        "the last step's training loss (BCE), mean over ranks; every series sees the same "
        "batches from the same weights"
    )
    loss_gap: float | None = column("loss - fp32's loss")
    losses: list[float] | None = column("every step's loss, warm-up included, mean over ranks")
    compiled_graphs: int | None = column(
        "graphs torch.compile compiled during the series' steps (warm-up included), most over "
        "ranks; 0 for an eager series"
    )
    graph_breaks: int | None = column(
        "graph breaks torch.compile took during the series' steps (warm-up included), most "
        "over ranks"
    )


@dataclasses.dataclass(kw_only=True)
class DlrmRow(TrainRow):
    r"""
    A series of ``--train`` on TorchRec's DLRM (``train.series`` in the JSON).
    """

    pair: str | None = column("the pooled all-to-all's forward/backward codecs, null for none")
    registry: str | None = column("the qcomm registry string, null for none")
    torchrec_transport: bool | None = column(
        "the registry's codecs travel on TorchRec's own transport, not qcomm's exchange"
    )
    vs_torchrec: float | None = column(
        "step_s of TorchRec's codecs with the same pooled all-to-all pair (and the same "
        "compile) / step_s"
    )
    compile: str | None = column(
        "the torch.compile backend of the dense part (--train-compile), null for eager"
    )
    vs_eager: float | None = column("step_s of the same series eager / step_s, compiled ones")
    pipelined_batches: int | None = column(
        "batches TorchRec's TrainPipelineSparseDist loaded (its own count), null for the plain loop"
    )
    pipelined_modules: int | None = column(
        "sharded modules whose input distribution TorchRec's pipeline took over"
    )
    settled: dict[str, str] | None = column(
        "an adaptive series: the codec of the last call of each collective and pass (e.g. "
        "'all_to_all_pooled forward'), on rank 0; null for other series"
    )
    codec_shares: dict[str, dict[str, float]] | None = column(
        "an adaptive series: each codec's share of the calls of each collective and pass, "
        "warm-up included (summing to 1)"
    )
    switches: dict[str, int] | None = column(
        "an adaptive series: the calls of each collective and pass after which the codec changed"
    )


@dataclasses.dataclass(kw_only=True)
class MlpRow(TrainRow):
    r"""
    A series of ``--train --train-model mlp`` (``train.series`` in the JSON).
    """

    step_s: float | None = column(
        "median over rounds of the slowest rank's seconds per training step (forward, backward "
        "with DDP's gradient all-reduce, SGD)",
        measured=True,
    )
    speedup: float | None = column("step_s of 'default hook' / step_s")
    loss: float | None = column(
        "the last step's training loss (MSE), mean over ranks; every series sees the same "
        "batches from the same weights"
    )
    loss_gap: float | None = column("loss - the default hook's loss")
    vs_fp16_hook: float | None = column("step_s of 'fp16_compress_hook' / step_s")


def _key(field: dataclasses.Field[Any]) -> str:
    return field.metadata["key"] or field.name


def units(*records: type[Any]) -> dict[str, str]:
    r"""
    units(*records: type) -> dict[str, str]

    What every JSON key of these records means, from their fields.

    Args:
        records (type): row classes, e.g. :class:`CodecRow` and :class:`Point`.

    Raises:
        ValueError: if two of them give one key different texts (the JSON has
            one entry per key).

    Examples::

        >>> units(Point)["pass"][:6]
        "'fwd':"
    """
    out: dict[str, str] = {}
    for record in records:
        for field in dataclasses.fields(record):
            key, unit = _key(field), field.metadata["unit"]
            if out.setdefault(key, unit) != unit:
                raise ValueError(f"{record.__name__}.{field.name}: two meanings for {key!r}")
    return out


def to_json(row: CodecRow | Point | TrainRow) -> dict[str, Any]:
    r"""
    to_json(row: CodecRow | Point | TrainRow) -> dict[str, Any]

    The row as the JSON writes it, by key, in field order (:func:`column`
    says which keys a row leaves out).

    Args:
        row (CodecRow | Point | TrainRow): the record.
    """
    out = {}
    for field in dataclasses.fields(row):
        value = getattr(row, field.name)
        ops = field.metadata["ops"]
        if ops is not None and getattr(row, "op", None) not in ops:
            continue
        if field.metadata["measured"] and value is None and row.status != "ok":
            continue
        out[_key(field)] = value
    return out


def from_json(record: type[_Row], data: Mapping[str, Any]) -> _Row:
    r"""
    from_json(record: type, data: Mapping[str, Any]) -> CodecRow | Point | TrainRow

    A row read back from the JSON's dict. Keys a row may leave out
    (every one but the required) are ``None``.

    Args:
        record (type): :class:`CodecRow`, :class:`Point`, :class:`DlrmRow` or
            :class:`MlpRow`; the row is one of it.
        data (Mapping[str, Any]): the row's dict.

    Raises:
        ValueError: naming the record and the keys, for a key it does not
            have or a required one missing.

    Examples::

        >>> from_json(CodecRow, {"codec": "fp16", "source": "qcomm", "status": "ok"}).error is None
        True
    """
    fields = {_key(field): field for field in dataclasses.fields(record)}
    unknown = [key for key in data if key not in fields]
    if unknown:
        raise ValueError(
            f"{record.__name__}: unknown key(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(fields)}"
        )
    required = [key for key, field in fields.items() if field.default is dataclasses.MISSING]
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"{record.__name__}: missing required key(s) {', '.join(missing)}")
    return record(**{fields[key].name: value for key, value in data.items()})
