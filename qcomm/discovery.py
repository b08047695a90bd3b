r"""
Codec discovery: entry points of group ``qcomm.codecs``, loaded with stevedore.

One fresh scan of package metadata per call decides what exists, what
``QCOMM_PLUGINS`` allows and what conflicts; stevedore's ``DriverManager``
loads the chosen name from that listing, so what is listed is what loads.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from stevedore import DriverManager
from stevedore.extension import error_on_conflict

from qcomm import config
from qcomm.errors import CodecError
from qcomm.specs import ADAPTIVE, parse_codec_spec

if TYPE_CHECKING:  # loading a codec imports torch; listing codecs must not
    from qcomm.types import QuantizedCommCodec

__all__ = ["ENTRY_POINT_GROUP", "CodecEntry", "available_codecs", "codec_entries", "load_codec"]

ENTRY_POINT_GROUP = "qcomm.codecs"


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


def _normalize(dist_name: str) -> str:
    return dist_name.strip().lower().replace("_", "-").replace(".", "-")


def _scan() -> dict[str, list[CodecEntry]]:
    # importlib.metadata rather than stevedore's listing: stevedore lists only
    # through a manager, which imports every plugin (and torch with them), and
    # its cache drops which distribution an entry point comes from, which
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


def _allowed(found: dict[str, list[CodecEntry]]) -> dict[str, list[CodecEntry]]:
    """``found`` less what the setting ``plugins`` (``QCOMM_PLUGINS``) leaves out."""
    raw, where = config._read("plugins")
    if not raw:
        return dict(sorted(found.items()))
    allowed = {_normalize(d) for d in raw.split(",") if d.strip()}
    known = {_normalize(e.distribution): e.distribution for es in found.values() for e in es}
    # A typo would otherwise hide every codec of the distribution meant.
    unknown = sorted(allowed - set(known))
    if unknown or not allowed:
        what = (
            f"{', '.join(unknown)} registers no qcomm codec" if unknown else "names no distribution"
        )
        raise CodecError(
            f"{where}={raw!r}: {what}; distributions that register codecs: "
            f"{', '.join(sorted(known.values())) or 'none'}"
        )
    kept = {
        name: [e for e in entries if _normalize(e.distribution) in allowed]
        for name, entries in sorted(found.items())
    }
    return {name: entries for name, entries in kept.items() if entries}


def codec_entries() -> dict[str, list[CodecEntry]]:
    r"""
    codec_entries() -> dict[str, list[CodecEntry]]

    Every codec name with the distributions that register it (two or more:
    a conflict), read from package metadata without importing any plugin.

    Returns:
        dict[str, list[CodecEntry]]: entries by codec name, names sorted.

    Raises:
        CodecError: if ``QCOMM_PLUGINS`` names a distribution without codecs.

    Examples::

        >>> codec_entries()["noop"][0].value
        'qcomm.types:NoOpQuantizedCommCodec'
    """
    return _allowed(_scan())


def available_codecs() -> list[str]:
    r"""
    available_codecs() -> list[str]

    Names of all registered codecs; nothing is imported.

    Returns:
        list[str]: sorted codec names.

    Examples::

        >>> "noop" in available_codecs()
        True
    """
    return list(codec_entries())


def _entry(name: str) -> tuple[CodecEntry, dict[str, list[CodecEntry]]]:
    """The one allowed entry of ``name`` and all allowed entries, or why there is none."""
    found = _scan()
    allowed = _allowed(found)
    if name not in allowed:
        known = ", ".join(allowed) or "none"
        left_out = found.get(name)
        hidden = (
            f" ({config._read('plugins')[1]} leaves out {left_out[0].distribution})"
            if left_out
            else ""
        )
        raise CodecError(f"unknown codec {name!r}{hidden}; available codecs: {known}")
    entries = allowed[name]
    # Never pick one of two silently: a model trained with one and served
    # with the other would differ without anyone knowing. Refused here, not by
    # stevedore's resolver, which imports both first and names neither's
    # distribution; that stays as the backstop.
    if len(entries) > 1:
        dists = ", ".join(f"{e.distribution} {e.version} ({e.value})" for e in entries)
        raise CodecError(f"codec {name!r} is registered by several distributions: {dists}")
    return entries[0], allowed


class _Listed(DriverManager[Any]):
    """
    stevedore's ``DriverManager`` over the entry points it is given. stevedore
    lists a namespace once per process, in a class attribute
    (``ExtensionManager.ENTRY_POINT_CACHE``), from a disk cache keyed on
    sys.path mtimes packed as 32-bit floats (two minutes apart at today's
    dates): it would miss a plugin installed, or hand out an old entry point
    of one upgraded, after its first look, and it would see the distributions
    ``QCOMM_PLUGINS`` leaves out. This manager's listing is its own (the
    scan's), for its one load; stevedore's cache, which other code may use,
    is left alone.
    """

    def __init__(self, listing: list[importlib.metadata.EntryPoint], name: str) -> None:
        # Set before the base class's __init__, which lists and loads.
        self._listing = listing
        super().__init__(
            ENTRY_POINT_GROUP,
            name,
            on_missing_entrypoints_callback=None,  # the scan has found it
            conflict_resolver=error_on_conflict,
        )

    def list_entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return self._listing


def _load_factory(name: str, allowed: dict[str, list[CodecEntry]]) -> Any:
    """The object entry point ``name`` names, imported by stevedore from ``allowed``."""
    listing = [
        importlib.metadata.EntryPoint(name=e.name, value=e.value, group=ENTRY_POINT_GROUP)
        for entries in allowed.values()
        for e in entries
    ]
    return _Listed(listing, name).driver


# A plugin's package -> (its module object, "distribution version").
_LOADED: dict[str, tuple[Any, str]] = {}


def _is_namespace(module: Any) -> bool:
    return hasattr(module, "__path__") and getattr(module, "__file__", None) is None


def _package(entry: CodecEntry) -> str:
    """The plugin's own package: its module's first enclosing one that is not a namespace."""
    # The whole package, not the one module: a new int8 module next to the
    # old package's shared helpers would be a mix of two versions. A namespace
    # package (``acme`` of ``acme.qcomm_fp16``) is shared by distributions.
    parts = entry.value.partition(":")[0].strip().split(".")
    for end in range(1, len(parts) + 1):
        name = ".".join(parts[:end])
        module = sys.modules.get(name)
        if module is None or not _is_namespace(module):
            return name
    return ".".join(parts)


def _process_start() -> float | None:
    """The latest time (``time.time()`` scale) this process can have started, where Linux says."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        # The start is counted in whole clock ticks since boot: round it up.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - (ticks + 1) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


# Where the process's start is unknown (not Linux), a plugin's files that
# changed after qcomm was imported may be newer than the code in memory.
_IMPORTED_AT = time.time()


def _changed_since_start(package: str) -> str | None:
    """A file of ``package``'s imported modules changed since this process started, if any."""
    started = _process_start() or _IMPORTED_AT
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or (name != package and not name.startswith(package + ".")):
            continue
        try:
            # ctime: a new or rewritten file has a new one, whatever mtime it was given.
            changed = os.stat(path).st_ctime > started
        except FileNotFoundError:  # removed by the upgrade
            changed = True
        except OSError:  # not a plain file (inside a zip archive): no sign either way
            continue
        if changed:
            return str(path)
    return None


def _refuse_stale_package(entry: CodecEntry, where: str) -> None:
    """Raises if this process holds code of another version of the plugin's package."""
    package = _package(entry)
    loaded = sys.modules.get(package)
    if loaded is None:
        return
    release = f"{entry.distribution} {entry.version}"
    seen = _LOADED.get(package)
    if seen is not None and seen[0] is loaded:
        if seen[1] != release:
            raise CodecError(
                f"{where}: this process imported {package} from {seen[1]} before it was "
                f"replaced by {release}; a package cannot be swapped safely in a running "
                f"process, so restart the process to use {release}"
            )
        return
    # Imported by someone else (the user's own code): which version it was is
    # unknown, but if its files changed after this process started, the code
    # in memory may be older than what they hold now.
    changed = _changed_since_start(package)
    if changed is not None:
        raise CodecError(
            f"{where}: this process imported {package} before it was replaced on disk "
            f"({changed} changed since the process started); a package cannot be swapped "
            f"safely in a running process, so restart the process to use {release}"
        )


def _accepted_options(factory: Any) -> tuple[list[str], bool]:
    """The factory's keyword names, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return [], True
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    ]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def load_codec(spec: str, **options: Any) -> QuantizedCommCodec:
    r"""
    load_codec(spec: str, **options: Any) -> QuantizedCommCodec

    Builds a codec from its spec, importing only the plugin that provides it.
    ``max_error`` and ``on_exceed`` in any spec give the codec a budget (an
    :class:`~qcomm.AdaptiveCodec` of one candidate); ``adaptive:a|b|...``
    chooses among the candidate specs ``a``, ``b``, ... (each with its own
    options), with the options ``max_error``, ``window`` and ``on_exceed``
    (see :doc:`adaptive`).

    Args:
        spec (str): ``name`` or ``name:key=value,...``.
        **options (Any): more options; they override those in ``spec``.

    Returns:
        QuantizedCommCodec: a new codec instance.

    Raises:
        CodecError: if the spec is malformed or names an unknown or conflicting
            codec, or the plugin fails to import, build or keep the contract.

    Examples::

        >>> load_codec("noop").calc_quantized_size(8)
        8
    """
    if isinstance(spec, str) and spec.strip().partition(":")[0].strip() == ADAPTIVE:
        return _adaptive(spec, options)
    name, spec_options = parse_codec_spec(spec)
    spec_options.update(options)
    budget = {k: spec_options.pop(k) for k in _GUARD_KEYS if k in spec_options}
    codec = _load(name, spec_options)
    if not budget:
        return codec
    from qcomm.adaptive import AdaptiveCodec

    try:
        return cast("QuantizedCommCodec", AdaptiveCodec([codec], **budget))
    except (TypeError, ValueError) as err:
        raise CodecError(f"codec spec {spec!r}: {err}") from err


# The options of a budget, on any codec; an adaptive codec also takes window.
_GUARD_KEYS = ("max_error", "on_exceed")
_ADAPTIVE_KEYS = ("max_error", "on_exceed", "window")


def _adaptive(spec: str, options: dict[str, Any]) -> QuantizedCommCodec:
    """An :class:`~qcomm.AdaptiveCodec` from ``adaptive:a|b|...`` (options anywhere)."""
    from qcomm.adaptive import AdaptiveCodec

    rest = spec.strip().partition(":")[2]
    own: dict[str, Any] = {}
    candidates = []
    for part in rest.split("|"):
        items = [item.strip() for item in part.split(",")]
        kept = []
        for item in items:
            key, eq, value = item.partition("=")
            if eq and ":" not in key and key.strip() in _ADAPTIVE_KEYS:
                if key.strip() in own:
                    raise CodecError(f"option {key.strip()!r} is given twice in {spec!r}")
                own[key.strip()] = parse_codec_spec(f"x:{item}")[1][key.strip()]
            elif item:
                kept.append(item)
        if not kept:
            raise CodecError(
                f"codec spec {spec!r}: expected candidate specs joined by '|', e.g. "
                f"'adaptive:mx4|int8|bf16', got an empty candidate"
            )
        candidates.append(",".join(kept))
    unknown = sorted(set(options) - set(_ADAPTIVE_KEYS))
    if unknown:
        raise CodecError(
            f"codec spec {spec!r}: the adaptive codec takes options {', '.join(_ADAPTIVE_KEYS)}, "
            f"got {', '.join(unknown)}"
        )
    own.update(options)
    codecs = []
    for candidate in candidates:
        if candidate.partition(":")[0].strip() == ADAPTIVE:
            raise CodecError(f"codec spec {spec!r}: an adaptive codec cannot be a candidate")
        codecs.append(load_codec(candidate))
    try:
        return cast("QuantizedCommCodec", AdaptiveCodec(codecs, **own))
    except (TypeError, ValueError) as err:
        raise CodecError(f"codec spec {spec!r}: {err}") from err


def _load(name: str, spec_options: dict[str, Any]) -> QuantizedCommCodec:
    """The codec ``name`` built with ``spec_options``, checked against the contract."""
    entry, allowed = _entry(name)
    release = f"{entry.distribution} {entry.version}"
    where = f"codec {name!r} ({entry.value}, distribution {release})"
    _refuse_stale_package(entry, where)
    try:
        factory = _load_factory(name, allowed)
    except Exception as err:
        raise CodecError(f"{where} failed to import: {type(err).__name__}: {err}") from err
    # Now that the namespaces on the way are imported, the package is known.
    package = _package(entry)
    loaded = sys.modules.get(package)
    if package not in _LOADED or _LOADED[package][0] is not loaded:
        _LOADED[package] = (loaded, release)

    accepted, takes_any = _accepted_options(factory)
    unknown = sorted(set(spec_options) - set(accepted))
    if unknown and not takes_any:
        raise CodecError(
            f"{where} does not accept option(s) {', '.join(unknown)}; "
            f"accepted options: {', '.join(accepted) or 'none'}"
        )
    try:
        codec: QuantizedCommCodec = factory(**spec_options)
    except Exception as err:
        raise CodecError(
            f"{where} could not be built with options {spec_options}: {type(err).__name__}: {err}"
        ) from err
    from qcomm.types import contract_problem

    problem = contract_problem(codec)
    if problem:
        raise CodecError(f"{where} returned {problem}")
    return codec
