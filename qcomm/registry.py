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
distribution names, restricts which distributions may provide codecs at all;
a name in it that registers no codec is an error, not an empty list.

One scan of the package metadata, made afresh on every call, is the only
source of truth: what :func:`codec_entries` lists is what :func:`load_codec`
loads, also after a plugin was installed or upgraded in the running process.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from stevedore import NamedExtensionManager
from stevedore.extension import Extension

from qcomm.types import (
    CodecError,
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    codec_info,
    contract_problem,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CodecEntry",
    "available_codecs",
    "build_registry",
    "codec_entries",
    "load_codec",
    "parse_codec_spec",
    "split_codec_specs",
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


def _allowed_distributions(found: dict[str, list[CodecEntry]]) -> set[str] | None:
    raw = os.environ.get(_PLUGINS_ENV, "").strip()
    if not raw:
        return None
    allowed = {_normalize(d) for d in raw.split(",") if d.strip()}
    known = {_normalize(e.distribution): e.distribution for es in found.values() for e in es}
    # A typo would otherwise hide every codec of the distribution meant.
    unknown = sorted(allowed - set(known))
    if unknown or not allowed:
        what = (
            f"{', '.join(unknown)} registers no qcomm codec" if unknown else "names no distribution"
        )
        raise CodecError(
            f"{_PLUGINS_ENV}={raw!r}: {what}; distributions that register codecs: "
            f"{', '.join(sorted(known.values())) or 'none'}"
        )
    return allowed


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

    Raises:
        CodecError: if ``QCOMM_PLUGINS`` names a distribution that registers
            no codec (the message lists those that do).
    """
    return _allowed_entries(_all_entries())


def _allowed_entries(found: dict[str, list[CodecEntry]]) -> dict[str, list[CodecEntry]]:
    allowed = _allowed_distributions(found)
    kept = {
        name: [e for e in entries if allowed is None or _normalize(e.distribution) in allowed]
        for name, entries in found.items()
    }
    return {name: entries for name, entries in sorted(kept.items()) if entries}


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
        CodecError: if ``spec`` is not a non-empty string, an option is not
            ``key=value``, or an option is given twice.

    Examples::

        >>> parse_codec_spec("int8:row_dim=64,stochastic=true")
        ('int8', {'row_dim': 64, 'stochastic': True})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(
            f"spec: expected a codec spec string like 'int8:row_dim=64', "
            f"got {type(spec).__name__} {spec!r}"
        )
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise CodecError(f"codec spec {spec!r} has no codec name before ':'")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise CodecError(f"option {item!r} in codec spec {spec!r} is not of the form key=value")
        # Last-one-wins would let a pasted spec silently override itself.
        if key in options:
            raise CodecError(f"option {key!r} is given twice in codec spec {spec!r}")
        options[key] = _parse_value(value.strip())
    return name, options


def split_codec_specs(text: str) -> list[str]:
    r"""
    split_codec_specs(text: str) -> list[str]

    Splits a list of codec specs (or ``forward/backward`` pairs, or
    ``<op>=<pair>`` items), whose options also use commas; the one reading
    shared by ``qcomm bench --codecs``, :func:`build_registry`'s string form
    and ``QCOMM_CODECS``.

    ``;`` always separates. Within a ``;``-part, a comma-separated item of the
    form ``key=value`` (an ``=`` with no ``:`` or ``/`` before it, and ``key``
    not a :class:`~qcomm.CommOp`) is one more option of the spec before it; any
    other item starts a new spec. Codec names hold no ``=`` and option names
    no ``:``, so this reading is the only one possible.

    Args:
        text (str): e.g. ``"int8:row_dim=64,stochastic=true,fp16"``.

    Returns:
        list[str]: one spec per item, e.g.
        ``["int8:row_dim=64,stochastic=true", "fp16"]``.

    Raises:
        CodecError: if the list starts with a bare option.

    Examples::

        >>> split_codec_specs("int8:row_dim=64,stochastic=true,fp16;mx4")
        ['int8:row_dim=64,stochastic=true', 'fp16', 'mx4']
        >>> split_codec_specs("pooled_embeddings_all_to_all=int8:row_dim=64/fp16,sequence_embeddings_all_to_all=fp16")
        ['pooled_embeddings_all_to_all=int8:row_dim=64/fp16', 'sequence_embeddings_all_to_all=fp16']
    """
    specs: list[str] = []
    for part in text.split(";"):
        current: list[str] = []
        for item in (p.strip() for p in part.split(",")):
            if not item:
                continue
            if _is_option(item):
                if not current:
                    raise CodecError(
                        f"option {item!r} in {text!r} comes before any codec name; "
                        f"expected e.g. 'int8:row_dim=64,fp16'"
                    )
                current.append(item)
                continue
            if current:
                specs.append(",".join(current))
            current = [item]
        if current:
            specs.append(",".join(current))
    return specs


def _is_option(item: str) -> bool:
    head, eq, _ = item.partition("=")
    return bool(eq) and not set(":/") & set(head) and head.strip().upper() not in CommOp.__members__


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


class _EntryPointLoader(NamedExtensionManager[Any]):
    """stevedore's loader, handed the entry point of the one metadata scan."""

    def __init__(self, entry_point: importlib.metadata.EntryPoint) -> None:
        # stevedore's own scan is cached in-process and on disk, and would
        # hand out an old entry point after an upgrade: never consult it.
        self._entry_point = entry_point
        super().__init__(
            ENTRY_POINT_GROUP,
            names=[entry_point.name],
            on_load_failure_callback=_raise_load_failure,
            on_missing_entrypoints_callback=None,
            conflict_resolver=_refuse_conflicts,
        )

    def list_entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return [self._entry_point]


# Top-level package of a plugin -> (that package's module object, "distribution
# version" it was loaded from).
_LOADED: dict[str, tuple[Any, str]] = {}


def _refuse_stale_package(entry: CodecEntry, where: str) -> str:
    """The plugin's top-level package; raises if this process holds another version of it."""
    # The whole package, not the one module: a new int8 module next to the
    # old package's shared helpers would be a mix of two versions.
    package = entry.value.partition(":")[0].strip().partition(".")[0]
    seen = _LOADED.get(package)
    release = f"{entry.distribution} {entry.version}"
    if seen is not None and sys.modules.get(package) is seen[0] and seen[1] != release:
        raise CodecError(
            f"{where}: this process imported {package} from {seen[1]} before it was replaced "
            f"by {release}; a package cannot be swapped safely in a running process, so "
            f"restart the process to use {release}"
        )
    return package


def load_codec(spec: str, **options: Any) -> QuantizedCommCodec:
    r"""
    load_codec(spec: str, **options: Any) -> QuantizedCommCodec

    Builds a codec from its spec, importing only the plugin that provides it.

    The plugin is found by the same fresh scan of package metadata that
    :func:`codec_entries` lists, so a plugin installed or upgraded while the
    process runs is loaded as listed.

    Args:
        spec (str): ``name`` or ``name:key=value,...``.
        **options (Any): more options for the plugin's factory; they override
            those in ``spec``.

    Returns:
        QuantizedCommCodec: a new codec instance.

    Raises:
        CodecError: ``spec`` is not a spec string, the name is unknown (the
            available ones are listed), two allowed distributions register it,
            an option is not accepted (the accepted ones are listed) or given
            twice in ``spec``, the plugin fails to import or construct (its
            distribution and the cause are named), what it builds breaks the
            codec contract, or its distribution was upgraded after this
            process imported the old version.

    Examples::

        >>> load_codec("noop").calc_quantized_size(8)
        8
    """
    name, spec_options = parse_codec_spec(spec)
    spec_options.update(options)
    found = _all_entries()
    allowed = _allowed_entries(found)
    if name not in allowed:
        known = ", ".join(allowed) or "none"
        left_out = found.get(name)
        hidden = f" ({_PLUGINS_ENV} leaves out {left_out[0].distribution})" if left_out else ""
        raise CodecError(f"unknown codec {name!r}{hidden}; available codecs: {known}")
    entries = allowed[name]
    if len(entries) > 1:
        dists = ", ".join(f"{e.distribution} {e.version} ({e.value})" for e in entries)
        raise CodecError(f"codec {name!r} is registered by several distributions: {dists}")
    entry = entries[0]
    where = f"codec {name!r} ({entry.value}, distribution {entry.distribution} {entry.version})"
    package = _refuse_stale_package(entry, where)
    entry_point = importlib.metadata.EntryPoint(
        name=entry.name, value=entry.value, group=ENTRY_POINT_GROUP
    )
    try:
        factory = _EntryPointLoader(entry_point)[name].plugin
    except CodecError as err:
        raise CodecError(f"{where} {err}") from err.__cause__
    loaded = sys.modules.get(package)
    if package not in _LOADED or _LOADED[package][0] is not loaded:
        _LOADED[package] = (loaded, f"{entry.distribution} {entry.version}")

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
    problem = contract_problem(codec)
    if problem:
        raise CodecError(f"{where} returned {problem}")
    return codec


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
        forward = parts[0]
        backward = parts[1] if len(parts) == 2 else parts[0]
        return QuantizedCommCodecs(
            forward=_load_one(forward, f"{where}.forward"),
            backward=_load_one(backward, f"{where}.backward"),
        )
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise CodecError(
                f"{where}: expected a (forward, backward) pair, got {len(value)} items"
            )
        return QuantizedCommCodecs(
            forward=_load_one(value[0], f"{where}.forward"),
            backward=_load_one(value[1], f"{where}.backward"),
        )
    # A single codec object serves both directions.
    codec = _load_one(value, where)
    return QuantizedCommCodecs(forward=codec, backward=codec)


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


def _parse_registry_string(text: str) -> dict[CommOp, str]:
    # Either one spec or pair for every op, or '<op>=<forward>/<backward>' items.
    first = text.split(",")[0].split(";")[0]
    if _is_option(first):
        CommOp.parse(first.partition("=")[0])  # raises, naming the unknown op
    pairs: dict[CommOp, str] = {}
    every: list[str] = []
    for item in split_codec_specs(text):
        head, eq, rest = item.partition("=")
        if eq and head.strip().upper() in CommOp.__members__:
            op = CommOp.parse(head)
            if op in pairs:
                raise CodecError(f"CommOp {op.value!r} is given twice in {text!r}")
            pairs[op] = rest.strip()
        else:
            every.append(item)
    if every and pairs:
        raise CodecError(
            f"expected either one codec pair for every op or '<op>=<forward>/<backward>' "
            f"items, not both, in {text!r}; ops: {', '.join(m.value for m in CommOp)}"
        )
    if len(every) > 1:
        raise CodecError(
            f"expected one codec or 'forward/backward' pair for every op, got "
            f"{len(every)} codecs ({', '.join(every)}) in {text!r}; to give each op its own, "
            f"write '<op>=<forward>/<backward>' items (ops: {', '.join(m.value for m in CommOp)})"
        )
    return {op: every[0] for op in CommOp} if every else pairs


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
    - one string: a spec or pair for all three ops (``"fp16"``,
      ``"int8:row_dim=64/fp16"``), or ``<op>=<pair>`` items
      (``"pooled_embeddings_all_to_all=int8/fp16,pooled_embeddings_reduce_scatter=fp16"``),
      split as ``qcomm.registry.split_codec_specs`` splits the CLI's ``--codecs``.

    With no argument at all the string is read from ``QCOMM_CODECS``; if that
    is unset too the result is ``{}``, which means no-op everywhere. Every spec
    string gives a new codec instance, so stateful codecs built from specs
    never share state; codec objects are used as given. Anything else (``None``
    inside a pair, a number, a class rather than an instance, an object
    lacking a member of the codec contract or whose ``quantized_dtype`` is not
    a ``torch.dtype``) is refused, naming where it was given.

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
        CodecError: an unknown op or codec, a malformed spec, a value that is
            not a codec, a plugin that cannot be loaded, or a reduce-scatter
            codec TorchRec cannot carry; the message names the argument (or
            ``QCOMM_CODECS``) and the op.

    Examples::

        >>> registry = build_registry(forward="noop", backward="noop")
        >>> sorted(registry)
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'POOLED_EMBEDDINGS_REDUCE_SCATTER', 'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
        >>> build_registry({"pooled_embeddings_all_to_all": "noop/noop"}).keys()
        dict_keys(['POOLED_EMBEDDINGS_ALL_TO_ALL'])
        >>> len(build_registry("noop/noop"))
        3
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
            mapping: Mapping[Any, Any] = _parse_registry_string(codecs)
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
    # An omitted side is the no-op codec; each op gets its own instance.
    if value is None:
        return NoOpQuantizedCommCodec()
    return _load_one(value, f"build_registry: {name}")


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
