r"""
qcomm's settings, in one object (see :doc:`configuration`).

In the spirit of ``torch.backends``' flags: the environment gives the
defaults, read once, at the first :func:`get` (so a spawned rank reads its
own environment, at its first use of qcomm); code sets fields with
:func:`configure`, or for a block with :func:`configured`. Every value is
checked where it is given: a bad variable's error names the variable, a bad
field's names the field.

This is also the one module of qcomm that reads the environment:
:func:`launch_env` reads a launcher's variables (``RANK``,
``LOCAL_WORLD_SIZE``, ...) and :func:`child_env` gives the environment of a
child process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "VARIABLES",
    "Settings",
    "child_env",
    "configure",
    "configured",
    "get",
    "launch_env",
]

#: The transports ``transport`` may force (besides ``"auto"``).
TRANSPORTS = ("point_to_point", "all_to_all")
_VERIFY = {"": "first", "1": "always", "0": "never"}
_DOORS = ("qcomm", "torchrec")
_EXIT_TIMEOUT = 10.0
# torchrun's number of ranks on this host: the default ranks per host.
_TORCHRUN = "LOCAL_WORLD_SIZE"


@dataclasses.dataclass(frozen=True)
class Settings:
    r"""
    qcomm's settings: what :func:`get` returns.

    Args:
        transport (str): how a collective's bytes travel: ``"auto"`` (each
            backend's own: point-to-point on gloo with CPU tensors, one
            all-to-all per call otherwise), ``"point_to_point"`` (gloo on CPU
            only) or ``"all_to_all"``; alike on every rank.
            ``QCOMM_TRANSPORT``. Default: ``"auto"``.
        verify (str): when ranks check that they agree on a call's
            arguments: ``"first"`` (the first call of each collective on each
            group), ``"always"`` or ``"never"``. ``QCOMM_VERIFY`` (unset,
            ``1``, ``0``). Default: ``"first"``.
        ranks_per_host (int | None): ranks per host, numbered host by host,
            for codecs by host; ``None``: learned from the host names.
            ``QCOMM_RANKS_PER_HOST``, else torchrun's ``LOCAL_WORLD_SIZE``.
            Default: ``None``.
        torchrec_collectives (str): the transport of TorchRec's collectives
            with qcomm codecs: ``"qcomm"`` (qcomm's exchange) or
            ``"torchrec"`` (TorchRec's own). ``QCOMM_TORCHREC_COLLECTIVES``.
            Default: ``"qcomm"``.
        exit_timeout (float): seconds the process waits at exit for its calls
            in flight. ``QCOMM_EXIT_TIMEOUT``. Default: ``10.0``.
        plugins (str): the distributions whose codecs may load, separated by
            commas; ``""``: all. ``QCOMM_PLUGINS``. Default: ``""``.
        codecs (str): the registry :func:`~qcomm.build_registry` builds when
            given nothing (see :doc:`codecs`); ``""``: none.
            ``QCOMM_CODECS``. Default: ``""``.
        measure_errors (bool): whether every call that encodes measures its
            error on a sample of what it sends, for :func:`~qcomm.error_history`
            (see :doc:`adaptive`); adaptive and budgeted codecs always do.
            ``QCOMM_MEASURE_ERRORS`` (``1`` or ``0``). Default: ``False``.
    """

    transport: str = "auto"
    verify: str = "first"
    ranks_per_host: int | None = None
    torchrec_collectives: str = "qcomm"
    exit_timeout: float = _EXIT_TIMEOUT
    plugins: str = ""
    codecs: str = ""
    measure_errors: bool = False


#: Each field's environment variable.
VARIABLES: Mapping[str, str] = {
    "transport": "QCOMM_TRANSPORT",
    "verify": "QCOMM_VERIFY",
    "ranks_per_host": "QCOMM_RANKS_PER_HOST",
    "torchrec_collectives": "QCOMM_TORCHREC_COLLECTIVES",
    "exit_timeout": "QCOMM_EXIT_TIMEOUT",
    "plugins": "QCOMM_PLUGINS",
    "codecs": "QCOMM_CODECS",
    "measure_errors": "QCOMM_MEASURE_ERRORS",
}
assert tuple(VARIABLES) == tuple(f.name for f in dataclasses.fields(Settings))


# Each parser takes its variable's text, stripped.
def _transport(raw: str, name: str) -> str:
    value = raw.lower()
    if value in ("", "auto"):
        return "auto"
    if value in TRANSPORTS:
        return value
    raise ValueError(
        f"{name}: expected 'all_to_all' (one all-to-all per call, NCCL's transport), "
        f"'point_to_point' (gloo on CPU only) or unset/'auto' (each backend's own), got {value!r}"
    )


def _verify(raw: str, name: str) -> str:
    if raw in _VERIFY:
        return _VERIFY[raw]
    raise ValueError(
        f"{name}: expected '1' (check that ranks agree on every call), '0' (never) or "
        f"unset (the first call of each collective on each process group), got {raw!r}"
    )


def _positive(raw: str, name: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}: expected a positive number of ranks per host, got {raw!r}")
    return value


def _door(raw: str, name: str) -> str:
    value = raw.lower()
    if value in ("", "qcomm"):
        return "qcomm"
    if value == "torchrec":
        return value
    raise ValueError(f"{name}: expected 'qcomm' or 'torchrec', got {value!r}")


def _seconds(raw: str, name: str) -> float:
    if not raw:
        return _EXIT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {raw!r}")
    return seconds


def _text(raw: str, name: str) -> str:
    return raw


def _switch(raw: str, name: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "on"):
        return True
    if value in ("", "0", "false", "off"):
        return False
    raise ValueError(f"{name}: expected '1' or '0', got {raw!r}")


# How each field's variable is read: its text to its value.
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "transport": _transport,
    "verify": _verify,
    "ranks_per_host": _positive,
    "torchrec_collectives": _door,
    "exit_timeout": _seconds,
    "plugins": _text,
    "codecs": _text,
    "measure_errors": _switch,
}


def _checked(field: str, value: Any) -> Any:
    """A value given in code for ``field``, checked; the error names the field."""
    where = f"qcomm.config: {field}"
    if field == "transport":
        if value not in ("auto", *TRANSPORTS):
            raise ValueError(
                f"{where}: expected 'auto', 'point_to_point' or 'all_to_all', got {value!r}"
            )
    elif field == "verify":
        if value not in ("first", "always", "never"):
            raise ValueError(f"{where}: expected 'first', 'always' or 'never', got {value!r}")
    elif field == "torchrec_collectives":
        if value not in _DOORS:
            raise ValueError(f"{where}: expected 'qcomm' or 'torchrec', got {value!r}")
    elif field == "ranks_per_host":
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(
                f"{where}: expected a positive int (ranks per host) or None, got {value!r}"
            )
    elif field == "exit_timeout":
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(f"{where}: expected a finite number of seconds >= 0, got {value!r}")
        value = float(value)
    elif field == "measure_errors":
        if not isinstance(value, bool):
            raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    elif not isinstance(value, str):
        raise TypeError(f"{where}: expected a str, got {type(value).__name__} {value!r}")
    return value


# The environment's values by field, each with the name of the variable it
# came from (or the error that names it): read at the first get(), then kept.
_environment: dict[str, tuple[Any, str] | ValueError] | None = None
# The fields set in code, by configure() and configured().
_code: dict[str, Any] = {}
_UNSET = object()
_lock = threading.RLock()


def _read_environment() -> dict[str, tuple[Any, str] | ValueError]:
    read: dict[str, tuple[Any, str] | ValueError] = {}
    for field, name in VARIABLES.items():
        raw = os.environ.get(name, "").strip()
        if field == "ranks_per_host" and not raw:
            # torchrun numbers ranks host by host and says how many share one.
            name, raw = _TORCHRUN, os.environ.get(_TORCHRUN, "").strip()
            if not raw:
                read[field] = (None, "host names")
                continue
        try:
            read[field] = (_PARSERS[field](raw, name), name)
        except ValueError as err:
            read[field] = err
    return read


def _read(field: str) -> tuple[Any, str]:
    """
    ``field``'s value and where it comes from: ``"qcomm.config.<field>"``
    when set in code, else the variable's name (the variable's error raised
    if it is invalid: only this field's, so that one bad variable fails only
    what reads it, as where the ranks must first tell each other).
    """
    global _environment
    # Read on every collective call: the lock is taken only for the first,
    # lazy read of the environment (a dict lookup is atomic).
    code = _code.get(field, _UNSET)
    if code is not _UNSET:
        return code, f"qcomm.config.{field}"
    environment = _environment
    if environment is None:
        with _lock:
            if _environment is None:
                _environment = _read_environment()
            environment = _environment
    entry = environment[field]
    if isinstance(entry, ValueError):
        raise ValueError(str(entry))
    return entry


def get() -> Settings:
    r"""
    get() -> Settings

    The current settings: those set in code, the environment's for the rest
    (read at the first call, then kept).

    Returns:
        Settings: a frozen snapshot; set fields with :func:`configure`.

    Raises:
        ValueError: if a variable of a field not set in code is invalid; the
            message names each such variable.

    Examples::

        >>> with configured(verify="always"):
        ...     get().verify
        'always'
    """
    values: dict[str, Any] = {}
    problems: list[str] = []
    for field in VARIABLES:
        try:
            values[field] = _read(field)[0]
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))
    return Settings(**values)


def _fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [name for name in fields if name not in VARIABLES]
    if unknown:
        raise TypeError(
            f"qcomm.config: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"fields: {', '.join(VARIABLES)}"
        )
    return {name: _checked(name, value) for name, value in fields.items()}


def configure(**fields: Any) -> None:
    r"""
    configure(**fields: Any) -> None

    Sets fields of :class:`Settings` in code, over their variables, for the
    rest of the process (or until a :func:`configured` block around it ends).
    Nothing is set if any value is refused.

    Args:
        **fields (Any): field names and values.

    Raises:
        TypeError: if a name is no field, or a value not of the field's type.
        ValueError: if a value is out of the field's range; the message names the field.

    Examples::

        >>> configure(verify="sometimes")
        Traceback (most recent call last):
        ...
        ValueError: qcomm.config: verify: expected 'first', 'always' or 'never', got 'sometimes'
    """
    checked = _fields(fields)
    with _lock:
        _code.update(checked)


def configured(**fields: Any) -> contextlib.AbstractContextManager[Settings]:
    r"""
    configured(**fields: Any) -> ContextManager[Settings]

    :func:`configure` for a block: the fields given are set on entry and put
    back as they were (set in code or not) on exit, an exception's included.
    Blocks nest. The settings are the process's, not the thread's.

    Args:
        **fields (Any): field names and values.

    Returns:
        ContextManager[Settings]: yields :func:`get`'s settings inside the block.

    Raises:
        TypeError: if a name is no field, or a value not of the field's type.
        ValueError: if a value is out of the field's range; the message names the field.

    Examples::

        >>> with configured(torchrec_collectives="torchrec") as settings:
        ...     settings.torchrec_collectives
        'torchrec'
    """
    # Checked here, not on entry: a bad value is told where the block is written.
    return _block(_fields(fields))


@contextlib.contextmanager
def _block(checked: dict[str, Any]) -> Iterator[Settings]:
    missing = object()
    with _lock:
        before = {name: _code.get(name, missing) for name in checked}
        _code.update(checked)
    try:
        yield get()
    finally:
        with _lock:
            for name, value in before.items():
                if value is missing:
                    _code.pop(name, None)
                else:
                    _code[name] = value


def launch_env(name: str) -> str | None:
    r"""
    launch_env(name: str) -> str | None

    A variable a launcher sets for this process (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS``, a parent's word
    to its child), read now. qcomm's own variables are read through
    :func:`get`.

    Args:
        name (str): the variable.

    Returns:
        str | None: its value, or ``None`` where it is unset.

    Raises:
        ValueError: if ``name`` is one of :data:`VARIABLES`.
    """
    if name in VARIABLES.values():
        field = next(f for f, n in VARIABLES.items() if n == name)
        raise ValueError(
            f"launch_env: {name} is qcomm's setting {field!r}: read it with qcomm.config.get()"
        )
    return os.environ.get(name)


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    r"""
    child_env(extra: Mapping[str, str]) -> dict[str, str]

    The environment for a child process: this process's, with ``extra`` over
    it. Fields set in code are not in it (the child reads its own variables).

    Args:
        extra (Mapping[str, str]): variables to add or replace.

    Raises:
        TypeError: if a name or value of ``extra`` is not a str.
    """
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"child_env: extra: expected str names and values, got {key!r}: {value!r}"
            )
    return {**os.environ, **extra}


def _reread() -> None:
    """Reads the environment again at the next use (for tests that change it in-process)."""
    global _environment
    with _lock:
        _environment = None
