r"""
The codecs of a ``qcomm bench`` run (:class:`Candidate`: qcomm's from the
entry points, codecs by host given as ``same_host=...+other_host=...``, and
fbgemm-gpu's codec of the same format where it is importable) and what is
measured of each on its own (:func:`measure_codec`, :func:`measure_host_codecs`).

fbgemm runs with its own defaults (e.g. int8 rows of 32 elements), whatever
options the qcomm spec has; its FP8 codec on CPU is the tensor-wise one,
which takes 2-D input only, so it sees its data as rows of 32.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import statistics
from typing import Any

import torch

from qcomm.benchmark.metrics import error_stats
from qcomm.benchmark.timing import time_samples
from qcomm.discovery import codec_entries, load_codec
from qcomm.registry import load_pair
from qcomm.specs import parse_codec_spec, parse_host_spec
from qcomm.types import CodecError, HostCodecs, codec_info, read_quantized_dtype

__all__ = [
    "FBGEMM_FORMATS",
    "Candidate",
    "default_codecs",
    "crossing_elements",
    "load_candidates",
    "measure_codec",
    "measure_host_codecs",
]

# fbgemm's FP8 without a row dim (TorchRec's default) is the unscaled 1-4-3
# format of bias 15 that fp8_e4m3_tensor reproduces bit for bit.
#: fbgemm ``SparseType`` of the same format as each built-in codec name
FBGEMM_FORMATS = {
    "fp16": "FP16",
    "bf16": "BF16",
    "int8": "INT8",
    "fp8_e4m3_tensor": "FP8",
    "mx4": "MX4",
}


@dataclasses.dataclass
class Candidate:
    r"""
    One codec of the run, loaded or not: a row of the report.

    Args:
        label (str): how the report names it: the spec (``"int8:row_dim=64"``,
            codecs by host as given: ``"same_host=noop+other_host=int8"``)
            or ``"fbgemm:<format>"``.
        source (str): ``"qcomm"`` (an entry-point codec, or codecs by host) or ``"fbgemm"``.
        codec (Any | None): the codec (a :class:`~qcomm.HostCodecs` for codecs
            by host), or ``None`` if it could not be built.
        error (str | None): why it could not be built.
        by_host (bool): codecs by host, whether built or not.
    """

    label: str
    source: str
    codec: Any | None
    error: str | None = None
    by_host: bool = False

    def codecs(self) -> list[Any]:
        r"""
        codecs() -> list[Any]

        Every codec object the candidate runs (both pairs of codecs by
        host); none if it could not be built.
        """
        if isinstance(self.codec, HostCodecs):
            pairs = (self.codec.same_host, self.codec.other_host)
            return [codec for pair in pairs for codec in (pair.forward, pair.backward)]
        return [] if self.codec is None else [self.codec]


class _RowsOf:
    # fbgemm's tensor-wise FP8 takes 2-D input only: it is shown any data as
    # rows of `width` (one row when the length is not a multiple).

    def __init__(self, codec: Any, width: int = 32) -> None:
        self.codec = codec
        self.width = width

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        return flat.view(-1, self.width) if flat.numel() % self.width == 0 else flat.view(1, -1)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.codec.encode(self._rows(input_tensor), ctx).reshape(-1)  # type: ignore[no-any-return]

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.codec.decode(self._rows(input_grad), ctx).reshape(-1)  # type: ignore[no-any-return]

    @property
    def quantized_dtype(self) -> torch.dtype:
        return read_quantized_dtype(self.codec)  # type: ignore[no-any-return]

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return int(self.codec.calc_quantized_size(input_len, ctx))

    def create_context(self) -> Any:
        return self.codec.create_context()

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return self.codec.padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)  # type: ignore[no-any-return]


_EXAMPLE_PARTS = {"example", "examples", "test", "tests"}


def default_codecs() -> list[str]:
    r"""
    default_codecs() -> list[str]

    The sorted names of the codecs a run without ``--codecs`` measures:
    every discovered one but those of a distribution whose name has a part
    ``example`` or ``test`` (such as ``qcomm-example-codec``).

    Examples::

        >>> "example_fp16_scaled" in default_codecs(), "int8" in default_codecs()
        (False, True)
    """
    chosen = []
    for name, entries in codec_entries().items():
        parts = {
            part for entry in entries for part in re.split(r"[-_.]", entry.distribution.lower())
        }
        if not parts & _EXAMPLE_PARTS:
            chosen.append(name)
    return sorted(chosen)


def _is_host_spec(spec: str) -> bool:
    try:
        return parse_host_spec(spec) is not None
    except CodecError:
        return True  # malformed codecs by host: a failed row of its own


def _with_noop_first(specs: list[str]) -> list[str]:
    rest = [s for s in specs if _is_host_spec(s) or parse_codec_spec(s) != ("noop", {})]
    return ["noop", *rest]


def _load(spec: str) -> Any:
    return load_pair(spec, "--codecs") if _is_host_spec(spec) else load_codec(spec)


def _fbgemm_factory() -> tuple[Any, Any]:
    # Imported here: fbgemm is optional, and slow to import.
    comm = importlib.import_module("fbgemm_gpu.quantize_comm")
    configs = importlib.import_module("fbgemm_gpu.split_embedding_configs")
    return comm.QuantizedCommCodec, configs.SparseType


def load_candidates(specs: list[str] | None, fbgemm: bool) -> tuple[list[Candidate], str | None]:
    r"""
    load_candidates(specs: list[str] | None, fbgemm: bool) -> tuple[list[Candidate], str | None]

    Builds every codec of the run, qcomm's first; one that fails is kept
    with its error, a failed row of the report. Returns them and why
    fbgemm's are missing (``None`` when they are there or not asked for).

    Args:
        specs (list[str] | None): codec specs, ``None`` for :func:`default_codecs`;
            ``noop``, every speed-up's baseline, comes first (added if missing).
        fbgemm (bool): also fbgemm's codec of each of :data:`FBGEMM_FORMATS`.

    Examples::

        >>> candidates, _ = load_candidates(["noop"], fbgemm=False)
        >>> [(c.label, c.source, c.error) for c in candidates]
        [('noop', 'qcomm', None)]
    """
    chosen = _with_noop_first(default_codecs() if specs is None else list(specs))
    candidates = []
    for spec in chosen:
        by_host = _is_host_spec(spec)
        try:
            candidates.append(Candidate(spec, "qcomm", _load(spec), by_host=by_host))
        except Exception as err:  # a broken plugin is a row of the report, not the end of the run
            error = f"{type(err).__name__}: {err}"
            candidates.append(Candidate(spec, "qcomm", None, error, by_host=by_host))
    if not fbgemm:
        return candidates, None
    formats = []
    for spec in chosen:
        if _is_host_spec(spec):
            continue  # TorchRec's collectives take one codec for every peer
        fmt = FBGEMM_FORMATS.get(parse_codec_spec(spec)[0])
        if fmt is not None and fmt not in formats:
            formats.append(fmt)
    if not formats:
        return candidates, None
    try:
        factory, sparse_type = _fbgemm_factory()
    except Exception as err:
        return candidates, f"fbgemm_gpu is not importable: {type(err).__name__}: {err}"
    for fmt in formats:
        label = f"fbgemm:{fmt.lower()}"
        try:
            codec = factory(sparse_type[fmt])
            candidates.append(Candidate(label, "fbgemm", _RowsOf(codec) if fmt == "FP8" else codec))
        except Exception as err:
            candidates.append(Candidate(label, "fbgemm", None, f"{type(err).__name__}: {err}"))
    return candidates, None


def measure_codec(codec: Any, x: torch.Tensor, *, budget: float, max_calls: int) -> dict[str, Any]:
    r"""
    measure_codec(codec: Any, x: Tensor, *, budget: float, max_calls: int) -> dict[str, Any]

    The time of encoding and decoding the 1-D float32 ``x`` with ``codec``
    (each encode with a fresh context, as in a collective), the wire size
    and the round trip's error.

    Args:
        codec (Any): a codec following the contract.
        x (Tensor): the input.
        budget (float): seconds of timed calls for each of encode and decode.
        max_calls (int): timed calls at most for each (at least 15 are made).

    Returns:
        dict[str, Any]: median seconds ``encode_s``, ``decode_s`` and their
        ``*_samples_s``, ``wire_dtype``, ``wire_elements``, ``wire_bytes``,
        ``calc_quantized_size``, ``declared_bits_per_element``,
        ``max_rel_error``, ``rms_rel_error`` and ``sqnr_db``
        (:func:`~qcomm.benchmark.metrics.error_stats`).

    Raises:
        CodecError: if the wire size disagrees with ``calc_quantized_size``
            or the decoded tensor has the wrong number of elements.

    Examples::

        >>> import torch
        >>> from qcomm import NoOpQuantizedCommCodec
        >>> figures = measure_codec(NoOpQuantizedCommCodec(), torch.ones(64), budget=0.0, max_calls=1)
        >>> figures["wire_bytes"], figures["max_rel_error"]
        (256, 0.0)
    """
    reference, x = x, x.clone()  # the codec may not write into the reference
    wire, decoded, ctx = _round_trip(codec, x)
    stats = error_stats(reference, decoded)
    encode = _samples(lambda: codec.encode(x, codec.create_context()), x, budget, max_calls)
    decode = _samples(lambda: codec.decode(wire, ctx), x, budget, max_calls)
    return {
        **_timed(encode, decode),
        **_wire_figures(codec, wire),
        "max_rel_error": stats.max_rel,
        "rms_rel_error": stats.rms_rel,
        "sqnr_db": stats.sqnr_db,
    }


def _round_trip(codec: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    # Encodes and decodes x once, checking the sizes; the wire, the decoded
    # values (a tensor of their own) and the context.
    n = x.numel()
    ctx = codec.create_context()
    wire = codec.encode(x, ctx)
    decoded = codec.decode(wire, ctx)
    expected = int(codec.calc_quantized_size(n, ctx))
    if wire.numel() != expected:
        raise CodecError(
            f"encode returned {wire.numel()} wire elements for {n} inputs, "
            f"but calc_quantized_size({n}) says {expected}"
        )
    if decoded.numel() != n:
        raise CodecError(f"decode returned {decoded.numel()} elements for {n} inputs")
    return wire, decoded.reshape(-1).clone(), ctx


def _samples(fn: Any, x: torch.Tensor, budget: float, max_calls: int) -> list[float]:
    # At least 15 samples: their median is steady, and their spread says how
    # far to trust it.
    return time_samples(fn, x.device, budget=budget, min_calls=15, max_calls=max(15, max_calls))


def _timed(encode: list[float], decode: list[float]) -> dict[str, Any]:
    return {
        "encode_s": statistics.median(encode),
        "decode_s": statistics.median(decode),
        "encode_samples_s": encode,
        "decode_samples_s": decode,
    }


def _wire_figures(codec: Any, wire: torch.Tensor) -> dict[str, Any]:
    return {
        "wire_dtype": str(wire.dtype).removeprefix("torch."),
        "wire_elements": wire.numel(),
        "wire_bytes": wire.numel() * wire.element_size(),
        "calc_quantized_size": wire.numel(),  # checked equal by _round_trip
        "declared_bits_per_element": codec_info(codec).bits_per_element,
    }


def crossing_elements(n: int, world_size: int, ranks_per_host: int) -> int:
    r"""
    crossing_elements(n: int, world_size: int, ranks_per_host: int) -> int

    Of the ``n`` elements a rank sends in an all-to-all or a reduce-scatter,
    a block to each rank (its own included), how many go to ranks on other
    hosts: :math:`n (W - K) / W`, rounded down, at least one.

    Args:
        n (int): elements.
        world_size (int): :math:`W`, ranks.
        ranks_per_host (int): :math:`K`, ranks per host.

    Examples::

        >>> crossing_elements(1000, 4, 2), crossing_elements(1000, 4, 1)
        (500, 750)
    """
    return max(1, min(n, n * (world_size - ranks_per_host) // world_size))


def measure_host_codecs(
    codecs: HostCodecs, x: torch.Tensor, *, crossing: int, budget: float, max_calls: int
) -> dict[str, Any]:
    r"""
    measure_host_codecs(codecs: HostCodecs, x: Tensor, *, crossing: int, budget: float, max_calls: int) -> dict[str, Any]

    :func:`measure_codec`'s figures for codecs by host, on ``x`` split as a
    collective splits a rank's data: its last ``crossing`` elements go to
    other hosts through the ``other_host`` forward codec, the rest through the
    ``same_host`` one. The times and the errors are of all of ``x``, both
    codecs at work; the wire figures are of what crosses hosts, the bytes on
    the link between them.

    Args:
        codecs (HostCodecs): the codecs.
        x (Tensor): the input, 1-D float32.
        crossing (int): elements of ``x`` sent to other hosts (:func:`crossing_elements`).
        budget (float): seconds of timed calls for each of encode and decode.
        max_calls (int): timed calls at most for each (at least 15 are made).

    Returns:
        dict[str, Any]: :func:`measure_codec`'s keys, and ``crossing_elements``
        and ``backward_wire_bytes`` (the ``other_host`` backward codec's wire
        for the crossing elements).

    Examples::

        >>> import torch
        >>> from qcomm.registry import load_pair
        >>> codecs = load_pair("same_host=noop+other_host=fp16")
        >>> x = torch.linspace(-1, 1, 64)
        >>> figures = measure_host_codecs(codecs, x, crossing=32, budget=0.0, max_calls=1)
        >>> figures["wire_bytes"], figures["backward_wire_bytes"], figures["max_rel_error"] > 0
        (64, 64, True)
    """
    n = x.numel()
    other, same = codecs.other_host, codecs.same_host
    split = n - crossing
    parts = [(same.forward, x[:split].clone()), (other.forward, x[split:].clone())]
    parts = [(codec, part) for codec, part in parts if part.numel()]
    trips = [(codec, *_round_trip(codec, part)) for codec, part in parts]
    stats = error_stats(x, torch.cat([decoded for _, _, decoded, _ in trips]))

    def encode() -> None:
        for codec, part in parts:
            codec.encode(part, codec.create_context())

    def decode() -> None:
        for codec, wire, _, ctx in trips:
            codec.decode(wire, ctx)

    crossing_wire = trips[-1][1]
    backward = other.backward.encode(x[split:].clone(), other.backward.create_context())
    return {
        **_timed(_samples(encode, x, budget, max_calls), _samples(decode, x, budget, max_calls)),
        **_wire_figures(other.forward, crossing_wire),
        "max_rel_error": stats.max_rel,
        "rms_rel_error": stats.rms_rel,
        "sqnr_db": stats.sqnr_db,
        "crossing_elements": crossing,
        "backward_wire_bytes": backward.numel() * backward.element_size(),
    }
