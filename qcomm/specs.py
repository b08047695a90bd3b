r"""
The codec-spec language of :func:`~qcomm.load_codec`, :func:`~qcomm.build_registry`,
``QCOMM_CODECS`` and the command line (see :doc:`codecs`).
"""

from __future__ import annotations

import difflib
from typing import Any

from qcomm.errors import CodecError
from qcomm.ops import CommOp

__all__ = [
    "parse_codec_spec",
    "parse_host_spec",
    "parse_pair_spec",
    "parse_registry_string",
    "split_codec_specs",
]

#: The name of the adaptive codec in a spec (``adaptive:a|b|...``, see :doc:`adaptive`).
ADAPTIVE = "adaptive"
#: The parts of a codecs-by-host spec (see :func:`parse_host_spec`).
HOST_KEYS = ("same_host", "other_host", "ranks_per_host")


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

    Splits ``name:key=value,...`` into the name and its options (``int``,
    ``float``, ``bool`` or ``str``).

    Args:
        spec (str): the codec spec.

    Returns:
        tuple[str, dict[str, Any]]: the name and the options.

    Raises:
        CodecError: if ``spec`` is not a spec or gives an option twice.

    Examples::

        >>> parse_codec_spec("int8:row_dim=64,stochastic=true")
        ('int8', {'row_dim': 64, 'stochastic': True})
    """
    if not isinstance(spec, str) or not spec.strip():
        # type(spec) of a class is its metaclass (_ProtocolMeta, ABCMeta): name the class.
        got = (
            f"the class {spec.__name__}"
            if isinstance(spec, type)
            else f"{type(spec).__name__} {spec!r}"
        )
        raise CodecError(f"spec: expected a codec spec string like 'int8:row_dim=64', got {got}")
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


def parse_pair_spec(text: str, where: str = "codecs") -> tuple[str, str]:
    r"""
    parse_pair_spec(text: str, where: str = "codecs") -> tuple[str, str]

    Splits a pair spec, ``forward/backward`` or one spec for both.

    Args:
        text (str): the pair spec.
        where (str): what the error names (an argument or a registry entry).

    Returns:
        tuple[str, str]: the forward and the backward codec spec.

    Raises:
        CodecError: if ``text`` has more than one ``/`` or an empty side.

    Examples::

        >>> parse_pair_spec("int8:row_dim=64/fp16")
        ('int8:row_dim=64', 'fp16')
        >>> parse_pair_spec("bf16")
        ('bf16', 'bf16')
    """
    parts = [part.strip() for part in text.split("/")]
    if len(parts) > 2 or not all(parts):
        raise CodecError(f"{where}: expected 'forward/backward' or one codec spec, got {text!r}")
    return parts[0], parts[-1]


def split_codec_specs(text: str) -> list[str]:
    r"""
    split_codec_specs(text: str) -> list[str]

    Splits a list of specs, pairs or ``<op>=<pair>`` items.

    Args:
        text (str): comma- or ``;``-separated; ``key=value`` continues the spec before it.

    Examples::

        >>> split_codec_specs("int8:row_dim=64,stochastic=true,fp16;mx4")
        ['int8:row_dim=64,stochastic=true', 'fp16', 'mx4']
    """
    specs: list[str] = []
    for part in text.split(";"):
        current: list[str] = []
        # The codec that an option after a comma would belong to: options
        # follow a colon, so one without a colon takes none.
        owner = ""
        for item in (p.strip() for p in part.split(",")):
            if not item:
                continue
            if _is_option(item):
                if not current:
                    raise CodecError(
                        f"option {item!r} in {text!r} comes before any codec name; "
                        f"expected e.g. 'int8:row_dim=64,fp16'"
                    )
                if ":" not in owner or _looks_like_op(item):
                    raise CodecError(_not_an_option(item, owner, text))
                current.append(item)
                if "/" in item:
                    owner = item.rsplit("/", 1)[1]
                continue
            if current:
                specs.append(",".join(current))
            current = [item]
            owner = _last_codec(item)
        if current:
            specs.append(",".join(current))
    return specs


def _last_codec(item: str) -> str:
    # The last codec spec of an item: "<op>=" and "<class>_host=" taken off,
    # the last of a host spec's parts and of a pair's sides.
    head, eq, rest = item.partition("=")
    if eq and head.strip().upper() in CommOp.__members__:
        item = rest
    head, eq, rest = item.split("+")[-1].partition("=")
    item = rest if eq and head.strip().lower() in HOST_KEYS else item.split("+")[-1]
    return item.split("/")[-1].strip()


def _looks_like_op(item: str) -> bool:
    # A misspelt operation, not an option (no codec option is named like one).
    key = item.partition("=")[0].strip().lower()
    ops = [m.value for m in CommOp]
    return bool(difflib.get_close_matches(key, ops, n=1, cutoff=0.75))


def _not_an_option(item: str, owner: str, text: str) -> str:
    key = item.partition("=")[0].strip()
    ops = [m.value for m in CommOp]
    close = difflib.get_close_matches(key.lower(), ops, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if not owner:
        why = "no codec comes before it"
    elif ":" not in owner:
        why = f"{owner!r} before it has no colon (options follow one: '{owner}:{item}')"
    else:
        why = "it is named like an operation"
    return (
        f"unknown CommOp {key!r} in {text!r}{hint}: expected one of {', '.join(ops)}; "
        f"nor is it a codec option, since {why}"
    )


def _is_option(item: str) -> bool:
    head, eq, _ = item.partition("=")
    key = head.strip()
    return (
        bool(eq)
        and not set(":/") & set(head)
        and key.upper() not in CommOp.__members__
        and key.lower() not in HOST_KEYS
    )


def parse_host_spec(text: str) -> dict[str, Any] | None:
    r"""
    parse_host_spec(text: str) -> dict[str, Any] | None

    The parts of a codecs-by-host spec, ``same_host=<pair>+other_host=<pair>``
    with an optional ``+ranks_per_host=<n>`` (see :doc:`topology`), or
    ``None`` if ``text`` is not one.

    Args:
        text (str): the spec.

    Returns:
        dict[str, Any] | None: the pair of each class of peer given (a
        ``"forward/backward"`` string) and ``ranks_per_host`` (an int), if given.

    Raises:
        CodecError: if a part is unknown, given twice or empty.

    Examples::

        >>> parse_host_spec("same_host=noop+other_host=int8/bf16")
        {'same_host': 'noop', 'other_host': 'int8/bf16'}
        >>> parse_host_spec("int8") is None
        True
    """
    if not isinstance(text, str) or text.partition("=")[0].strip().lower() not in HOST_KEYS:
        return None
    parts: dict[str, Any] = {}
    for item in text.split("+"):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or key not in HOST_KEYS:
            raise CodecError(
                f"{item.strip()!r} in {text!r}: expected same_host=<pair>, other_host=<pair> "
                f"or ranks_per_host=<n>, joined by '+'"
            )
        if key in parts:
            raise CodecError(f"{key} is given twice in {text!r}")
        if not value:
            raise CodecError(f"{key} in {text!r} has no value")
        if key == "ranks_per_host":
            try:
                parts[key] = int(value)
            except ValueError:
                raise CodecError(
                    f"ranks_per_host in {text!r}: expected a positive int, got {value!r}"
                ) from None
            if parts[key] < 1:
                raise CodecError(
                    f"ranks_per_host in {text!r}: expected a positive int, got {value!r}"
                )
        else:
            parts[key] = value
    return parts


def parse_registry_string(text: str) -> dict[CommOp, str]:
    r"""
    parse_registry_string(text: str) -> dict[CommOp, str]

    The pair of each op a registry string gives.

    Args:
        text (str): one pair for every op, or ``<op>=<pair>`` items.

    Examples::

        >>> parse_registry_string("pooled_embeddings_all_to_all=int8:row_dim=64/fp16")
        {<CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL: 'pooled_embeddings_all_to_all'>: 'int8:row_dim=64/fp16'}
    """
    first = text.split(",")[0].split(";")[0]
    if _is_option(first):
        raise CodecError(_not_an_option(first, "", text))
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
    ops = ", ".join(m.value for m in CommOp)
    if every and pairs:
        raise CodecError(
            f"expected either one codec pair for every op or '<op>=<forward>/<backward>' "
            f"items, not both, in {text!r}; ops: {ops}"
        )
    if len(every) > 1:
        raise CodecError(
            f"expected one codec or 'forward/backward' pair for every op, got "
            f"{len(every)} codecs ({', '.join(every)}) in {text!r}; to give each op its own, "
            f"write '<op>=<forward>/<backward>' items (ops: {ops})"
        )
    return {op: every[0] for op in CommOp} if every else pairs
