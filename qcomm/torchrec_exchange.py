r"""
TorchRec's embedding collectives on qcomm's exchange (see :doc:`torchrec`).

TorchRec's sharded modules move their embeddings with the functions of
``torchrec.distributed.comm_ops``, which ``torchrec.distributed.dist_data``
imports by name. :func:`install` puts qcomm's collectives in their place for
every call whose codecs come from a qcomm registry (a
:class:`~qcomm.QuantizedCommCodecs`, as :func:`~qcomm.build_registry`
makes): the bytes then travel on qcomm's pipelined, full-duplex exchange,
with its agreement checks and statuses, instead of TorchRec's
``all_to_all_single``. So do TorchRec's synchronous mode (the call waited
at once) and its calls traced by ``torch.compile`` (qcomm's collectives
then trace to qcomm's operators). Every other call (no codecs, TorchRec's
own codecs, world size 1, a call that passes its own
``all_to_all_single_comm``) goes to TorchRec's function unchanged; the last,
with a qcomm pair, is warned of once.

Installing is explicit (:func:`install`) and also automatic: wherever a
qcomm registry is built (:func:`~qcomm.build_registry`,
:func:`~qcomm.load_pair`) or unpickled, as in ranks started by
``torch.multiprocessing.spawn`` with a registry built in the launcher, it
installs at once where TorchRec is imported and otherwise as soon as it is
(:func:`enable`). :func:`uninstall` puts TorchRec's functions back and holds
in any order: until :func:`install` is called again, no pair and no later
import of TorchRec installs anything. ``QCOMM_TORCHREC_COLLECTIVES=torchrec``
keeps TorchRec's transport for qcomm codecs (only the codecs change);
``qcomm``, the default, takes qcomm's.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import math
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from qcomm import _events, config
from qcomm.collectives._compiled import constant_result
from qcomm.errors import CodecError
from qcomm.ops import CommOp
from qcomm.types import HostCodecs, QuantizedCommCodecs, codec_info

__all__ = [
    "ENV",
    "Route",
    "carried",
    "enable",
    "enabled",
    "install",
    "installed",
    "route",
    "uninstall",
]

#: the environment variable of the setting ``torchrec_collectives``, which
#: chooses the transport of qcomm codecs in TorchRec
ENV = config.VARIABLES["torchrec_collectives"]

_DIST_DATA = "torchrec.distributed.dist_data"
_COMM_OPS = "torchrec.distributed.comm_ops"
# TorchRec's functions and the parameters each replacement reads, by name: an
# upgrade that renames or drops one is refused loudly (see install()).
_EXPECTED = {
    "alltoall_pooled": ("a2a_pooled_embs_tensor", "batch_size_per_rank", "dim_sum_per_rank"),
    "variable_batch_alltoall_pooled": (
        "a2a_pooled_embs_tensor",
        "batch_size_per_rank_per_feature",
        "batch_size_per_feature_pre_a2a",
        "emb_dim_per_rank_per_feature",
    ),
    "reduce_scatter_base_pooled": ("input",),
    "reduce_scatter_v_pooled": ("input", "input_splits"),
    "reduce_scatter_v_per_feature_pooled": (
        "input",
        "batch_size_per_rank_per_feature",
        "embedding_dims",
    ),
    "alltoall_sequence": (
        "a2a_sequence_embs_tensor",
        "forward_recat_tensor",
        "backward_recat_tensor",
        "lengths_after_sparse_data_all2all",
        "input_splits",
        "output_splits",
        "variable_batch_size",
    ),
}
# Every replacement also reads these.
_COMMON = ("group", "codecs")

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_awaitable_class: type | None = None
_no_wait: type | None = None  # TorchRec's NoWait
_comm_ops: Any = None  # TorchRec's comm_ops, where install() found it
# Set by uninstall(), cleared by install(): the automatic installs stay off.
_held_off = False
# Whether TorchRec can be imported here (looked up once: it walks sys.path).
_findable: bool | None = None
# Whether a refused install was already told (once per process).
_told = False
# Whether qcomm codecs take qcomm's exchange: the setting read once per
# install, at the first call with qcomm codecs. Read on every call, a setting
# changed between calls (or between a forward and its backward) could send
# the ranks through different doors, whose messages never meet: they would
# wait for each other until the timeout. uninstall() is the way back to
# TorchRec's.
_door: bool | None = None


def enabled() -> bool:
    r"""
    enabled() -> bool

    Whether qcomm codecs take qcomm's transport in TorchRec: the setting
    ``torchrec_collectives`` (:func:`qcomm.config.get`) is ``"qcomm"``, as
    by default (``QCOMM_TORCHREC_COLLECTIVES`` unset, empty or ``qcomm``).

    Raises:
        ValueError: if ``QCOMM_TORCHREC_COLLECTIVES`` holds anything else.
    """
    door: str = config._read("torchrec_collectives")[0]
    return door == "qcomm"


def installed() -> bool:
    r"""
    installed() -> bool

    Whether TorchRec's collectives are replaced now.
    """
    return bool(_originals)


def install() -> None:
    r"""
    install() -> None

    Replaces TorchRec's embedding collectives in ``comm_ops`` and
    ``dist_data`` (imported here) with qcomm's for calls with qcomm codecs;
    again is a no-op. Also lifts an earlier :func:`uninstall`.

    Raises:
        ImportError: if TorchRec is not installed.
        RuntimeError: if TorchRec's functions are not the ones this version of
            qcomm knows (a TorchRec upgrade moved them); nothing is replaced.
    """
    global _awaitable_class, _no_wait, _comm_ops, _held_off, _door
    comm_ops = importlib.import_module(_COMM_OPS)
    dist_data = importlib.import_module(_DIST_DATA)
    with _lock:
        _held_off = False
        if _originals:
            return
        # A new install reads ENV again, at its first call.
        _door = None
        problems = [p for name in _EXPECTED if (p := _mismatch(comm_ops, dist_data, name))]
        if problems:
            raise RuntimeError(
                "qcomm cannot run TorchRec's collectives on its exchange: "
                + "; ".join(problems)
                + f". Set {ENV}=torchrec (or qcomm.config.configure("
                "torchrec_collectives='torchrec')) to keep TorchRec's transport (qcomm's "
                "codecs still run)"
            )
        _awaitable_class = _make_awaitable_class()
        _no_wait = importlib.import_module("torchrec.distributed.types").NoWait
        _comm_ops = comm_ops
        for name in _EXPECTED:
            original = getattr(comm_ops, name)
            _originals[name] = original
            replacement = _replacement(name, original)
            for module in (comm_ops, dist_data):
                if getattr(module, name, None) is original:
                    setattr(module, name, replacement)


def uninstall() -> None:
    r"""
    uninstall() -> None

    Puts TorchRec's own functions back, and keeps them: until
    :func:`install` is called, neither a qcomm registry (built or unpickled)
    nor a later import of TorchRec installs qcomm's exchange again. Safe to
    call in any order, before TorchRec is imported included.
    """
    global _held_off
    with _lock:
        _held_off = True
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
        for name, original in _originals.items():
            for module_name in (_COMM_OPS, _DIST_DATA):
                module = sys.modules.get(module_name)
                current = getattr(module, name, None)
                if getattr(current, "__wrapped__", None) is original:
                    setattr(module, name, original)
        _originals.clear()


def _mismatch(comm_ops: ModuleType, dist_data: ModuleType, name: str) -> str | None:
    function: Any = getattr(comm_ops, name, None)
    if not callable(function):
        return f"torchrec.distributed.comm_ops has no {name}"
    if getattr(dist_data, name, None) is not function:
        return f"torchrec.distributed.dist_data no longer calls comm_ops.{name}"
    parameters = inspect.signature(cast(Callable[..., Any], function)).parameters
    missing = [p for p in (*_EXPECTED[name], *_COMMON) if p not in parameters]
    if missing:
        return f"comm_ops.{name} has no parameter {', '.join(missing)}"
    return None


def _make_awaitable_class() -> type:
    from torchrec.distributed.types import Awaitable as TorchRecAwaitable

    class OnQcomm(TorchRecAwaitable[torch.Tensor]):  # type: ignore[misc]
        """TorchRec's awaitable of a qcomm collective, shaped by ``finish``."""

        def __init__(self, inner: Any, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
            super().__init__()
            self._inner = inner
            self._finish = finish

        def _wait_impl(self) -> torch.Tensor:
            return self._finish(self._inner.wait())

    return OnQcomm


@dataclasses.dataclass(frozen=True)
class Route:
    r"""
    Which transport a TorchRec call takes (:func:`route`), and why.

    Args:
        transport (str): ``"qcomm"`` (qcomm's exchange) or ``"torchrec"``
            (TorchRec's own function, unchanged).
        reason (str): why, in words.
    """

    transport: Literal["qcomm", "torchrec"]
    reason: str


def route(op: CommOp | str, codecs: Any = None, *, compiled: bool = False) -> Route:
    r"""
    route(op: CommOp | str, codecs: Any = None, *, compiled: bool = False) -> Route

    Which transport a TorchRec call of ``op`` with ``codecs`` takes now: the
    same decision its call makes (see :doc:`torchrec`). TorchRec's
    transport is taken for codecs that are not a qcomm pair, where the
    setting ``torchrec_collectives`` is ``"torchrec"`` and where qcomm's
    exchange is not installed (nor due at TorchRec's import); TorchRec's
    synchronous mode and ``torch.compile`` take the same route as its
    asynchronous eager calls. A call also keeps TorchRec's function on a
    group of one rank, or when it passes its own ``all_to_all_single_comm``
    (warned of once with a qcomm pair); those the call alone knows.

    Args:
        op (CommOp | str): the collective, a :class:`~qcomm.CommOp` or its name.
        codecs (QuantizedCommCodecs, optional): the call's pair.
            Default: ``None`` (any pair of a qcomm registry).
        compiled (bool, optional): whether the call is traced by
            ``torch.compile``; the route is the same. Default: ``False``.

    Returns:
        Route: the transport and why. On TorchRec's transport, a pair
        with an adaptive or budgeted codec (:class:`~qcomm.AdaptiveCodec`),
        and a reduce-scatter pair that it cannot carry (:func:`carried`),
        are refused by the call; the reason says so.

    Raises:
        CodecError: if ``op`` names no :class:`~qcomm.CommOp`.
        ValueError: if ``QCOMM_TORCHREC_COLLECTIVES`` is invalid.

    Examples::

        >>> from qcomm import config
        >>> with config.configured(torchrec_collectives="torchrec"):
        ...     route("pooled_embeddings_all_to_all").reason
        "the setting torchrec_collectives is 'torchrec' (qcomm.config.torchrec_collectives)"
        >>> route("pooled_embeddings_all_to_all", object()).transport
        'torchrec'
    """
    op = CommOp.parse(op)
    if codecs is not None and not isinstance(codecs, QuantizedCommCodecs):
        return Route("torchrec", _NOT_OURS)
    found = _route(due=True)
    adaptive = _adaptive(codecs) if codecs is not None else []
    if found.transport == "torchrec" and adaptive:
        return Route("torchrec", f"{found.reason}; the call is refused: {'; '.join(adaptive)}")
    if found.transport == "torchrec" and op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
        problems = _uncarried(codecs) if codecs is not None else []
        if problems:
            reason = f"{found.reason}; the call is refused: {'; '.join(problems)}"
            return Route("torchrec", reason)
    return found


_NOT_OURS = "the codecs are not a qcomm pair (none, or TorchRec's own)"


def _route(*, due: bool) -> Route:
    """
    The route of a call with a qcomm pair: what a call decides (installed,
    its door read) and what :func:`route` answers (``due``: an install due at
    TorchRec's import counts).
    """
    if _door is not None and installed():
        if not _door:
            return Route(
                "torchrec",
                _chosen_route()
                or "the setting torchrec_collectives was 'torchrec' at the first call since "
                "install() (read again at the first call after the next install())",
            )
    else:
        chosen = _chosen_route()
        if chosen is not None:
            return Route("torchrec", chosen)
    if not installed() and not (due and _due()):
        return Route(
            "torchrec",
            "qcomm's exchange is not installed in TorchRec (install(), or build a registry)",
        )
    return Route("qcomm", "a qcomm pair, and qcomm's exchange installed in TorchRec")


def _chosen_route() -> str | None:
    """Why TorchRec's transport is chosen for qcomm codecs (the setting, or uninstall()), if it is."""
    door, where = config._read("torchrec_collectives")
    if door == "torchrec":
        return f"the setting torchrec_collectives is 'torchrec' ({where})"
    if _held_off:
        return "qcomm.torchrec_exchange.uninstall() put TorchRec's functions back"
    return None


def _due() -> bool:
    """Whether qcomm's exchange installs when TorchRec's ``dist_data`` is imported."""
    return not _held_off and any(isinstance(f, _AfterImport) for f in sys.meta_path)


def _ours(codecs: Any, group: Any) -> bool:
    """Whether this call goes to qcomm's exchange."""
    global _door
    if not isinstance(codecs, QuantizedCommCodecs):
        return False
    if _door is None:
        _door = enabled()
    if not _door:
        return False  # the setting chose TorchRec's transport: _route says so too
    if _route(due=False).transport != "qcomm":
        return False
    return dist.get_world_size(group) > 1


def _replacement(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    # The signature is read here, once: a call binds its arguments with plain
    # dict operations, which torch.compile traces (inspect.signature it does not).
    parameters = inspect.signature(original).parameters
    names = tuple(parameters)
    defaults = {n: p.default for n, p in parameters.items() if p.default is not p.empty}
    run = _RUNS[name]

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        given = _bound(names, defaults, args, kwargs)
        if given is None:
            return original(*args, **kwargs)  # TorchRec's own TypeError
        group = given["group"]
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        # A custom all_to_all_single_comm is TorchRec's way to swap its
        # transport: whoever passes one wants theirs.
        custom = given.get("all_to_all_single_comm") is not None
        ours = _ours(given["codecs"], group)
        if custom or not ours:
            _refuse_adaptive(name, given["codecs"], group, custom)
            if name in _SUMMED:
                _refuse_summed_wires(name, given["codecs"], group)
            if custom and ours:
                _warn_once(name, "the call passes its own all_to_all_single_comm")
            return original(*args, **kwargs)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # Traced, it would count the trace, not the calls: compiled calls
            # are counted where qcomm's collective runs.
            _events.emit("torchrec_call", name)
        assert _awaitable_class is not None
        inner, finish = run(given, group)
        if _comm_ops.get_use_sync_collectives() and not compiling:
            # TorchRec's synchronous mode: the call is done when it returns.
            assert _no_wait is not None
            return _no_wait(finish(inner.wait()))
        return _awaitable_class(inner, finish)

    return replacement


# (TorchRec function, reason) already warned of, once per process.
_warned: set[tuple[str, str]] = set()


# Under torch.compile, run while tracing (once per trace) and not traced: a
# warning cannot be part of a graph.
@constant_result
def _warn_once(name: str, reason: str) -> bool:
    """Warns that a call of ``comm_ops.<name>`` with a qcomm pair runs on TorchRec's
    own transport, and why; once per function and reason."""
    if (name, reason) not in _warned:
        _warned.add((name, reason))
        warnings.warn(
            f"comm_ops.{name}: a call with a qcomm pair runs on TorchRec's own transport, "
            f"not on qcomm's exchange: {reason}",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def _bound(
    names: tuple[str, ...], defaults: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """A call's arguments by name, or ``None`` where they do not fit the signature."""
    if len(args) > len(names) or any(k not in names or k in names[: len(args)] for k in kwargs):
        return None
    given = dict(defaults)
    given.update(zip(names, args))
    given.update(kwargs)
    return given if len(given) == len(names) else None


# TorchRec's reduce-scatters, which sum the ranks' wires as they are and
# all-gather the gradient's wire into a buffer of the gradient's size.
_SUMMED = (
    "reduce_scatter_base_pooled",
    "reduce_scatter_v_pooled",
    "reduce_scatter_v_per_feature_pooled",
)


def carried(pair: Any) -> tuple[bool, bool]:
    r"""
    carried(pair: Any) -> tuple[bool, bool]

    Whether TorchRec's own transport carries a reduce-scatter pair right: its
    forward codec's wires may be summed as they are (``CodecInfo.summable``),
    and its backward codec keeps one wire element per element (TorchRec
    all-gathers the gradient's wire into a buffer of the gradient's size).

    Args:
        pair (QuantizedCommCodecs): the reduce-scatter's codecs.
    """
    keeps_size = all(pair.backward.calc_quantized_size(n) == n for n in (1, 7, 32, 4096))
    return codec_info(pair.forward).summable, keeps_size


def _uncarried(pair: Any) -> list[str]:
    """What TorchRec's own transport cannot carry of a reduce-scatter pair, in words."""
    forward_ok, backward_ok = carried(pair)
    problems = []
    if not forward_ok:
        problems.append(f"forward codec {codec_info(pair.forward).name!r} is not summable")
    if not backward_ok:
        problems.append(f"backward codec {codec_info(pair.backward).name!r} changes the size")
    return problems


def _refuse_summed_wires(name: str, codecs: Any, group: Any) -> None:
    # A qcomm pair that build_registry let through for qcomm's exchange but
    # whose call goes to TorchRec's transport after all: its result would be
    # silently wrong, so every rank (all take the same route) raises instead.
    if not isinstance(codecs, QuantizedCommCodecs) or dist.get_world_size(group) <= 1:
        return
    problems = _uncarried(codecs)
    if not problems:
        return
    # (TorchRec's reduce-scatters take no all_to_all_single_comm of their own.)
    why = _route(due=False).reason
    raise CodecError(
        f"comm_ops.{name}: this call runs on TorchRec's own transport ({why}), which sums "
        f"the ranks' wires as they are, and the registry's POOLED_EMBEDDINGS_REDUCE_SCATTER "
        f"pair cannot be summed so ({'; '.join(problems)}): the result would be silently "
        f"wrong. Give that op fp16, bf16 or noop, or run it on qcomm's exchange"
    )


def _adaptive(pair: Any) -> list[str]:
    """The codecs of ``pair`` that only qcomm's exchange can run (adaptive or budgeted), in words."""
    from qcomm.adaptive import AdaptiveCodec

    found = [(side, getattr(pair, side, None)) for side in ("forward", "backward")]
    return [
        f"its {side} codec ({'|'.join(c.names)}, max_error={c.max_error:g}) is adaptive or budgeted"
        for side, c in found
        if isinstance(c, AdaptiveCodec)
    ]


def _refuse_adaptive(name: str, codecs: Any, group: Any, custom: bool) -> None:
    # An adaptive codec chooses each call's codec from the errors carried in
    # qcomm's statuses, which TorchRec's transport has none of: refused here,
    # before TorchRec sends anything, on every rank alike (all take the same
    # route). Its backward codec too: the forward would run, the backward fail.
    # Under torch.compile a plain raise: dynamo runs the frame eagerly, or,
    # with fullgraph=True, names this error in its own.
    if not isinstance(codecs, QuantizedCommCodecs) or dist.get_world_size(group) <= 1:
        return
    problems = _adaptive(codecs)
    if not problems:
        return
    why = "the call passes its own all_to_all_single_comm" if custom else _route(due=False).reason
    raise CodecError(
        f"comm_ops.{name}: this call runs on TorchRec's own transport ({why}), which carries "
        f"no in-band status, so the errors an adaptive codec chooses by never reach it "
        f"({'; '.join(problems)}). Run it on qcomm's exchange: leave the setting "
        f"torchrec_collectives at 'qcomm' ({ENV}) and qcomm.torchrec_exchange installed"
    )


def _divide() -> bool:
    return bool(_comm_ops.get_gradient_division())


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _pooled(given: dict[str, Any], group: Any) -> tuple[Any, Callable[..., Any]]:
    from qcomm.collectives import all_to_all_pooled

    inner = all_to_all_pooled(
        given["a2a_pooled_embs_tensor"],
        list(given["batch_size_per_rank"]),
        list(given["dim_sum_per_rank"]),
        group=group,
        codecs=given["codecs"],
        gradient_division=_divide(),
    )
    return inner, _same


def _rows_of(dims: list[int]) -> int:
    # The widest rows that every embedding of the flat tensor is made of:
    # block codecs see whole rows, the exchange cuts only between them.
    return functools.reduce(math.gcd, [d for d in dims if d > 0], 0) or 1


def _flat_all_to_all(
    flat: torch.Tensor,
    sends: list[int],
    receives: list[int],
    width: int,
    given: dict[str, Any],
    group: Any,
) -> tuple[Any, Callable[..., Any]]:
    from qcomm.collectives import all_to_all_sequence

    rows = _DivideGradient.apply(  # type: ignore[no-untyped-call]
        flat.reshape(-1), dist.get_world_size(group) if _divide() else 1
    )
    inner = all_to_all_sequence(
        rows.view(-1, width),
        input_splits=[s // width for s in sends],
        output_splits=[r // width for r in receives],
        group=group,
        codecs=given["codecs"],
    )
    return inner, lambda out: out.reshape(-1)


def _variable_batch(given: dict[str, Any], group: Any) -> tuple[Any, Callable[..., Any]]:
    # The same splits as TorchRec's: what this rank sends to rank i is the
    # features of i's batches at this rank's dims, what it receives from i
    # its own batches at i's dims.
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batches = given["batch_size_per_rank_per_feature"]
    pre = given["batch_size_per_feature_pre_a2a"]
    dims = given["emb_dim_per_rank_per_feature"]
    sends = [0] * world
    if batches:
        sends = [sum(b * d for b, d in zip(batches[i], dims[rank])) for i in range(world)]
    receives, at = [], 0
    for i in range(world):
        receives.append(sum(pre[at + k] * d for k, d in enumerate(dims[i])))
        at += len(dims[i])
    width = _rows_of([d for per_rank in dims for d in per_rank])
    return _flat_all_to_all(given["a2a_pooled_embs_tensor"], sends, receives, width, given, group)


def _reduce_scatter(
    given: dict[str, Any], group: Any, splits: list[int] | None
) -> tuple[Any, Callable[..., Any]]:
    from qcomm.collectives import reduce_scatter_pooled

    inner = reduce_scatter_pooled(
        given["input"],
        input_splits=splits,
        group=group,
        codecs=given["codecs"],
        gradient_division=_divide(),
    )
    return inner, _same


def _reduce_scatter_per_feature(
    given: dict[str, Any], group: Any
) -> tuple[Any, Callable[..., Any]]:
    from qcomm.collectives import reduce_scatter_pooled

    world = dist.get_world_size(group)
    batches, dims = given["batch_size_per_rank_per_feature"], given["embedding_dims"]
    splits = [0] * world
    if batches:
        splits = [sum(b * d for b, d in zip(batches[r], dims)) for r in range(world)]
    width = _rows_of(list(dims))
    inner = reduce_scatter_pooled(
        given["input"].reshape(-1, width),
        input_splits=[s // width for s in splits],
        group=group,
        codecs=given["codecs"],
        gradient_division=_divide(),
    )
    return inner, lambda out: out.reshape(-1)


def _sequence(given: dict[str, Any], group: Any) -> tuple[Any, Callable[..., Any]]:
    from qcomm.collectives import all_to_all_sequence

    embeddings = given["a2a_sequence_embs_tensor"]
    dim = embeddings.shape[1]
    world = dist.get_world_size(group)
    rows = _Recat.apply(  # type: ignore[no-untyped-call]
        embeddings,
        given["forward_recat_tensor"],
        given["backward_recat_tensor"],
        given["lengths_after_sparse_data_all2all"],
        bool(given["variable_batch_size"]),
        world,
        world if _divide() else 1,
    )
    # TorchRec names the splits after the ids' all-to-all, whose inverse
    # this is: its output splits are what this rank sends.
    inner = all_to_all_sequence(
        rows.view(-1, dim),
        input_splits=list(given["output_splits"]),
        output_splits=list(given["input_splits"]),
        group=group,
        codecs=given["codecs"],
    )
    return inner, _same


class _DivideGradient(torch.autograd.Function):
    """The identity, whose gradient is divided by ``by`` (TorchRec's gradient division)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, by: int) -> torch.Tensor:
        ctx.by = by
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad / ctx.by if ctx.by > 1 else grad), None


class _Recat(torch.autograd.Function):
    """The sequence embeddings put in the order the all-to-all sends them
    (TorchRec's forward recat), and their gradient put back (its backward
    recat), divided by ``divide``."""

    @staticmethod
    def forward(
        ctx: Any,
        embeddings: torch.Tensor,
        forward_recat: torch.Tensor | None,
        backward_recat: torch.Tensor,
        lengths: torch.Tensor,
        variable_batch: bool,
        world: int,
        divide: int,
    ) -> torch.Tensor:
        dim = embeddings.shape[1]
        ctx.divide, ctx.dim, ctx.variable_batch = divide, dim, variable_batch
        ctx.backward_recat, ctx.permuted = backward_recat, None
        scaled = lengths * dim
        local_tables = scaled.shape[0]
        if local_tables == 0:
            return embeddings.view_as(embeddings)
        ops = torch.ops.fbgemm
        if variable_batch:
            permuted, values, _ = ops.permute_1D_sparse_data(
                forward_recat, scaled.view(-1), embeddings.reshape(-1), None, embeddings.numel()
            )
        else:
            permuted, values, _ = ops.permute_2D_sparse_data(
                forward_recat,
                scaled.view(local_tables * world, -1),
                embeddings.reshape(-1),
                None,
                embeddings.numel(),
            )
        ctx.permuted = permuted
        rows: torch.Tensor = values.view(-1, dim)
        return rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.reshape(-1)
        if ctx.permuted is not None:
            ops = torch.ops.fbgemm
            permute = (
                ops.permute_1D_sparse_data if ctx.variable_batch else ops.permute_2D_sparse_data
            )
            _, grad, _ = permute(ctx.backward_recat, ctx.permuted, grad, None, grad.numel())
        if ctx.divide > 1:
            grad = grad / ctx.divide
        return grad.view(-1, ctx.dim), None, None, None, None, None, None


_RUNS: dict[str, Callable[[dict[str, Any], Any], tuple[Any, Callable[..., Any]]]] = {
    "alltoall_pooled": _pooled,
    "variable_batch_alltoall_pooled": _variable_batch,
    "reduce_scatter_base_pooled": lambda given, group: _reduce_scatter(given, group, None),
    "reduce_scatter_v_pooled": lambda given, group: _reduce_scatter(
        given, group, list(given["input_splits"])
    ),
    "reduce_scatter_v_per_feature_pooled": _reduce_scatter_per_feature,
    "alltoall_sequence": _sequence,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs the replacements right after TorchRec's ``dist_data`` is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _DIST_DATA:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
            if not _held_off:
                _install_quietly()

        loader.exec_module = exec_module
        return spec


def _restore(cls: Any, state: dict[str, Any]) -> Any:
    """A qcomm pair unpickled (in a spawned rank, say): as it was, with qcomm's exchange enabled."""
    pair = cls.__new__(cls)
    pair.__dict__.update(state)
    enable()
    return pair


def _reduce(pair: Any) -> tuple[Any, ...]:
    return _restore, (type(pair), dict(pair.__dict__))


# A qcomm pair pickled in a process that has this module (every process that
# built a registry: registry.py imports it) unpickles through _restore, which
# brings qcomm's exchange into TorchRec wherever the pair lands.
for _pair_class in (QuantizedCommCodecs, HostCodecs):
    copyreg.pickle(_pair_class, _reduce)


def _install_quietly() -> None:
    global _told
    try:
        install()
    except RuntimeError as err:
        # Training goes on, on TorchRec's transport; the user is told why, once.
        if not _told:
            _told = True
            warnings.warn(str(err), RuntimeWarning, stacklevel=3)


def enable() -> None:
    r"""
    enable() -> None

    What a registry built or a qcomm pair unpickled calls: :func:`install`
    now if TorchRec's ``dist_data`` is imported, else right after it is;
    nothing after :func:`uninstall`, under
    ``QCOMM_TORCHREC_COLLECTIVES=torchrec`` or without TorchRec. Where
    :func:`install` refuses, it warns once and TorchRec's transport stays.

    Raises:
        ValueError: if ``QCOMM_TORCHREC_COLLECTIVES`` is neither ``qcomm`` nor ``torchrec``.
    """
    global _findable
    if not enabled() or installed() or _held_off:
        return
    if _DIST_DATA in sys.modules:
        _install_quietly()
        return
    if _findable is None:
        _findable = importlib.machinery.PathFinder.find_spec("torchrec") is not None
    if not _findable:
        return
    with _lock:
        if not _held_off and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
