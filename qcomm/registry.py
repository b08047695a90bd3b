r"""
The per-collective codec registry that TorchRec sharders take as
``qcomm_codecs_registry``: :func:`build_registry`, also from ``QCOMM_CODECS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from qcomm import torchrec_exchange
from qcomm.discovery import load_codec
from qcomm.specs import parse_registry_string
from qcomm.types import (
    CodecError,
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodecs,
    codec_info,
    contract_problem,
)

__all__ = ["build_registry"]

_CODECS_ENV = "QCOMM_CODECS"


def _load_pair(value: Any, where: str) -> QuantizedCommCodecs:
    if isinstance(value, QuantizedCommCodecs):
        # It holds codec objects; specs belong in a "forward/backward" string.
        for side in ("forward", "backward"):
            codec = getattr(value, side)
            problem = f"str {codec!r}" if isinstance(codec, str) else contract_problem(codec)
            if problem:
                raise CodecError(f"{where}.{side}: expected a codec object, got {problem}")
        return value
    if isinstance(value, str):
        parts = value.split("/")
        if len(parts) > 2:
            raise CodecError(f"{where}: expected 'forward/backward', got {value!r}")
        forward, backward = parts[0], parts[-1]
    elif isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise CodecError(
                f"{where}: expected a (forward, backward) pair, got {len(value)} items"
            )
        forward, backward = value
    else:
        # A single codec object serves both directions.
        codec = _load_one(value, where)
        return QuantizedCommCodecs(forward=codec, backward=codec)
    return QuantizedCommCodecs(
        forward=_load_one(forward, f"{where}.forward"),
        backward=_load_one(backward, f"{where}.backward"),
    )


def _load_one(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return load_codec(value)
        except CodecError as err:
            raise CodecError(f"{where}: {err}") from err
    problem = contract_problem(value)
    if problem:
        raise CodecError(f"{where}: expected a codec spec string or a codec object, got {problem}")
    return value


def build_registry(
    codecs: Mapping[Any, Any] | str | None = None,
    *,
    forward: Any = None,
    backward: Any = None,
    allow_unsummable_reduce_scatter: bool = False,
) -> dict[str, QuantizedCommCodecs]:
    r"""
    build_registry(codecs: Mapping | str | None = None, *, forward=None, backward=None, allow_unsummable_reduce_scatter=False) -> dict[str, QuantizedCommCodecs]

    Builds the registry TorchRec sharders take as ``qcomm_codecs_registry``
    from keywords, a string (see :doc:`codecs`; with no argument,
    ``QCOMM_CODECS``) or a mapping from :class:`~qcomm.CommOp` (or its name)
    to a ``(forward, backward)`` tuple, a ``"forward/backward"`` string, a
    :class:`~qcomm.QuantizedCommCodecs`, or one spec or codec for both.

    .. warning::

        TorchRec's reduce-scatter sums the *wire* tensors and all-gathers its
        gradient into a buffer of the unencoded size, so
        ``POOLED_EMBEDDINGS_REDUCE_SCATTER`` takes only a summable forward
        codec and a size-keeping backward one (see :doc:`torchrec`).

    Args:
        codecs (Mapping | str, optional): the mapping or string. Default: ``None``.
        forward (str | QuantizedCommCodec, optional): forward codec of every op.
            Default: ``None`` (no-op).
        backward (str | QuantizedCommCodec, optional): backward codec of every
            op. Default: ``None`` (no-op).
        allow_unsummable_reduce_scatter (bool, optional): lift the warning's
            rule, for a registry that only feeds
            :func:`~qcomm.reduce_scatter_pooled`. Default: ``False``.

    Returns:
        dict[str, QuantizedCommCodecs]: pairs keyed by ``CommOp.name``; each
        spec gives a new codec instance.

    Raises:
        CodecError: if an op, codec or spec is unknown or malformed, or breaks
            the warning's rule; the message names the argument and the op.

    Examples::

        >>> sorted(build_registry(forward="noop"))
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'POOLED_EMBEDDINGS_REDUCE_SCATTER', 'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
        >>> list(build_registry("pooled_embeddings_all_to_all=noop/noop"))
        ['POOLED_EMBEDDINGS_ALL_TO_ALL']
    """
    if codecs is not None and (forward is not None or backward is not None):
        raise CodecError("build_registry: give either 'codecs' or 'forward'/'backward', not both")
    registry: dict[str, QuantizedCommCodecs] = {}
    if forward is not None or backward is not None:
        for op in CommOp:
            registry[op.name] = QuantizedCommCodecs(
                forward=_keyword_codec(forward, "forward"),
                backward=_keyword_codec(backward, "backward"),
            )
        return _checked(registry, allow_unsummable_reduce_scatter)
    where = "build_registry"
    if codecs is None:
        codecs = os.environ.get(_CODECS_ENV, "").strip()
        where = _CODECS_ENV
        if not codecs:
            return registry
    if isinstance(codecs, str):
        try:
            mapping: Mapping[Any, Any] = parse_registry_string(codecs)
        except CodecError as err:
            raise CodecError(f"{where}: {err}") from err
    elif isinstance(codecs, Mapping):
        mapping = codecs
    else:
        raise CodecError(
            f"build_registry: 'codecs' must be a mapping or a string, got {type(codecs).__name__}"
        )
    for key, value in mapping.items():
        op = CommOp.parse(key)
        if op.name in registry:
            raise CodecError(f"build_registry: CommOp {op.name} is given twice")
        registry[op.name] = _load_pair(value, f"{where}[{op.name}]")
    return _checked(registry, allow_unsummable_reduce_scatter)


def _keyword_codec(value: Any, name: str) -> Any:
    # Each op gets its own no-op instance.
    if value is None:
        return NoOpQuantizedCommCodec()
    return _load_one(value, f"build_registry: {name}")


def _checked(
    registry: dict[str, QuantizedCommCodecs], allow_unsummable_reduce_scatter: bool
) -> dict[str, QuantizedCommCodecs]:
    _check_reduce_scatter(registry, allow_unsummable_reduce_scatter)
    # A registry goes to TorchRec's sharders: their collectives with these
    # codecs run on qcomm's exchange (qcomm.torchrec_exchange).
    torchrec_exchange.enable()
    return registry


def _check_reduce_scatter(
    registry: dict[str, QuantizedCommCodecs], allow_unsummable_reduce_scatter: bool
) -> None:
    pair = registry.get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name)
    if pair is None or allow_unsummable_reduce_scatter:
        return
    info = codec_info(pair.forward)
    if not info.summable:
        raise CodecError(
            f"build_registry: codec {info.name!r} cannot be the forward codec of "
            f"POOLED_EMBEDDINGS_REDUCE_SCATTER: TorchRec's reduce-scatter sums the wire "
            f"tensors, and {info.name!r} does not declare them summable (CodecInfo.summable), "
            f"so the result would be silently wrong. Give that op a summable codec "
            f"(noop, fp16, bf16), e.g. build_registry({{'pooled_embeddings_all_to_all': "
            f"'{info.name}', 'pooled_embeddings_reduce_scatter': 'fp16'}}), or pass "
            f"allow_unsummable_reduce_scatter=True if the registry only feeds "
            f"qcomm.reduce_scatter_pooled"
        )
    # TorchRec all-gathers the backward wire into a buffer shaped like the
    # unencoded gradient, so the codec must keep one wire element per element.
    backward = pair.backward
    if any(backward.calc_quantized_size(n) != n for n in (1, 7, 32, 4096)):
        name = codec_info(backward).name
        raise CodecError(
            f"build_registry: codec {name!r} cannot be the backward codec of "
            f"POOLED_EMBEDDINGS_REDUCE_SCATTER: TorchRec all-gathers that gradient into a "
            f"buffer of the unencoded size, and {name!r} changes the element count "
            f"(calc_quantized_size). Use an element-wise codec there (noop, fp16, bf16), or "
            f"pass allow_unsummable_reduce_scatter=True if the registry only feeds "
            f"qcomm.reduce_scatter_pooled"
        )
