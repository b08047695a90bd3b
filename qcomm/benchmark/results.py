r"""
The results of a ``qcomm bench`` run, typed: what the JSON file holds around
its rows (:mod:`qcomm.benchmark.rows`), the run's ``meta``, the emulated
``link``, the memory copy's ``roofline``, the ``advice`` and, with
``--train``, the model and its series (``train``).

:meth:`Results.to_json` writes the JSON's dicts, in field order, and
:meth:`Results.of` reads them back (or takes a :class:`Results` as it is), so
that the report, the plot and the advice read fields, not string keys. No
torch here: the command line's advice reads these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from qcomm.benchmark.options import LossGap, host_parts
from qcomm.benchmark.rows import CodecRow, DlrmRow, MlpRow, Point, TrainRow, from_json, to_json

__all__ = [
    "Advice",
    "AdviceRate",
    "BenchMeta",
    "DlrmModel",
    "DlrmTrain",
    "LinkFigures",
    "LinkRate",
    "MlpModel",
    "MlpTrain",
    "Results",
    "Roofline",
    "RunAdvice",
    "RunMeta",
    "TrainMeta",
    "TrainPick",
    "Unavailable",
    "codec_rows",
    "pair_spec",
    "points",
    "read_record",
    "record_json",
    "train_rows",
]

_Record = TypeVar("_Record")


def _part(
    *,
    key: str | None = None,
    record: type[Any] | None = None,
    many: bool = False,
    omit_none: bool = False,
    default: Any = None,
) -> Any:
    # A field of an envelope record: its JSON key where it is not the name,
    # the record (or row) class its value is read back as (`many`: a list of
    # them), and whether the JSON leaves it out when None.
    metadata = {"key": key, "record": record, "many": many, "omit_none": omit_none}
    return dataclasses.field(default=default, metadata=metadata)


def _key(field: dataclasses.Field[Any]) -> str:
    return field.metadata.get("key") or field.name


def record_json(value: Any) -> Any:
    r"""
    record_json(value: Any) -> Any

    The JSON form of an envelope record, a row, or lists and dicts of them:
    rows by :func:`~qcomm.benchmark.rows.to_json`, records by key in field
    order, leaving out the fields marked to be left out when ``None``.

    Args:
        value (Any): a record, a row, a list or dict of them, or a scalar.
    """
    if isinstance(value, (CodecRow, Point, TrainRow)):
        return to_json(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if item is None and field.metadata.get("omit_none"):
                continue
            out[_key(field)] = record_json(item)
        return out
    if isinstance(value, (list, tuple)):
        return [record_json(item) for item in value]
    if isinstance(value, dict):
        return {key: record_json(item) for key, item in value.items()}
    return value


def read_record(record: type[_Record], data: Any) -> _Record:
    r"""
    read_record(record: type, data: Any) -> Any

    A record read back from its JSON dict (``None`` stays ``None``, a record
    of the class stays as it is). Keys it leaves out take the field's default.

    Args:
        record (type): the envelope record's class, or a row's.
        data (Any): the dict, the record itself, or ``None``.

    Raises:
        ValueError: naming the record and the keys, for a key it does not have.
    """
    if data is None or isinstance(data, record):
        return data  # type: ignore[return-value]
    if record in (CodecRow, Point, DlrmRow, MlpRow):
        return from_json(record, data)  # type: ignore[type-var]
    fields = {_key(field): field for field in dataclasses.fields(record) if field.init}  # type: ignore[arg-type]
    unknown = [key for key in data if key not in fields and not _derived(record, key)]
    if unknown:
        raise ValueError(
            f"{record.__name__}: unknown key(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(fields)}"
        )
    values = {}
    for key, field in fields.items():
        if key not in data:
            continue
        item, nested = data[key], field.metadata.get("record")
        if nested is not None and item is not None:
            many = field.metadata.get("many")
            item = [read_record(nested, x) for x in item] if many else read_record(nested, item)
        values[field.name] = item
    return record(**values)


def _derived(record: type[Any], key: str) -> bool:
    # A field computed from the others (init=False): written, not read back.
    return any(_key(f) == key and not f.init for f in dataclasses.fields(record))


def pair_spec(forward: str, backward: str) -> str:
    r"""
    pair_spec(forward: str, backward: str) -> str

    A forward and a backward codec spec as one pair, ``forward/backward``
    (what a registry string's entry and ``QCOMM_CODECS`` read). Codecs by
    host pair side by side: ``same_host=a/c+other_host=b/d``.

    Args:
        forward (str): the forward codec's spec.
        backward (str): the backward codec's spec.

    Examples::

        >>> pair_spec("int8", "bf16")
        'int8/bf16'
        >>> pair_spec("same_host=noop+other_host=int8", "bf16")
        'same_host=noop/bf16+other_host=int8/bf16'
    """
    picks = [(spec, host_parts(spec)) for spec in (forward, backward)]
    if all(parts is None for _, parts in picks):
        return f"{forward}/{backward}"
    sides = [parts or {"same_host": spec, "other_host": spec} for spec, parts in picks]
    out = [f"{key}={sides[0].get(key)}/{sides[1].get(key)}" for key in ("same_host", "other_host")]
    given = [side.get("ranks_per_host") for side in sides if "ranks_per_host" in side]
    return "+".join(out + [f"ranks_per_host={n}" for n in given[:1]])


@dataclasses.dataclass(kw_only=True)
class RunMeta:
    r"""What every report's ``meta`` says of the run: versions, host, clock, ranks."""

    qcomm_version: str | None = _part()
    torch_version: str | None = _part()
    fbgemm_gpu_version: str | None = _part()
    torchrec_version: str | None = _part()
    python: str | None = _part()
    host: str | None = _part()
    started: str | None = _part()
    duration_s: float | None = _part()
    backend: str | None = _part()
    device: str | None = _part()
    world_size: int | None = _part()
    threads_per_rank: int | None = _part()
    local: bool | None = _part()
    cpu_count: int | None = _part()
    cpu_model: str | None = _part()


@dataclasses.dataclass(kw_only=True)
class BenchMeta(RunMeta):
    r"""The ``meta`` of a run of the codecs and collectives: the run and its settings."""

    quick: bool | None = _part()
    sizes: list[int] | None = _part()
    ops: list[str] | None = _part()
    dim: int | None = _part()
    codec_elements: int | None = _part()
    budget_s: float | None = _part()
    rounds: int | None = _part()
    timeout_s: float | None = _part()
    link: str | None = _part()
    ranks_per_host: int | None = _part()
    backward: bool | None = _part()
    chunk_bytes: int | None = _part()
    link_gbps: float | None = _part()
    data_scale: float | None = _part()
    command: list[str] | None = _part()
    load_before: list[float] | None = _part()
    load_after: list[float] | None = _part()


@dataclasses.dataclass(kw_only=True)
class TrainMeta(RunMeta):
    r"""The ``meta`` of a ``--train`` run: the run and its settings."""

    rounds: int | None = _part()
    timeout_s: float | None = _part()
    seed: int | None = _part()
    link: str | None = _part()
    link_gbps: float | None = _part()
    #: how TorchRec's calls were routed (QCOMM_TORCHREC_COLLECTIVES), null for the default
    torchrec_collectives: str | None = _part(key="QCOMM_TORCHREC_COLLECTIVES")
    command: list[str] | None = _part()
    load_before: list[float] | None = _part()
    load_after: list[float] | None = _part()


@dataclasses.dataclass(kw_only=True)
class LinkRate:
    r"""The emulated link of a ``--train`` run: its spec and rate (bits per second)."""

    spec: str | None = _part()
    rate_bps: float | None = _part()


@dataclasses.dataclass(kw_only=True)
class LinkFigures(LinkRate):
    r"""
    The emulated link as measured between rank 0 and the first rank of the
    next host: ``float32`` bytes a transfer, and one way and both ways at
    once their median seconds, throughput (1e9 bytes/s), samples and spread
    (left out where not measured); with ``--ranks-per-host``, the same both
    ways between ranks 0 and 1, inside a host (``same_host_both_ways_*``).
    """

    bytes: int | None = _part()
    error: str | None = _part()
    one_way_s: float | None = _part(omit_none=True)
    one_way_GBps: float | None = _part(omit_none=True)
    one_way_samples_s: list[float] | None = _part(omit_none=True)
    one_way_spread: float | None = _part(omit_none=True)
    both_ways_s: float | None = _part(omit_none=True)
    both_ways_GBps: float | None = _part(omit_none=True)
    both_ways_samples_s: list[float] | None = _part(omit_none=True)
    both_ways_spread: float | None = _part(omit_none=True)
    #: with --ranks-per-host, ranks 0 and 1 (one host) both ways at once
    same_host_both_ways_s: float | None = _part(omit_none=True)
    same_host_both_ways_GBps: float | None = _part(omit_none=True)
    same_host_both_ways_samples_s: list[float] | None = _part(omit_none=True)
    same_host_both_ways_spread: float | None = _part(omit_none=True)


@dataclasses.dataclass(kw_only=True)
class Roofline:
    r"""The memory copy the codecs' throughput is measured against (``roofline``)."""

    bytes: int | None = _part()
    copy_s: float | None = _part()
    copy_GBps: float | None = _part()
    error: str | None = _part()


@dataclasses.dataclass(kw_only=True)
class Unavailable:
    r"""Why fbgemm's codecs or TorchRec's all-to-all were left out, ``None`` where they were not."""

    fbgemm: str | None = _part()
    torchrec: str | None = _part()


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
        gbit_per_s (float): the link's rate. Default: ``0.0``.
        measured (bool): the speed-ups were measured on this link in this run
            (else the model predicted them). Default: ``False``.
        left_out (list[str]): codecs at least 5% faster than the pick that
            the error budget left out, each with its speed-up and why.
            Default: none.
        noise (list[str]): codecs whose figure was noise
            (:func:`~qcomm.benchmark.advice.is_noise`), not used. Default: none.
        close (list[str]): codecs faster than the pick, left to it by the
            run's spread (too close to the pick, or to no codec, to tell
            apart). Default: none.
        spread (float): the run's spread at this rate
            (:func:`~qcomm.benchmark.advice.run_spread`): speed-ups closer
            than this factor are not told apart. Default: ``1.0``.
        loss_gap (LossGap, optional): the training example's held-out loss
            gap of the forward codec. Default: ``None``.
    """

    op: str
    forward: str
    backward: str
    speedup: float
    forward_speedup: float
    max_rel_error: float
    rms_rel_error: float
    gbit_per_s: float = 0.0
    measured: bool = False
    left_out: list[str] = dataclasses.field(default_factory=list)
    noise: list[str] = dataclasses.field(default_factory=list)
    close: list[str] = dataclasses.field(default_factory=list)
    spread: float = 1.0
    loss_gap: LossGap | None = _part(record=LossGap)
    #: ``forward/backward``, as a registry string writes it
    pair: str = dataclasses.field(init=False, repr=False, compare=False)
    #: ``op=forward/backward``, the pick as a registry string
    spec: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.pair = pair_spec(self.forward, self.backward)
        self.spec = f"{self.op}={self.pair}"


@dataclasses.dataclass(kw_only=True)
class AdviceRate:
    r"""
    The advice at one link rate: the registry string, the picks, the run's
    spread there, and whether a candidate within that spread of a pick makes
    it ``provisional``.
    """

    gbit_per_s: float = _part(default=0.0)
    registry: str = _part(default="")
    collectives: list[Advice] = _part(record=Advice, many=True, default=())
    spread: float = _part(default=1.0)
    provisional: bool = _part(default=False)


@dataclasses.dataclass(kw_only=True)
class RunAdvice:
    r"""The JSON's ``advice``: the error budget, and the advice per link rate."""

    max_rms_error: float | None = _part()
    budget: str | None = _part()
    training_results: str | None = _part()
    rates: list[AdviceRate] = _part(record=AdviceRate, many=True, default=())


@dataclasses.dataclass(kw_only=True)
class DlrmModel:
    r"""The DLRM a ``--train`` run trains, as its report describes it."""

    name: str = _part(default="dlrm")
    tables: int | None = _part()
    table_wise: int | None = _part()
    row_wise: int | None = _part()
    #: column-wise tables, where --train-plan gives any
    column_wise: int | None = _part(omit_none=True)
    #: each table's sharding where --train-plan gave it
    plan: dict[str, str] | None = _part(omit_none=True)
    rows: int | None = _part()
    dim: int | None = _part()
    batch_per_rank: int | None = _part()
    dense_features: int | None = _part()
    ids_per_bag: list[int] | None = _part()
    learning_rate: float | None = _part()
    steps: int = _part(default=0)
    warm_up_steps: int = _part(default=0)
    steps_per_round: list[int] = _part(default=())
    loop: str = _part(default="plain")


@dataclasses.dataclass(kw_only=True)
class MlpModel:
    r"""The MLP a ``--train --train-model mlp`` run trains, as its report describes it."""

    name: str = _part(default="mlp")
    layers: int | None = _part()
    width: int | None = _part()
    outputs: int | None = _part()
    parameters: int = _part(default=0)
    gradient_bytes: int = _part(default=0)
    batch_per_rank: int | None = _part()
    learning_rate: float | None = _part()
    steps: int = _part(default=0)
    warm_up_steps: int = _part(default=0)
    steps_per_round: list[int] = _part(default=())


@dataclasses.dataclass(kw_only=True)
class TrainPick:
    r"""The advice's pick a DLRM run trains with: the link rate it is for and its registry string."""

    gbit_per_s: float | None = _part()
    registry: str | None = _part()


@dataclasses.dataclass(kw_only=True)
class DlrmTrain:
    r"""The ``train`` part of a DLRM run: the model, the advice's pick, the reduce-scatter's route, the series."""

    model: DlrmModel = _part(record=DlrmModel, default=None)
    advice: TrainPick | None = _part(record=TrainPick)
    reduce_scatter_on_qcomm: bool = _part(default=True)
    reduce_scatter_refused: str | None = _part()
    series: list[DlrmRow] = _part(record=DlrmRow, many=True, default=())


@dataclasses.dataclass(kw_only=True)
class MlpTrain:
    r"""The ``train`` part of an MLP run: the model and the series."""

    model: MlpModel = _part(record=MlpModel, default=None)
    series: list[MlpRow] = _part(record=MlpRow, many=True, default=())


@dataclasses.dataclass(kw_only=True)
class Results:
    r"""
    Everything a run of ``qcomm bench`` found, as its JSON file holds it: a
    run of the codecs and collectives has ``roofline``, ``codecs``,
    ``collectives``, ``unavailable`` and ``advice``; a ``--train`` run has
    ``train`` instead. Parts a run does not have are ``None`` and left out
    of the JSON.
    """

    meta: RunMeta = _part(default=None)
    link: LinkRate | None = _part()
    roofline: Roofline | None = _part(record=Roofline, omit_none=True)
    codecs: list[CodecRow] | None = _part(record=CodecRow, many=True, omit_none=True)
    collectives: list[Point] | None = _part(record=Point, many=True, omit_none=True)
    unavailable: Unavailable | None = _part(record=Unavailable, omit_none=True)
    advice: RunAdvice | None = _part(record=RunAdvice, omit_none=True)
    train: DlrmTrain | MlpTrain | None = _part(omit_none=True)

    def __post_init__(self) -> None:
        if self.meta is None:
            self.meta = TrainMeta() if self.train is not None else BenchMeta()

    @property
    def bench_meta(self) -> BenchMeta:
        r"""
        bench_meta() -> BenchMeta

        The ``meta`` of a run of the codecs and collectives (an empty one otherwise).
        """
        return self.meta if isinstance(self.meta, BenchMeta) else BenchMeta()

    @property
    def mlp(self) -> bool:
        r"""
        mlp() -> bool

        Whether this is a ``--train --train-model mlp`` run.
        """
        return isinstance(self.train, MlpTrain)

    def to_json(self) -> dict[str, Any]:
        r"""
        to_json() -> dict[str, Any]

        The JSON file's content, but its ``units``: rows and records as dicts.
        """
        return record_json(self)  # type: ignore[no-any-return]

    @classmethod
    def of(cls, results: Results | Mapping[str, Any]) -> Results:
        r"""
        of(results: Results | Mapping[str, Any]) -> Results

        The results as they are, or read back from the JSON's content (its
        ``units`` aside); parts it leaves out are ``None`` (a dict may give
        only what its reader needs, as tests do).

        Args:
            results (Results | Mapping[str, Any]): the run's results, or its JSON content.

        Raises:
            ValueError: naming the record and the key, for a key it does not have.
        """
        if isinstance(results, Results):
            return results
        data = {key: value for key, value in results.items() if key != "units"}
        train = data.get("train")
        if train is not None and not isinstance(train, (DlrmTrain, MlpTrain)):
            model = train.get("model")
            mlp = isinstance(model, MlpModel) or (
                isinstance(model, Mapping) and model.get("name") in ("mlp", "fsdp")
            )
            train = read_record(MlpTrain if mlp else DlrmTrain, train)
        link, meta = data.get("link"), data.get("meta")
        if not isinstance(link, (LinkRate, type(None))):
            link = read_record(LinkFigures if train is None else LinkRate, link)
        if not isinstance(meta, (RunMeta, type(None))):
            meta = read_record(BenchMeta if train is None else TrainMeta, meta)
        data.update(link=link, meta=meta, train=train)
        return read_record(cls, data)


def codec_rows(results: Results | Mapping[str, Any]) -> list[CodecRow]:
    r"""
    codec_rows(results: Results | Mapping[str, Any]) -> list[CodecRow]

    A run's codec rows, of its results or read back from its JSON's dicts
    (refusing keys a row does not have).

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
    """
    return list(Results.of(results).codecs or [])


def points(results: Results | Mapping[str, Any]) -> list[Point]:
    r"""
    points(results: Results | Mapping[str, Any]) -> list[Point]

    A run's collective points, of its results or read back from its JSON's dicts.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
    """
    return list(Results.of(results).collectives or [])


def train_rows(results: Results | Mapping[str, Any]) -> list[DlrmRow] | list[MlpRow]:
    r"""
    train_rows(results: Results | Mapping[str, Any]) -> list[DlrmRow] | list[MlpRow]

    A ``--train`` run's series, of its results or read back from its JSON's
    dicts: :class:`~qcomm.benchmark.rows.MlpRow` where the model is the MLP.

    Args:
        results (Results | Mapping[str, Any]): the run's results, or its JSON content.
    """
    train = Results.of(results).train
    return list(train.series) if train is not None else []  # type: ignore[return-value]
