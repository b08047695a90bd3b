r"""
Codec discovery and the per-collective registry.

Codecs are found as entry points of the group ``qcomm.codecs`` with stevedore;
built-in codecs and third-party ones enter the same way. Listing reads only
package metadata; a plugin's code is imported only when its codec is loaded.

A *codec spec* is ``name`` or ``name:key=value,key=value``; values are parsed
as ``int``, ``float``, ``bool`` (``true``/``false``) or left as strings. A
*pair* is ``forward/backward``; a single spec where a pair is expected serves
both directions (as two separate instances).

The environment variable ``QCOMM_PLUGINS``, a comma-separated list of
distribution names, restricts which distributions may provide codecs at all.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
from collections.abc import Mapping
from typing import Any

from stevedore import NamedExtensionManager
from stevedore.extension import Extension

from qcomm.types import CodecError, CommOp, QuantizedCommCodec, QuantizedCommCodecs, codec_info

__all__ = [
    "ENTRY_POINT_GROUP",
    "CodecEntry",
    "available_codecs",
    "build_registry",
    "codec_entries",
    "load_codec",
    "parse_codec_spec",
]

ENTRY_POINT_GROUP = "qcomm.codecs"
_PLUGINS_ENV = "QCOMM_PLUGINS"
_CODECS_ENV = "QCOMM_CODECS"


@dataclasses.dataclass(frozen=True)
class CodecEntry:
    r"""
    One codec as its package metadata declares it; nothing is imported.

    Args:
        name (str): the entry-point name, e.g. ``"int8"``.
        value (str): the factory's import path, ``"module:attr"``.
        distribution (str): the distribution that registers it.
        version (str): that distribution's version.
    """

    name: str
    value: str
    distribution: str
    version: str


def _refuse_conflicts(namespace: str, name: str, extensions: list[Extension[Any]]) -> Any:
    # Never pick one of two codecs silently: a model trained with one and
    # served with the other would differ without anyone knowing.
    values = ", ".join(ext.entry_point.value for ext in extensions)
    raise CodecError(f"codec {name!r} in group {namespace!r} has several implementations: {values}")


def _raise_load_failure(
    manager: Any, entry_point: importlib.metadata.EntryPoint, err: BaseException
) -> None:
    raise CodecError(f"failed to import: {type(err).__name__}: {err}") from err


def _allowed_distributions() -> set[str] | None:
    raw = os.environ.get(_PLUGINS_ENV, "").strip()
    if not raw:
        return None
    return {_normalize(d) for d in raw.split(",") if d.strip()}


def _normalize(dist_name: str) -> str:
    return dist_name.strip().lower().replace("_", "-").replace(".", "-")


def _all_entries() -> dict[str, list[CodecEntry]]:
    # importlib.metadata rather than stevedore's listing here: stevedore's cache
    # drops which distribution an entry point comes from, and that is what
    # conflicts, QCOMM_PLUGINS and `qcomm list` need.
    found: dict[str, list[CodecEntry]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        entry = CodecEntry(
            name=ep.name,
            value=ep.value,
            distribution=(dist.metadata["Name"] or "<unnamed>") if dist else "<unknown>",
            version=(dist.version or "?") if dist else "?",
        )
        # The same distribution can be seen twice on sys.path (e.g. an editable
        # install beside a regular one); that is one codec, not a conflict.
        if entry not in found.setdefault(ep.name, []):
            found[ep.name].append(entry)
    return found


def codec_entries() -> dict[str, list[CodecEntry]]:
    r"""
    codec_entries() -> dict[str, list[CodecEntry]]

    Every registered codec name with the distributions that register it,
    read from package metadata only (no plugin is imported). A name with more
    than one entry is a conflict that :func:`load_codec` refuses.
    Distributions left out by ``QCOMM_PLUGINS`` are not listed.

    Returns:
        dict[str, list[CodecEntry]]: entries by codec name, names sorted.
    """
    allowed = _allowed_distributions()
    found = {
        name: [e for e in entries if allowed is None or _normalize(e.distribution) in allowed]
        for name, entries in _all_entries().items()
    }
    return {name: entries for name, entries in sorted(found.items()) if entries}


def available_codecs() -> list[str]:
    r"""
    available_codecs() -> list[str]

    Names of all codecs registered under the ``qcomm.codecs`` entry points.

    Nothing is imported: the names come from package metadata.

    Returns:
        list[str]: sorted codec names.

    Examples::

        >>> "noop" in available_codecs()
        True
    """
    return list(codec_entries())


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_codec_spec(spec: str) -> tuple[str, dict[str, Any]]:
    r"""
    parse_codec_spec(spec: str) -> tuple[str, dict[str, Any]]

    Splits a codec spec into its name and keyword options.

    Args:
        spec (str): ``name`` or ``name:key=value,key=value``.

    Returns:
        tuple[str, dict[str, Any]]: the name and the parsed options.

    Raises:
        CodecError: if ``spec`` is empty or an option is not ``key=value``.

    Examples::

        >>> parse_codec_spec("int8:row_dim=64,stochastic=true")
        ('int8', {'row_dim': 64, 'stochastic': True})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(
            f"codec spec must be a non-empty string like 'int8:row_dim=64', got {spec!r}"
        )
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise CodecError(f"codec spec {spec!r} has no codec name before ':'")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CodecError(f"option {item!r} in codec spec {spec!r} is not of the form key=value")
        options[key.strip()] = _parse_value(value.strip())
    return name, options


def _accepted_options(factory: Any) -> tuple[list[str], bool]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return [], True
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    ]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    return names, takes_any


def load_codec(spec: str, **options: Any) -> QuantizedCommCodec:
    r"""
    load_codec(spec: str, **options: Any) -> QuantizedCommCodec

    Builds a codec from its spec, importing only the plugin that provides it.

    Args:
        spec (str): ``name`` or ``name:key=value,...``.
        **options (Any): more options for the plugin's factory; they override
            those in ``spec``.

    Returns:
        QuantizedCommCodec: a new codec instance.

    Raises:
        CodecError: the name is unknown (the available ones are listed), two
            distributions register it, an option is not accepted (the accepted
            ones are listed), or the plugin fails to import or construct (its
            distribution and the cause are named).

    Examples::

        >>> load_codec("noop").calc_quantized_size(8)
        8
    """
    name, spec_options = parse_codec_spec(spec)
    spec_options.update(options)
    allowed = codec_entries()
    entries = _all_entries().get(name, [])
    if name not in allowed:
        known = ", ".join(allowed) or "none"
        hidden = f" ({_PLUGINS_ENV} leaves out {entries[0].distribution})" if entries else ""
        raise CodecError(f"unknown codec {name!r}{hidden}; available codecs: {known}")
    if len(entries) > 1:
        dists = ", ".join(f"{e.distribution} {e.version} ({e.value})" for e in entries)
        raise CodecError(f"codec {name!r} is registered by several distributions: {dists}")
    entry = entries[0]
    where = f"codec {name!r} ({entry.value}, distribution {entry.distribution} {entry.version})"
    # Drop stevedore's in-process list so that it sees what importlib sees now.
    NamedExtensionManager.ENTRY_POINT_CACHE.pop(ENTRY_POINT_GROUP, None)
    try:
        manager: NamedExtensionManager[Any] = NamedExtensionManager(
            ENTRY_POINT_GROUP,
            names=[name],
            on_load_failure_callback=_raise_load_failure,
            on_missing_entrypoints_callback=None,
            conflict_resolver=_refuse_conflicts,
        )
        factory = manager[name].plugin
    except CodecError as err:
        raise CodecError(f"{where} {err}") from err.__cause__
    except KeyError as err:
        raise CodecError(f"{where} was not found by stevedore's entry-point scan") from err

    accepted, takes_any = _accepted_options(factory)
    unknown = sorted(set(spec_options) - set(accepted))
    if unknown and not takes_any:
        raise CodecError(
            f"{where} does not accept option(s) {', '.join(unknown)}; "
            f"accepted options: {', '.join(accepted) or 'none'}"
        )
    try:
        codec = factory(**spec_options)
    except Exception as err:
        raise CodecError(
            f"{where} could not be built with options {spec_options}: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(codec, QuantizedCommCodec):
        missing = [m for m in _CONTRACT if not hasattr(codec, m)]
        raise CodecError(
            f"{where} returned {type(codec).__name__}, which lacks codec member(s) {', '.join(missing)}"
        )
    return codec


_CONTRACT = (
    "encode",
    "decode",
    "quantized_dtype",
    "calc_quantized_size",
    "create_context",
    "padded_size",
)


def _load_pair(value: Any, where: str) -> QuantizedCommCodecs:
    if isinstance(value, QuantizedCommCodecs):
        return value
    if isinstance(value, str):
        parts = value.split("/")
        if len(parts) > 2:
            raise CodecError(f"{where}: expected 'forward/backward', got {value!r}")
        forward = parts[0]
        backward = parts[1] if len(parts) == 2 else parts[0]
        return QuantizedCommCodecs(forward=_load_one(forward), backward=_load_one(backward))
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise CodecError(
                f"{where}: expected a (forward, backward) pair, got {len(value)} items"
            )
        return QuantizedCommCodecs(forward=_load_one(value[0]), backward=_load_one(value[1]))
    # A single codec object serves both directions.
    return QuantizedCommCodecs(forward=_load_one(value), backward=_load_one(value))


def _load_one(value: Any) -> Any:
    if value is None:
        return QuantizedCommCodecs().forward
    if isinstance(value, str):
        return load_codec(value)
    if isinstance(value, QuantizedCommCodec):
        return value
    raise CodecError(
        f"expected a codec spec string or an object with the codec members "
        f"{', '.join(_CONTRACT)}, got {type(value).__name__}"
    )


def _split_registry_string(text: str) -> dict[CommOp, str]:
    # Commas separate both ops and a codec's options; a comma-separated item
    # that starts with '<op>=' opens a new op, anything else continues the
    # spec of the op before it.
    pairs: dict[CommOp, list[str]] = {}
    current: list[str] | None = None
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, eq, rest = item.partition("=")
        if eq and head.strip().upper() in CommOp.__members__:
            op = CommOp.parse(head)
            if op in pairs:
                raise CodecError(f"CommOp {op.value!r} is given twice in {text!r}")
            current = pairs[op] = [rest.strip()]
        elif current is None:
            if eq and ":" not in head and "/" not in head:
                CommOp.parse(head)  # raises, naming the unknown op
            raise CodecError(
                f"expected '<op>=<forward>/<backward>' items in {text!r}; "
                f"ops: {', '.join(m.value for m in CommOp)}"
            )
        else:
            current.append(item)
    return {op: ",".join(parts) for op, parts in pairs.items()}


def build_registry(
    codecs: Mapping[Any, Any] | str | None = None,
    *,
    forward: Any = None,
    backward: Any = None,
    allow_unsummable_reduce_scatter: bool = False,
) -> dict[str, QuantizedCommCodecs]:
    r"""
    build_registry(codecs: Mapping | str | None = None, *, forward=None, backward=None, allow_unsummable_reduce_scatter=False) -> dict[str, QuantizedCommCodecs]

    Builds the per-collective codec registry that TorchRec sharders take as
    ``qcomm_codecs_registry``.

    Three forms:

    - keywords: ``build_registry(forward="fp16", backward="bf16")`` puts that
      pair on all three :class:`~qcomm.CommOp` members; an omitted side is
      the no-op codec.
    - a mapping from :class:`~qcomm.CommOp` (or its name, any case) to a pair:
      a ``(forward, backward)`` tuple of specs or codec objects, a
      ``"forward/backward"`` string, a :class:`~qcomm.QuantizedCommCodecs`, or
      a single spec or codec used for both directions.
    - one string: ``"pooled_embeddings_all_to_all=int8/fp16,pooled_embeddings_reduce_scatter=fp16"``.

    With no argument at all the string is read from ``QCOMM_CODECS``; if that
    is unset too the result is ``{}``, which means no-op everywhere. Every spec
    string gives a new codec instance, so stateful codecs built from specs
    never share state; codec objects are used as given.

    .. warning::

        TorchRec's reduce-scatter sums the *wire* tensors of all ranks, which
        is only right for codecs whose :class:`~qcomm.CodecInfo` says
        ``summable`` (plain casts: ``noop``, ``fp16``, ``bf16``). A scaled
        format (``int8``, ``fp8_*``, ``mx4``) or a foreign codec without
        ``info`` as the forward codec of ``POOLED_EMBEDDINGS_REDUCE_SCATTER``
        would silently corrupt a TorchRec model, so it is refused unless
        ``allow_unsummable_reduce_scatter`` is set (right only when the
        registry feeds :func:`~qcomm.reduce_scatter_pooled`, which handles such
        codecs with an all-to-all and a local sum). For the same reason the
        backward codec of that op must keep one wire element per input element
        (TorchRec all-gathers it into a buffer of the unencoded size).

    Args:
        codecs (Mapping | str, optional): the mapping or string form. Default: ``None``.
        forward (str | QuantizedCommCodec, optional): forward codec for all ops.
            Default: ``None``.
        backward (str | QuantizedCommCodec, optional): backward codec for all
            ops. Default: ``None``.
        allow_unsummable_reduce_scatter (bool, optional): accept any codec pair
            for ``POOLED_EMBEDDINGS_REDUCE_SCATTER`` (see the warning).
            Default: ``False``.

    Returns:
        dict[str, QuantizedCommCodecs]: pairs keyed by ``CommOp.name``.

    Raises:
        CodecError: an unknown op or codec, a malformed spec, a plugin that
            cannot be loaded, or a reduce-scatter codec TorchRec cannot carry.

    Examples::

        >>> registry = build_registry(forward="noop", backward="noop")
        >>> sorted(registry)
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'POOLED_EMBEDDINGS_REDUCE_SCATTER', 'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
        >>> build_registry({"pooled_embeddings_all_to_all": "noop/noop"}).keys()
        dict_keys(['POOLED_EMBEDDINGS_ALL_TO_ALL'])
    """
    if codecs is not None and (forward is not None or backward is not None):
        raise CodecError("build_registry: give either 'codecs' or 'forward'/'backward', not both")
    registry: dict[str, QuantizedCommCodecs] = {}
    if forward is not None or backward is not None:
        for op in CommOp:
            registry[op.name] = QuantizedCommCodecs(
                forward=_load_one(forward), backward=_load_one(backward)
            )
        return _checked(registry, allow_unsummable_reduce_scatter)
    if codecs is None:
        codecs = os.environ.get(_CODECS_ENV, "").strip()
        if not codecs:
            return registry
    if isinstance(codecs, str):
        mapping: Mapping[Any, Any] = _split_registry_string(codecs)
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
        registry[op.name] = _load_pair(value, f"build_registry[{op.name}]")
    return _checked(registry, allow_unsummable_reduce_scatter)


def _checked(
    registry: dict[str, QuantizedCommCodecs], allow_unsummable_reduce_scatter: bool
) -> dict[str, QuantizedCommCodecs]:
    pair = registry.get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name)
    if pair is None or allow_unsummable_reduce_scatter:
        return registry
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
    return registry
