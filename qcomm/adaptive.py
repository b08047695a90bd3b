r"""
Codecs chosen by the error each call measures (see :doc:`adaptive`).

A call whose codec is adaptive or has a budget (and every call that
encodes, with the setting ``measure_errors``) measures, on the sending
rank, the relative RMS error (and the largest error) of what it encoded, on
a deterministic sample of the rows it sends, and carries the figures in the
in-band status that already ends its last message to each peer: every rank
learns every rank's error without a message more. An :class:`AdaptiveCodec` measures each of
its candidates on that sample and picks, for the next call, the first
candidate (in the order given) whose error on every rank stayed within the
budget over its last ``window`` calls; every rank computes the same choice
from the same figures. With one candidate it is a guard: a call over budget
warns once or raises.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from qcomm.errors import CodecError
from qcomm.history import CallLog, CallRecord

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MAX_ERROR", "DEFAULT_WINDOW", "ON_EXCEED", "AdaptiveCodec"]

#: the default error budget, a relative RMS error (that of ``qcomm bench``'s advice)
DEFAULT_MAX_ERROR = 3e-2
#: calls a cheaper candidate must stay within budget before it is taken, by default
DEFAULT_WINDOW = 8
#: what a call over budget may do where no candidate is left to switch to
ON_EXCEED = ("warn", "raise")

_log = logging.getLogger("qcomm.adaptive")

_REFUSED = (
    "an adaptive or budgeted codec ({name}) runs on qcomm's exchange only: its error travels "
    "in qcomm's in-band statuses, which TorchRec's own transport does not carry; call qcomm's "
    "collectives, or keep TorchRec's on qcomm's exchange (the setting torchrec_collectives at "
    "'qcomm', and qcomm.torchrec_exchange installed)"
)


class AdaptiveCodec:
    r"""
    A codec chosen call by call among ``candidates`` by the error each call
    measures on the data it sends, within ``max_error``.

    Candidates come in order of preference (the cheapest first): every call
    uses one and measures all of them on the same sample of what it sends;
    the next call takes the first candidate whose relative RMS error on
    every rank stayed within ``max_error`` over its last ``window``
    measured calls (a candidate before the one in use needs ``window`` such
    calls, so the choice does not flap). A call whose codec goes over budget
    makes the next call move on at once. Until the first calls are measured,
    the last candidate (the most precise) is used. With one candidate, it is
    that codec with a guard.

    Where even the last candidate goes over budget, the call warns once per
    collective and pass (``on_exceed="warn"``) or raises :class:`~qcomm.CodecError`
    at its ``wait()`` on every rank (``"raise"``), naming the collective, the
    rank and the error.

    One object adapts on the calls it is given: give each collective and
    pass its own (:func:`~qcomm.build_registry` does). It runs on qcomm's
    exchange only; TorchRec's own transport, which carries no status, is
    refused.

    Args:
        candidates (Sequence[QuantizedCommCodec]): the codecs, cheapest first.
        max_error (float, optional): the budget, a relative RMS error.
            Default: ``None`` (:data:`~qcomm.adaptive.DEFAULT_MAX_ERROR`, or a registry-wide
            budget of :func:`~qcomm.build_registry`).
        window (int, optional): calls a cheaper candidate must stay within
            budget before it is taken. Default: :data:`~qcomm.adaptive.DEFAULT_WINDOW`.
        on_exceed (str, optional): ``"warn"`` or ``"raise"``. Default: ``"warn"``.

    Raises:
        TypeError: if a candidate is not a codec or is stateful.
        ValueError: if an option is out of range.

    Examples::

        >>> import qcomm
        >>> codec = qcomm.load_codec("adaptive:fp16|bf16,max_error=0.01")
        >>> codec.names, codec.max_error, codec.window
        (('fp16', 'bf16'), 0.01, 8)
    """

    def __init__(
        self,
        candidates: Sequence[Any],
        *,
        max_error: float | None = None,
        window: int = DEFAULT_WINDOW,
        on_exceed: str = "warn",
    ) -> None:
        from qcomm.types import codec_info, contract_problem

        if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
            raise TypeError(
                f"candidates: expected a sequence of codecs, got {type(candidates).__name__}"
            )
        if not candidates:
            raise ValueError("candidates: expected at least one codec, got none")
        for i, codec in enumerate(candidates):
            if isinstance(codec, AdaptiveCodec):
                raise TypeError(f"candidates[{i}]: an AdaptiveCodec cannot be a candidate")
            problem = contract_problem(codec)
            if problem:
                raise TypeError(f"candidates[{i}]: expected a codec, got {problem}")
            if codec_info(codec).stateful:
                raise TypeError(
                    f"candidates[{i}]: {codec_info(codec).name!r} keeps state across calls, "
                    "which measuring it on a sample would disturb"
                )
        #: whether ``max_error`` was given (a registry-wide budget leaves it be)
        self.own_budget = max_error is not None
        max_error = DEFAULT_MAX_ERROR if max_error is None else max_error
        if (
            isinstance(max_error, bool)
            or not isinstance(max_error, (int, float))
            or not max_error > 0
            or not math.isfinite(max_error)
        ):
            raise ValueError(f"max_error: expected a positive finite number, got {max_error!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window: expected a positive int, got {window!r}")
        if on_exceed not in ON_EXCEED:
            raise ValueError(
                f"on_exceed: expected one of {', '.join(ON_EXCEED)}, got {on_exceed!r}"
            )
        self.candidates = tuple(candidates)
        self.max_error = float(max_error)
        self.window = window
        self.on_exceed = on_exceed
        self.names = tuple(codec_info(c).name for c in self.candidates)
        self._lock = threading.RLock()
        self._states: dict[str, _State] = {}
        self._warned: set[str] = set()
        #: this codec's calls, as :func:`~qcomm.error_history` reads them
        self.log = CallLog()

    def __repr__(self) -> str:
        from qcomm.collectives._describe import short_name

        names = " | ".join(short_name(c) for c in self.candidates)
        return (
            f"AdaptiveCodec({names}, max_error={self.max_error:g}, window={self.window}, "
            f"on_exceed={self.on_exceed!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # What a spawned rank needs: the choice starts afresh there.
        state = dict(self.__dict__)
        del state["_lock"], state["_states"], state["log"], state["_warned"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._states = {}
        self._warned = set()
        self.log = CallLog()

    def current(self, collective: str) -> int:
        r"""
        current(collective: str) -> int

        The index of the candidate the next call of ``collective`` (a
        collective and pass, e.g. ``"all_to_all_pooled forward"``) uses.
        Calls of it not yet finished are finished first: their errors decide.

        Args:
            collective (str): the collective and pass.

        Returns:
            int: an index into the candidates.
        """
        with self._lock:
            state = self._state(collective)
            pending = list(state.pending)
        for finish in pending:
            try:
                finish()
            except Exception:  # noqa: BLE001 - raised again where that call is waited for
                pass
        with self._lock:
            return state.current

    def _state(self, collective: str) -> _State:
        state = self._states.get(collective)
        if state is None:
            state = self._states[collective] = _State(len(self.candidates), self.window)
        return state

    def began(self, collective: str, finish: Callable[[], None]) -> None:
        r"""
        began(collective: str, finish: Callable[[], None]) -> None

        Notes a call of ``collective`` not finished yet: the next call of it
        runs ``finish`` (which waits for the call and gives its figures to
        :meth:`learn`, once) before it chooses.

        Args:
            collective (str): the collective and pass.
            finish (Callable[[], None]): finishes the call; idempotent.
        """
        with self._lock:
            self._state(collective).pending.append(finish)

    def learn(
        self,
        collective: str,
        finish: Callable[[], None] | None,
        used: int,
        errors: Sequence[Sequence[float]],
        record: CallRecord,
    ) -> CodecError | None:
        r"""
        learn(collective: str, finish: Callable[[], None] | None, used: int, errors: Sequence[Sequence[float]], record: CallRecord) -> CodecError | None

        Takes one call's figures and sets the next call's choice.

        Args:
            collective (str): the collective and pass.
            finish (Callable[[], None], optional): what :meth:`began` was given
                for the call, no longer pending.
            used (int): the candidate the call used.
            errors (Sequence[Sequence[float]]): ``errors[rank][candidate]``,
                the relative RMS errors every rank measured (NaN: not measured).
            record (CallRecord): the call's record, kept in :attr:`log` with
                the candidates' errors and the switch, if any.

        Returns:
            CodecError | None: the error to raise where the call is over budget
            with no candidate left and ``on_exceed`` is ``"raise"``.
        """
        with self._lock:
            state = self._state(collective)
            if finish is not None and finish in state.pending:
                state.pending.remove(finish)
            worst = _worst(errors)
            for c, value in enumerate(worst):
                if not math.isnan(value):
                    state.seen[c].append(value)
            before = state.current
            state.current = _choose(state.seen, before, self.max_error, self.window)
            over = not worst[used] <= self.max_error and not math.isnan(worst[used])
            switched = state.current != before
            self.log.add(
                record._replace(
                    candidates=tuple(worst),
                    switched_to=self.names[state.current] if switched else None,
                )
            )
        if switched:
            _log.info(
                "%s: %s -> %s (relative RMS errors %s; budget %g)",
                collective,
                self.names[before],
                self.names[state.current],
                ", ".join(f"{n} {w:.3g}" for n, w in zip(self.names, worst, strict=True)),
                self.max_error,
            )
        if not over or used < len(self.candidates) - 1:
            return None
        column = [-1.0 if math.isnan(row[used]) else row[used] for row in errors]
        rank = column.index(max(column))
        text = (
            f"{collective}: {self.names[used]}'s relative RMS error {worst[used]:.3g} on rank "
            f"{rank} exceeds the budget {self.max_error:g} (max_error)"
        )
        if self.on_exceed == "raise":
            return CodecError(text)
        with self._lock:
            if collective in self._warned:
                return None
            self._warned.add(collective)
        warnings.warn(f"qcomm: {text}; warned once per collective", RuntimeWarning, stacklevel=2)
        return None

    def learn_nothing(self, collective: str, finish: Callable[[], None]) -> None:
        r"""
        learn_nothing(collective: str, finish: Callable[[], None]) -> None

        Forgets a call of ``collective`` that failed: it has no figures.

        Args:
            collective (str): the collective and pass.
            finish (Callable[[], None]): what :meth:`began` was given for the call.
        """
        with self._lock:
            pending = self._state(collective).pending
            if finish in pending:
                pending.remove(finish)

    # The contract's members: an adaptive codec is not a codec to encode with.
    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise CodecError(_REFUSED.format(name=repr(self)))

    encode = decode = calc_quantized_size = padded_size = create_context = _refuse

    @property
    def quantized_dtype(self) -> torch.dtype:
        r"""
        quantized_dtype() -> torch.dtype

        The first candidate's wire dtype (the one in use changes call by call).
        """
        from qcomm.collectives._wire import wire_dtype

        dtype: torch.dtype = wire_dtype(self.candidates[0])
        return dtype


class _State:
    """One collective and pass of an adaptive codec: the choice, the figures, the calls pending."""

    def __init__(self, candidates: int, window: int) -> None:
        #: until measured, the most precise candidate
        self.current = candidates - 1
        #: each candidate's worst error over the ranks, its last ``window`` measured calls
        self.seen: list[deque[float]] = [deque(maxlen=window) for _ in range(candidates)]
        self.pending: list[Callable[[], None]] = []


def _worst(errors: Sequence[Sequence[float]]) -> list[float]:
    """Each candidate's largest error over the ranks that measured it (NaN: none did)."""
    out = []
    for column in zip(*errors, strict=True):
        measured = [e for e in column if not math.isnan(e)]
        out.append(max(measured) if measured else math.nan)
    return out


def _choose(seen: list[deque[float]], current: int, budget: float, window: int) -> int:
    """
    The first candidate whose last measured calls were all within ``budget``:
    ``window`` of them for one before ``current``, at least one otherwise;
    the last candidate where none qualifies.
    """
    for c, values in enumerate(seen):
        needed = window if c < current else 1
        if len(values) >= needed and all(v <= budget for v in values):
            return c
    return len(seen) - 1
