r"""
The per-collective codec registry that TorchRec sharders take as
``qcomm_codecs_registry``: :func:`build_registry`, also from ``QCOMM_CODECS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qcomm import config, torchrec_exchange
from qcomm.discovery import load_codec
from qcomm.specs import HOST_KEYS, parse_host_spec, parse_pair_spec, parse_registry_string
from qcomm.types import (
    CodecError,
    CommOp,
    HostCodecs,
    NoOpQuantizedCommCodec,
    QuantizedCommCodecs,
    codec_info,
    contract_problem,
)

__all__ = ["build_registry", "load_pair"]

# What a refused reduce-scatter codec is replaced with in the suggested fix:
# summable, one wire element per element, and float32's range.
_RS_FIX = "bf16"


@dataclass
class _Given:
    # How the caller gave the registry, so that an error can write its fix
    # in the same form: "env" (QCOMM_CODECS), "setting" (the setting codecs,
    # set in code), "string", "mapping" or "keywords"; entries are (op, the
    # caller's key, the caller's value).
    form: str
    where: str = "build_registry"
    entries: list[tuple[CommOp, Any, Any]] = field(default_factory=list)


def load_pair(value: Any, where: str = "codecs") -> QuantizedCommCodecs:
    r"""
    load_pair(value: Any, where: str = "codecs") -> QuantizedCommCodecs

    One entry of a registry: a ``"forward/backward"`` string, a
    ``(forward, backward)`` tuple, one spec or codec for both directions, a
    :class:`~qcomm.QuantizedCommCodecs`, or codecs by host (a
    ``"same_host=<pair>+other_host=<pair>"`` string, a mapping with those
    keys, or a :class:`~qcomm.HostCodecs`; see :doc:`topology`).

    Args:
        value (Any): the entry.
        where (str, optional): what errors name. Default: ``"codecs"``.

    Returns:
        QuantizedCommCodecs: the codecs (a :class:`~qcomm.HostCodecs` by
        host); each spec gives a new codec instance.

    Raises:
        CodecError: if a spec is unknown or malformed, or an object breaks the
            codec contract; the message names ``where``.

    Examples::

        >>> load_pair("same_host=noop+other_host=fp16/bf16").other_host.backward
        BF16Codec(loss_scale=None)
    """
    by_host = _host_parts(value, where)
    if by_host is not None:
        per_host = by_host.pop("ranks_per_host", None)
        try:
            return HostCodecs(
                **{key: _load_pair(pair, f"{where}.{key}") for key, pair in by_host.items()},
                ranks_per_host=per_host,
            )
        except (TypeError, ValueError) as err:
            raise CodecError(f"{where}: {err}") from err
    return _load_pair(value, where)


def _host_parts(value: Any, where: str) -> dict[str, Any] | None:
    """The parts of codecs by host given as a string or a mapping, else ``None``."""
    if isinstance(value, str):
        try:
            return parse_host_spec(value)
        except CodecError as err:
            raise CodecError(f"{where}: {err}") from err
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in HOST_KEYS]
        if unknown or not value:
            raise CodecError(
                f"{where}: expected a mapping with keys {', '.join(HOST_KEYS)} (codecs by "
                f"host), got keys {list(value)}"
            )
        return dict(value)
    return None


def _load_pair(value: Any, where: str) -> QuantizedCommCodecs:
    if isinstance(value, HostCodecs):
        for key in ("same_host", "other_host"):
            _load_pair(getattr(value, key), f"{where}.{key}")
        return value
    if isinstance(value, QuantizedCommCodecs):
        # It holds codec objects; specs belong in a "forward/backward" string.
        for side in ("forward", "backward"):
            codec = getattr(value, side)
            problem = f"str {codec!r}" if isinstance(codec, str) else contract_problem(codec)
            if problem:
                raise CodecError(f"{where}.{side}: expected a codec object, got {problem}")
        return value
    if isinstance(value, str):
        forward, backward = parse_pair_spec(value, where)
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
    max_error: float | None = None,
    on_exceed: str | None = None,
) -> dict[str, QuantizedCommCodecs]:
    r"""
    build_registry(codecs: Mapping | str | None = None, *, forward=None, backward=None, allow_unsummable_reduce_scatter=False, max_error=None, on_exceed=None) -> dict[str, QuantizedCommCodecs]

    Builds the registry TorchRec sharders take as ``qcomm_codecs_registry``
    from keywords, a string (see :doc:`codecs`; with no argument, the setting
    ``codecs`` of :mod:`qcomm.config`, ``QCOMM_CODECS``) or a mapping from :class:`~qcomm.CommOp` (or its name)
    to a ``(forward, backward)`` tuple, a ``"forward/backward"`` string, a
    :class:`~qcomm.QuantizedCommCodecs`, or one spec or codec for both.

    .. warning::

        TorchRec's *own* reduce-scatter sums the wire tensors and all-gathers
        its gradient into a buffer of the unencoded size: where TorchRec's
        transport is chosen (the setting ``torchrec_collectives`` is
        ``"torchrec"``, or after :func:`qcomm.torchrec_exchange.uninstall`),
        ``POOLED_EMBEDDINGS_REDUCE_SCATTER`` takes only a summable forward
        codec and a size-keeping backward one. On qcomm's exchange, the
        default route, any pair works (see :doc:`torchrec`).

    Args:
        codecs (Mapping | str, optional): the mapping or string. Default: ``None``.
        forward (str | QuantizedCommCodec, optional): forward codec of every op.
            Default: ``None`` (no-op).
        backward (str | QuantizedCommCodec, optional): backward codec of every
            op. Default: ``None`` (no-op).
        allow_unsummable_reduce_scatter (bool, optional): accept, even where
            TorchRec's transport is chosen, a reduce-scatter pair that it cannot
            carry (it sums wires), for a registry whose reduce-scatter runs only
            in :func:`~qcomm.reduce_scatter_pooled`; a TorchRec call that takes
            TorchRec's transport with it is still refused. Needless on qcomm's
            exchange, where any pair is accepted. Default: ``False``.
        max_error (float, optional): a budget for every codec of the registry
            that encodes and has none of its own: each becomes an
            :class:`~qcomm.AdaptiveCodec` of one candidate (a guard), and an
            adaptive codec without ``max_error`` takes it (see :doc:`adaptive`).
            Default: ``None`` (only the budgets the specs give).
        on_exceed (str, optional): what a call over that budget does,
            ``"warn"`` or ``"raise"``; only with ``max_error``. Default:
            ``None`` (``"warn"``, or each spec's own).

    Returns:
        dict[str, QuantizedCommCodecs]: pairs keyed by ``CommOp.name``; each
        spec gives a new codec instance.

    Raises:
        CodecError: if an op, codec or spec is unknown or malformed, or breaks
            the warning's rule; the message names the argument (or
            ``QCOMM_CODECS``) and the op, and writes the warning's fix in the
            form the codecs were given (a ``QCOMM_CODECS=...`` variable, the
            setting ``codecs``, a string or a mapping).

    Examples::

        >>> sorted(build_registry(forward="noop"))
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'POOLED_EMBEDDINGS_REDUCE_SCATTER', 'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
        >>> list(build_registry("pooled_embeddings_all_to_all=noop/noop"))
        ['POOLED_EMBEDDINGS_ALL_TO_ALL']
    """
    if codecs is not None and (forward is not None or backward is not None):
        raise CodecError("build_registry: give either 'codecs' or 'forward'/'backward', not both")
    if on_exceed is not None and max_error is None:
        raise CodecError("build_registry: on_exceed is given without max_error")
    registry = _unbudgeted(codecs, forward, backward, allow_unsummable_reduce_scatter)
    if max_error is None:
        return registry
    return {k: _budgeted(pair, max_error, on_exceed) for k, pair in registry.items()}


def _budgeted(pair: QuantizedCommCodecs, max_error: float, on_exceed: str | None) -> Any:
    """``pair`` with a registry-wide budget on each codec that encodes and has none of its own."""
    from qcomm.adaptive import AdaptiveCodec

    def budget(codec: Any, where: str) -> Any:
        if isinstance(codec, NoOpQuantizedCommCodec):
            return codec  # nothing is lost
        try:
            if isinstance(codec, AdaptiveCodec):
                if codec.own_budget:
                    return codec
                return AdaptiveCodec(
                    codec.candidates,
                    max_error=max_error,
                    window=codec.window,
                    on_exceed=on_exceed or codec.on_exceed,
                )
            return AdaptiveCodec([codec], max_error=max_error, on_exceed=on_exceed or "warn")
        except (TypeError, ValueError) as err:
            raise CodecError(f"build_registry: {where}: {err}") from err

    if isinstance(pair, HostCodecs):
        return HostCodecs(
            same_host=_budgeted(pair.same_host, max_error, on_exceed),
            other_host=_budgeted(pair.other_host, max_error, on_exceed),
            ranks_per_host=pair.ranks_per_host,
        )
    return QuantizedCommCodecs(
        forward=budget(pair.forward, "forward"), backward=budget(pair.backward, "backward")
    )


def _unbudgeted(
    codecs: Any, forward: Any, backward: Any, allow_unsummable_reduce_scatter: bool
) -> dict[str, QuantizedCommCodecs]:
    """:func:`build_registry` without its budget."""
    registry: dict[str, QuantizedCommCodecs] = {}
    if forward is not None or backward is not None:
        for op in CommOp:
            registry[op.name] = QuantizedCommCodecs(
                forward=_keyword_codec(forward, "forward"),
                backward=_keyword_codec(backward, "backward"),
            )
        pair = _keyword_pair(forward, backward)
        keywords = _Given("keywords", entries=[(op, op.value, pair) for op in CommOp])
        return _checked(registry, allow_unsummable_reduce_scatter, keywords)
    given = _Given("mapping")
    if codecs is None:
        codecs, where = config._read("codecs")
        given = _Given("env" if where == config.VARIABLES["codecs"] else "setting", where=where)
        if not codecs:
            return registry
    elif isinstance(codecs, str):
        given = _Given("string")
    where = given.where
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
        registry[op.name] = load_pair(value, f"{where}[{op.name}]")
        given.entries.append((op, key, value))
    return _checked(registry, allow_unsummable_reduce_scatter, given)


class _Source:
    # A value written in a suggested fix as the code that gave it.
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _keyword_pair(forward: Any, backward: Any) -> Any:
    # The pair that forward= and backward= give every op, as a mapping's value.
    sides: list[Any] = [
        "noop" if value is None else value if isinstance(value, str) else _Source(name)
        for value, name in ((forward, "forward"), (backward, "backward"))
    ]
    if all(isinstance(side, str) for side in sides):
        return sides[0] if sides[0] == sides[1] else f"{sides[0]}/{sides[1]}"
    return tuple(sides)


def _keyword_codec(value: Any, name: str) -> Any:
    # Each op gets its own no-op instance.
    if value is None:
        return NoOpQuantizedCommCodec()
    return _load_one(value, f"build_registry: {name}")


def _checked(
    registry: dict[str, QuantizedCommCodecs],
    allow_unsummable_reduce_scatter: bool,
    given: _Given,
) -> dict[str, QuantizedCommCodecs]:
    _check_reduce_scatter(registry, allow_unsummable_reduce_scatter, given)
    # A registry goes to TorchRec's sharders: their collectives with these
    # codecs run on qcomm's exchange (qcomm.torchrec_exchange).
    torchrec_exchange.enable()
    return registry


def _check_reduce_scatter(
    registry: dict[str, QuantizedCommCodecs],
    allow_unsummable_reduce_scatter: bool,
    given: _Given,
) -> None:
    pair = registry.get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name)
    if pair is None or allow_unsummable_reduce_scatter:
        return
    # Only TorchRec's own transport sums wires: qcomm's exchange (the route
    # TorchRec takes with a qcomm registry unless told otherwise) and
    # reduce_scatter_pooled decode every part and sum in float32, and gather
    # the gradient decoded. So the rule holds only where the route is chosen
    # to be TorchRec's; a call that lands there by another way (a setting
    # changed later) is refused when it is made.
    why = torchrec_exchange._chosen_route()
    if why is None:
        return
    forward_ok, backward_ok = torchrec_exchange.carried(pair)
    if forward_ok and backward_ok:
        return
    fix = _fix(given, forward_ok, backward_ok)
    routes = (
        "On qcomm's exchange (torchrec_collectives='qcomm', the default) and in "
        "qcomm.reduce_scatter_pooled, any codec works: each part is decoded and summed in "
        "float32; if this registry's reduce-scatter runs only in "
        "qcomm.reduce_scatter_pooled"
    )
    if given.form == "env":
        allow = (
            f"{routes}, build it with build_registry(allow_unsummable_reduce_scatter=True) "
            f"(which still reads {given.where})"
        )
    else:
        allow = f"{routes}, pass allow_unsummable_reduce_scatter=True"
    if not forward_ok:
        name = codec_info(pair.forward).name
        raise CodecError(
            f"{given.where}: codec {name!r} cannot be the forward codec of "
            f"POOLED_EMBEDDINGS_REDUCE_SCATTER on TorchRec's own transport, which TorchRec's "
            f"reduce-scatter takes here ({why}): it sums the wire tensors, and {name!r} does "
            f"not declare them summable (CodecInfo.summable), so the result would be silently "
            f"wrong. Give that op a summable codec (noop, fp16, bf16), e.g. {fix}. {allow}"
        )
    name = codec_info(pair.backward).name
    raise CodecError(
        f"{given.where}: codec {name!r} cannot be the backward codec of "
        f"POOLED_EMBEDDINGS_REDUCE_SCATTER on TorchRec's own transport, which TorchRec's "
        f"reduce-scatter takes here ({why}): it all-gathers that gradient into a buffer of "
        f"the unencoded size, and {name!r} changes the element count (calc_quantized_size). "
        f"Use an element-wise codec there (noop, fp16, bf16), e.g. {fix}. {allow}"
    )


def _fix(given: _Given, forward_ok: bool, backward_ok: bool) -> str:
    # The caller's registry with the reduce-scatter's refused codec(s)
    # replaced by _RS_FIX, written as the caller wrote it.
    rs = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
    entries = [entry for entry in given.entries if entry[0] is not rs]
    entries += [entry for entry in given.entries if entry[0] is rs]
    fixed: list[tuple[Any, Any]] = []
    for op, key, value in entries:
        if op is rs:
            value = _fixed_pair(value, forward_ok, backward_ok)
        fixed.append((key, value))
    if given.form in ("env", "setting", "string"):
        # Every value is a "forward/backward" string of parse_registry_string.
        text = ",".join(f"{CommOp.parse(key).value}={value}" for key, value in fixed)
        if given.form == "env":
            return f"{given.where}={_shell_quoted(text)}"
        if given.form == "setting":
            return f"qcomm.config.configure(codecs={text!r})"
        return f"build_registry({text!r})"
    rs_key = next(key for op, key, _ in given.entries if op is rs)
    if not all(_is_literal(value) for _, value in fixed):
        # Codec objects of a mapping have no literal to write: say what changes.
        return (
            f"build_registry({{...}}) with {_key_text(rs_key)}: {_RS_FIX!r} and the other "
            f"entries as before"
        )
    body = ", ".join(f"{_key_text(key)}: {_value_text(value)}" for key, value in fixed)
    return f"build_registry({{{body}}})"


def _fixed_pair(value: Any, forward_ok: bool, backward_ok: bool) -> Any:
    by_host = parse_host_spec(value) if isinstance(value, str) else None
    if by_host is not None:
        # TorchRec's own reduce-scatter applies the other hosts' pair.
        other = by_host.get("other_host", "noop")
        by_host["other_host"] = _fixed_pair(other, forward_ok, backward_ok)
        return "+".join(f"{key}={pair}" for key, pair in by_host.items())
    if isinstance(value, str):
        forward, backward = parse_pair_spec(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        forward, backward = value
    else:
        # One codec object for both directions, or a QuantizedCommCodecs.
        forward = backward = value
        if isinstance(value, QuantizedCommCodecs):
            forward, backward = value.forward, value.backward
    forward = forward if forward_ok else _RS_FIX
    backward = backward if backward_ok else _RS_FIX
    if isinstance(value, (tuple, list)) or not (
        isinstance(forward, str) and isinstance(backward, str)
    ):
        return (forward, backward)
    return forward if forward == backward else f"{forward}/{backward}"


def _is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(item, (str, _Source)) for item in value)
    return isinstance(value, (str, _Source))


def _key_text(key: Any) -> str:
    return f"CommOp.{key.name}" if isinstance(key, CommOp) else repr(key)


def _value_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"({value[0]!r}, {value[1]!r})"
    return repr(value)


def _shell_quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
