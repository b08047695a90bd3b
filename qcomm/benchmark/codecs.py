r"""
The codecs ``qcomm bench`` measures, and what it measures of each on its own:
encode and decode time, wire size and error.

qcomm's codecs come from the entry points (:func:`~qcomm.load_codec`); where
fbgemm-gpu is importable, its ``QuantizedCommCodec`` of the same format is
measured beside each, labelled ``fbgemm:<format>``. fbgemm runs with its own
defaults (e.g. int8 rows of 32 elements), whatever options the qcomm spec has.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from qcomm.benchmark.metrics import error_stats
from qcomm.benchmark.timing import time_calls
from qcomm.registry import available_codecs, load_codec, parse_codec_spec
from qcomm.types import CodecError, codec_info

__all__ = ["FBGEMM_FORMATS", "Candidate", "load_candidates", "measure_codec"]

# qcomm codec name -> fbgemm SparseType member of the same format. fbgemm's
# FP8 is e4m3 (with its own exponent bias), so it stands beside fp8_e4m3.
#: fbgemm format of each built-in codec name, for the side-by-side rows
FBGEMM_FORMATS = {
    "fp16": "FP16",
    "bf16": "BF16",
    "int8": "INT8",
    "fp8_e4m3": "FP8",
    "mx4": "MX4",
}


@dataclasses.dataclass
class Candidate:
    r"""
    One codec of the run, loaded or not.

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

    Builds every codec of the run; one that fails is kept, with its error,
    so that the report shows it as failed.

    Args:
        specs (list[str] | None): codec specs; ``None`` means every discovered
            codec. ``noop`` is put first (added if missing): it is the
            baseline of every speed-up.
        fbgemm (bool): also build fbgemm's codec of each format that has one
            (see :data:`FBGEMM_FORMATS`).

    Returns:
        tuple[list[Candidate], str | None]: the candidates, qcomm's first,
        and why fbgemm's are missing (``None`` when they are there or not
        asked for).

    Examples::

        >>> candidates, _ = load_candidates(["noop"], fbgemm=False)
        >>> [(c.label, c.source, c.error) for c in candidates]
        [('noop', 'qcomm', None)]
    """
    chosen = _with_noop_first(available_codecs() if specs is None else list(specs))
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
            candidates.append(Candidate(label, "fbgemm", factory(sparse_type[fmt])))
        except Exception as err:
            candidates.append(Candidate(label, "fbgemm", None, f"{type(err).__name__}: {err}"))
    return candidates, None


def measure_codec(codec: Any, x: torch.Tensor, *, budget: float, max_calls: int) -> dict[str, Any]:
    r"""
    measure_codec(codec: Any, x: Tensor, *, budget: float, max_calls: int) -> dict[str, Any]

    Encodes and decodes ``x`` with ``codec``: the time of each, the wire size
    and the error of the round trip against ``x``.

    Every encode gets a fresh context from ``create_context()``, as in a
    collective; decode reads the context of the encode that made its wire.

    Args:
        codec (Any): a codec following the contract.
        x (Tensor): the 1-D float32 input.
        budget (float): seconds of timed calls for each of encode and decode.
        max_calls (int): timed calls at most for each.

    Returns:
        dict[str, Any]: ``encode_s`` and ``decode_s`` (median seconds per
        call), ``wire_dtype``, ``wire_elements``, ``wire_bytes``,
        ``calc_quantized_size``, ``declared_bits_per_element``, and
        ``max_rel_error``, ``rms_rel_error``, ``sqnr_db``
        (see :func:`~qcomm.benchmark.metrics.error_stats`).

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
    encode_s = time_calls(
        lambda: codec.encode(x, codec.create_context()),
        x.device,
        budget=budget,
        max_calls=max_calls,
    )
    decode_s = time_calls(
        lambda: codec.decode(wire, ctx), x.device, budget=budget, max_calls=max_calls
    )
    return {
        "encode_s": encode_s,
        "decode_s": decode_s,
        "wire_dtype": str(wire.dtype).removeprefix("torch."),
        "wire_elements": wire.numel(),
        "wire_bytes": wire.numel() * wire.element_size(),
        "calc_quantized_size": expected,
        "declared_bits_per_element": codec_info(codec).bits_per_element,
        "max_rel_error": stats.max_rel,
        "rms_rel_error": stats.rms_rel,
        "sqnr_db": stats.sqnr_db,
    }
