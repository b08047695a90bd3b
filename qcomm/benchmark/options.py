r"""
The option mini-languages of ``qcomm bench`` (sizes, codec lists,
collectives) and :class:`BenchConfig`, the run's settings as every rank
receives them.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from typing import Any

from qcomm.errors import CodecError
from qcomm.ops import CommOp
from qcomm.specs import (
    ADAPTIVE,
    HOST_KEYS,
    parse_codec_spec,
    parse_host_spec,
    parse_pair_spec,
    split_codec_specs,
)

__all__ = [
    "LossGap",
    "BenchOp",
    "DenseOp",
    "DEFAULT_SIZES",
    "OP_TITLES",
    "QUICK_SIZES",
    "TRAIN_DEFAULTS",
    "TRAIN_MLP_DEFAULTS",
    "TRAIN_MLP_QUICK",
    "TRAIN_MODELS",
    "TRAIN_QUICK",
    "TRAIN_SHARDINGS",
    "TRAIN_ROWS",
    "TRAIN_WARM_UP_STEPS",
    "BenchConfig",
    "check_spec",
    "format_size",
    "host_parts",
    "parse_number",
    "parse_ops",
    "parse_size",
    "parse_sizes",
    "split_codec_list",
]

_KIB = 1024
DEFAULT_SIZES = [64 * _KIB * 4**i for i in range(6)]  # 64 KiB, 256 KiB, ..., 64 MiB
QUICK_SIZES = [64 * _KIB, 1024 * _KIB]


class DenseOp(enum.Enum):
    r"""The collectives of dense gradients ``qcomm bench`` measures beside :class:`~qcomm.CommOp`."""

    ALL_REDUCE = "all_reduce"


#: a collective ``qcomm bench`` measures
BenchOp = CommOp | DenseOp

#: untimed training steps each series of ``--train`` takes first
TRAIN_WARM_UP_STEPS = 2
#: rows of every table of ``--train`` (a step's cost depends on the ids looked
#: up, not on the rows, so the tables stay small enough for a model per series)
TRAIN_ROWS = 4096
#: the model of ``--train`` (tables, dimension, batch per rank, steps per series)
TRAIN_DEFAULTS = {"tables": 16, "dim": 128, "batch": 2048, "steps": 52}
#: how ``--train-sharding`` may shard the tables (``mixed``: half each way)
TRAIN_SHARDINGS = ("mixed", "table_wise", "row_wise")
#: the loops of ``--train-loop`` (DLRM): TorchRec's ``TrainPipelineSparseDist``, or
#: a plain loop of forward, backward and optimizer
TRAIN_LOOPS = ("pipeline", "plain")
#: the ``torch.compile`` backends of ``--train-compile`` (DLRM)
TRAIN_COMPILE_BACKENDS = ("inductor", "aot_eager")
#: the same with ``--quick``, a smoke run
TRAIN_QUICK = {"tables": 2, "dim": 8, "batch": 32, "steps": 5}
#: the models of ``--train-model``: TorchRec's DLRM, sharded, or a plain MLP under DDP
#: or under FSDP2 (``fsdp``: the MLP's sizes)
TRAIN_MODELS = ("dlrm", "mlp", "fsdp")
#: the MLP of ``--train-model mlp`` (hidden layers, their width, batch per rank,
#: steps per series): a run of about a minute and a half on 2 CPU cores
TRAIN_MLP_DEFAULTS = {"layers": 8, "width": 2048, "batch": 256, "steps": 12}
#: the same with ``--quick``
TRAIN_MLP_QUICK = {"layers": 2, "width": 64, "batch": 32, "steps": 5}

_UNITS = {"": 1, "K": _KIB, "M": _KIB**2, "G": _KIB**3}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(I?B)?\s*$", re.IGNORECASE)

# How the report names each collective.
OP_TITLES = {
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value: "pooled all-to-all",
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value: "reduce-scatter",
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value: "sequence all-to-all",
    DenseOp.ALL_REDUCE.value: "all-reduce (DDP hook)",
}

# Short names accepted beside the CommOp names and values.
_OP_ALIASES: dict[str, BenchOp] = {
    "pooled": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "pooled_all_to_all": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "a2a": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "reduce_scatter": CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
    "rs": CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
    "sequence": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "sequence_all_to_all": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "seq": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "all_reduce": DenseOp.ALL_REDUCE,
    "ar": DenseOp.ALL_REDUCE,
    "ddp": DenseOp.ALL_REDUCE,
}


def parse_size(text: str) -> int:
    r"""
    parse_size(text: str) -> int

    Bytes of a size; ``ValueError`` if it is not one.

    Args:
        text (str): a positive size with an optional binary unit, any case: ``64K``, ``64KiB``, ``1M``.

    Examples::

        >>> parse_size("64K"), parse_size("1MiB"), parse_size("512")
        (65536, 1048576, 512)
    """
    match = _SIZE.match(text)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"--sizes: expected a positive size like 64K, 1M or 65536, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_number(
    text: str, option: str, kind: type[float] | type[int], low: float, high: float
) -> Any:
    r"""
    parse_number(text: str, option: str, kind: type[float] | type[int], low: float, high: float) -> float | int

    The value of an option, held to ``[low, high]``: a timeout of ``inf``
    would otherwise fail deep inside a rank. ``ValueError`` names ``option``.

    Args:
        text (str): the option's value.
        option (str): the option, e.g. ``--timeout``.
        kind (type[float] | type[int]): ``float`` or ``int`` (``1e3`` is no ``int``).
        low (float): the least value.
        high (float): the largest value.

    Examples::

        >>> parse_number("2.5", "--budget", float, 1e-4, 3600)
        2.5
        >>> parse_number("inf", "--timeout", float, 0.1, 86400)
        Traceback (most recent call last):
        ...
        ValueError: --timeout: expected a number from 0.1 to 86400 (seconds), got 'inf'
    """
    what = "a whole number" if kind is int else "a number"
    unit = f" ({_UNITS_OF.get(option)})" if option in _UNITS_OF else ""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not low <= value <= high:
        shown = [str(int(v)) if kind is int else f"{v:g}" for v in (low, high)]
        raise ValueError(
            f"{option}: expected {what} from {shown[0]} to {shown[1]}{unit}, got {text!r}"
        )
    return value


_UNITS_OF = {"--timeout": "seconds", "--budget": "seconds", "--link-gbps": "Gbit/s"}


def parse_sizes(text: str) -> list[int]:
    r"""
    parse_sizes(text: str) -> list[int]

    Sizes, ascending, repeats dropped; ``ValueError`` if malformed or empty.

    Args:
        text (str): comma-separated sizes (:func:`parse_size`).

    Examples::

        >>> parse_sizes("1M,64K,1M")
        [65536, 1048576]
    """
    items = [part for part in (p.strip() for p in text.split(",")) if part]
    if not items:
        raise ValueError(f"--sizes: expected sizes like 64K,1M,64M, got {text!r}")
    return sorted({parse_size(item) for item in items})


def format_size(size: int) -> str:
    r"""
    format_size(size: int) -> str

    A byte count in the largest binary unit that divides it.

    Args:
        size (int): bytes.

    Examples::

        >>> format_size(65536), format_size(64 << 20), format_size(1000)
        ('64K', '64M', '1000')
    """
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def host_parts(spec: str) -> dict[str, str] | None:
    r"""
    host_parts(spec: str) -> dict[str, str] | None

    The forward codec's spec of each class of peer of a codecs-by-host spec,
    ``same_host`` and ``other_host`` (``noop`` where one is not given), and
    its ``ranks_per_host`` if given; ``None`` for any other spec. The bench
    measures a candidate's forward codecs (as it does one codec), so the
    advice reads these.

    Args:
        spec (str): a codec spec, or codecs by host (see :doc:`/topology`).

    Raises:
        CodecError: if ``spec`` is a malformed codecs-by-host spec.

    Examples::

        >>> host_parts("other_host=int8/bf16")
        {'same_host': 'noop', 'other_host': 'int8'}
        >>> host_parts("int8") is None
        True
    """
    parts = parse_host_spec(spec)
    if parts is None:
        return None
    out = {
        key: parse_pair_spec(str(parts.get(key, "noop")), key)[0]
        for key in ("same_host", "other_host")
    }
    if "ranks_per_host" in parts:
        out.update(ranks_per_host=str(parts.get("ranks_per_host")))
    return out


def check_spec(spec: str) -> None:
    r"""
    check_spec(spec: str) -> None

    Raises :class:`~qcomm.CodecError` naming a malformed spec: a codec's, or
    every codec's of codecs by host. Loads nothing.

    Args:
        spec (str): a codec spec, or codecs by host (``same_host=noop+other_host=int8``).

    Examples::

        >>> check_spec("same_host=noop+other_host=int8:row_dim=64/bf16")
        >>> check_spec("same_host=noop+other=int8")
        Traceback (most recent call last):
        ...
        qcomm.errors.CodecError: 'other=int8' in 'same_host=noop+other=int8': expected same_host=<pair>, other_host=<pair> or ranks_per_host=<n>, joined by '+'
    """
    parts = parse_host_spec(spec)
    sides = [spec]
    if parts is not None:
        sides = [
            s for key in _HOST_SIDES for s in parse_pair_spec(str(parts.get(key, "noop")), key)
        ]
    for side in sides:
        adaptive = side.partition(":")[0].strip() == ADAPTIVE
        if adaptive or {"max_error", "on_exceed"} & set(parse_codec_spec(side)[1]):
            # The bench measures a codec's error on data of its own; a budget
            # or an adaptive choice acts on a training's (qcomm bench --train).
            raise CodecError(
                f"{side!r}: a budget or an adaptive codec chooses on the data of a training, "
                "not on the bench's; compare its candidates here, or run qcomm bench --train"
            )


_HOST_SIDES = HOST_KEYS[:2]


def split_codec_list(text: str) -> list[str]:
    r"""
    split_codec_list(text: str) -> list[str]

    The codec specs of ``--codecs``, split as those of ``QCOMM_CODECS``;
    :class:`~qcomm.CodecError` naming ``--codecs`` if a spec is malformed.
    Codecs by host (``same_host=noop+other_host=int8``) are one item each.

    Args:
        text (str): specs; ``;`` always separates, ``key=value`` continues a spec.

    Examples::

        >>> split_codec_list("int8:row_dim=64,stochastic=true,fp16;mx4")
        ['int8:row_dim=64,stochastic=true', 'fp16', 'mx4']
        >>> split_codec_list("noop,int8,same_host=noop+other_host=int8")
        ['noop', 'int8', 'same_host=noop+other_host=int8']
    """
    try:
        specs = split_codec_specs(text)
        for spec in specs:
            check_spec(spec)
    except CodecError as err:
        raise CodecError(f"--codecs: {err}") from None
    return specs


def parse_ops(text: str) -> list[BenchOp]:
    r"""
    parse_ops(text: str) -> list[CommOp | DenseOp]

    Collectives in :class:`~qcomm.CommOp` order then the all-reduce,
    repeats dropped; ``ValueError`` if an item names none or there is none.

    Args:
        text (str): comma-separated :class:`~qcomm.CommOp` names or values,
            ``pooled`` (``a2a``), ``reduce_scatter`` (``rs``), ``sequence``
            (``seq``), ``all_reduce`` (``ar``, ``ddp``: the DDP hook's).

    Examples::

        >>> [op.name for op in parse_ops("seq,pooled")]
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
    """
    chosen: set[BenchOp] = set()
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        op = _OP_ALIASES.get(item.lower())
        if op is None:
            try:
                op = CommOp.parse(item)
            except CodecError:
                known = ", ".join([*_OP_ALIASES, *(m.value for m in CommOp)])
                raise ValueError(
                    f"--ops: unknown collective {item!r}; expected one of {known}"
                ) from None
        chosen.add(op)
    if not chosen:
        raise ValueError(f"--ops: expected collectives like pooled,rs,seq, got {text!r}")
    return [op for op in [*CommOp, *DenseOp] if op in chosen]


@dataclasses.dataclass(kw_only=True)
class LossGap:
    r"""
    The training example's held-out loss gap of a codec to float32
    (:func:`~qcomm.benchmark.advice.read_loss_gaps`).

    Args:
        config (str): the example's configuration it comes from.
        held_out_gap (float): the held-out loss minus float32's.
        ci95 (float, optional): half the 95% interval of the gap.
        significant (bool): the gap is significant.
    """

    config: str | None = None
    held_out_gap: float = 0.0
    ci95: float | None = None
    significant: bool = False


@dataclasses.dataclass
class BenchConfig:
    r"""
    Everything a rank needs to run its part of ``qcomm bench``; travels to
    locally spawned ranks as JSON. The options of the same names are in
    ``qcomm bench --help``.

    Args:
        codecs (list[str] | None): codec specs, ``None`` for every
            discovered codec; ``noop`` is always measured first.
        sizes (list[int]): message sizes: each rank's float32 buffer, bytes.
        ops (list[str]): :class:`~qcomm.CommOp` values, and ``"all_reduce"``.
        world_size (int): ranks to spawn locally (ignored under a launcher).
        ranks_per_host (int | None): ranks that share a host
            (``--ranks-per-host``), ``None`` where not given (locally spawned
            ranks then count as a host each).
        quick (bool): the smoke-test settings.
        json_path (str | None): where to write every figure.
        plot_path (str | None): where to draw the PNG.
        fbgemm (bool): measure fbgemm's codecs and TorchRec's all-to-all too.
        timeout (float): seconds a collective may wait for its peers.
        budget (float): seconds of timed calls per measurement.
        codec_bytes (int): float32 bytes of the tensor each codec encodes.
        max_calls (int): timed calls per measurement at most.
        seed (int): seed of the random inputs.
        dim (int): columns of the collectives' inputs.
        link (str | None): rate of the emulated link (``--link``), or ``None``.
        backward (bool): also time the forward and backward pass together.
        chunk_bytes (int | None): qcomm's chunk size, ``None`` for automatic.
        rounds (int): timed rounds of every series at every size.
        command (list[str] | None): the command line that started the run.
        link_gbps (float | None): the user's link in Gbit/s (``--link-gbps``).
        max_error (str | None): the advice's error budget (``--max-error``):
            a number or a codec; ``None`` for the default.
        data_scale (float): the codecs' inputs are standard normal times this.
        loss_gaps (dict[str, dict[str, LossGap]] | None): the training example's loss gaps
            (:func:`~qcomm.benchmark.advice.read_loss_gaps`).
        training_results (str | None): the file they were read from.
        profile (bool): profile qcomm's calls by phase instead (``--profile``,
            :mod:`~qcomm.benchmark.profile`).
        train (bool): run the training-step benchmark instead (``--train``,
            :mod:`~qcomm.benchmark.train`).
        train_model (str): its model, ``dlrm``, ``mlp``
            (:mod:`~qcomm.benchmark.train_mlp`) or ``fsdp``
            (:mod:`~qcomm.benchmark.train_fsdp`).
        train_tables (int): the DLRM's tables.
        train_loop (str): the DLRM's training loop: ``pipeline`` (TorchRec's
            ``TrainPipelineSparseDist``) or ``plain``.
        train_compile (str | None): the ``torch.compile`` backend of the
            compiled series (the DLRM's dense part), ``None``: none.
        train_sharding (str): how they are sharded: ``mixed`` (the first half
            table-wise, the rest row-wise), ``table_wise`` or ``row_wise``.
        train_plan (dict[str, str], optional): each table's sharding instead
            (``--train-plan``, :mod:`~qcomm.benchmark.train_plan`). Default: ``None``.
        train_dim (int): every table's embedding dimension.
        train_batch (int): samples per rank and step.
        train_steps (int): training steps per series, warm-up included.
        train_layers (int): the MLP's hidden layers.
        train_width (int): their width, and the MLP's input features.
    """

    codecs: list[str] | None = None
    sizes: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_SIZES))
    ops: list[str] = dataclasses.field(default_factory=lambda: [op.value for op in CommOp])
    world_size: int = 2
    ranks_per_host: int | None = None
    quick: bool = False
    json_path: str | None = None
    plot_path: str | None = None
    fbgemm: bool = True
    timeout: float = 120.0
    budget: float = 0.25
    codec_bytes: int = 16 * _KIB**2
    max_calls: int = 200
    seed: int = 0
    dim: int = 128
    link: str | None = None
    backward: bool = False
    chunk_bytes: int | None = None
    rounds: int = 5
    command: list[str] | None = None
    link_gbps: float | None = None
    max_error: str | None = None
    data_scale: float = 1.0
    loss_gaps: dict | None = None  # type: ignore[type-arg]
    training_results: str | None = None
    profile: bool = False
    train: bool = False
    train_model: str = "dlrm"
    train_tables: int = TRAIN_DEFAULTS["tables"]
    train_sharding: str = "mixed"
    train_plan: dict | None = None  # type: ignore[type-arg]
    train_loop: str = "pipeline"
    train_compile: str | None = None
    train_dim: int = TRAIN_DEFAULTS["dim"]
    train_batch: int = TRAIN_DEFAULTS["batch"]
    train_steps: int = TRAIN_DEFAULTS["steps"]
    train_layers: int = TRAIN_MLP_DEFAULTS["layers"]
    train_width: int = TRAIN_MLP_DEFAULTS["width"]

    def to_json(self) -> str:
        r"""
        to_json() -> str

        The configuration as JSON text, which :meth:`from_json` reads back.
        """
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        r"""
        from_json(text: str) -> BenchConfig

        Reads a configuration written by :meth:`to_json`.

        Args:
            text (str): the JSON text.

        Examples::

            >>> BenchConfig.from_json(BenchConfig(quick=True).to_json()).quick
            True
        """
        data: dict[str, Any] = json.loads(text)
        gaps = data.pop("loss_gaps", None)
        if gaps is not None:  # the training example's gaps, records again
            data.update(
                loss_gaps={
                    op: {codec: LossGap(**gap) for codec, gap in by_codec.items()}
                    for op, by_codec in gaps.items()
                }
            )
        return cls(**data)

    def comm_ops(self) -> list[BenchOp]:
        r"""
        comm_ops() -> list[CommOp | DenseOp]

        The collectives of :attr:`ops` as :class:`~qcomm.CommOp` or :class:`DenseOp` members.
        """
        dense = {op.value: op for op in DenseOp}
        return [dense[op] if op in dense else CommOp.parse(op) for op in self.ops]
