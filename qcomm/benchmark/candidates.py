r"""
The codecs of a ``qcomm bench`` run (:class:`Candidate`: qcomm's from the
entry points, and fbgemm-gpu's codec of the same format where it is
importable) and what is measured of each on its own (:func:`measure_codec`).

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
from qcomm.specs import parse_codec_spec
from qcomm.types import CodecError, codec_info, read_quantized_dtype

__all__ = [
    "FBGEMM_FORMATS",
    "Candidate",
    "default_codecs",
    "load_candidates",
    "measure_codec",
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
        label (str): how the report names it: the spec (``"int8:row_dim=64"``)
            or ``"fbgemm:<format>"``.
        source (str): ``"qcomm"`` (an entry-point codec) or ``"fbgemm"``.
        codec (Any | None): the codec, or ``None`` if it could not be built.
        error (str | None): why it could not be built.
    """

    label: str
    source: str
    codec: Any | None
    error: str | None = None


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


def _with_noop_first(specs: list[str]) -> list[str]:
    rest = [s for s in specs if parse_codec_spec(s) != ("noop", {})]
    return ["noop", *rest]


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
        try:
            candidates.append(Candidate(spec, "qcomm", load_codec(spec)))
        except Exception as err:  # a broken plugin is a row of the report, not the end of the run
            candidates.append(Candidate(spec, "qcomm", None, f"{type(err).__name__}: {err}"))
    if not fbgemm:
        return candidates, None
    formats = []
    for spec in chosen:
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
    n = x.numel()
    reference, x = x, x.clone()  # the codec may not write into the reference
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
    stats = error_stats(reference, decoded)
    # At least 15 samples each: their median is steady, and their spread
    # says how far to trust it.
    encode = time_samples(
        lambda: codec.encode(x, codec.create_context()),
        x.device,
        budget=budget,
        min_calls=15,
        max_calls=max(15, max_calls),
    )
    decode = time_samples(
        lambda: codec.decode(wire, ctx),
        x.device,
        budget=budget,
        min_calls=15,
        max_calls=max(15, max_calls),
    )
    encode_s, decode_s = statistics.median(encode), statistics.median(decode)
    return {
        "encode_s": encode_s,
        "decode_s": decode_s,
        "encode_samples_s": encode,
        "decode_samples_s": decode,
        "wire_dtype": str(wire.dtype).removeprefix("torch."),
        "wire_elements": wire.numel(),
        "wire_bytes": wire.numel() * wire.element_size(),
        "calc_quantized_size": expected,
        "declared_bits_per_element": codec_info(codec).bits_per_element,
        "max_rel_error": stats.max_rel,
        "rms_rel_error": stats.rms_rel,
        "sqnr_db": stats.sqnr_db,
    }
