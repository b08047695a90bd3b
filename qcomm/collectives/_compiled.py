"""
qcomm's collectives as operators of the ``qcomm`` library, for
``torch.compile`` (see :doc:`compile`).

Each collective ``name`` has three operators: ``qcomm::{name}_start`` makes
the call and returns a handle at once, ``qcomm::{name}_wait`` returns the
output (differentiable: its backward is ``qcomm::{name}_backward``, the
inverse collective), so that compute the caller places between
:func:`~qcomm.all_to_all_pooled` and :meth:`~qcomm.Awaitable.wait`
overlaps the exchange in a compiled graph too. Their implementations are the
eager collectives themselves: a compiled call checks, agrees and reports
statuses as an eager one. Start and wait are ordered effects: the compiler
neither removes a call whose output is unused (its peers would wait for it)
nor moves calls past each other.

What cannot cross an operator's boundary (the group, the codecs) crosses it
as a string: the group's name, and a key under which the codec pair is kept
in this process, computed once while tracing.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from qcomm import _events
from qcomm.awaitable import Awaitable
from qcomm.collectives._args import resolve_codecs, resolve_group
from qcomm.collectives._call import begin
from qcomm.collectives._transport import next_number
from qcomm.errors import CodecError
from qcomm.types import HostCodecs, codec_info

# The parameters every collective's operators end with, as the public
# functions name them.
_COMMON = "str group, str codecs, int? chunk_bytes"

# Calls started and not yet waited for, by handle; a call whose handle is
# dropped unwaited is dropped with it (finished in the background, as an
# eager call dropped without a wait).
_started: dict[int, Any] = {}
_handles = itertools.count()

# Codec pairs (and residuals) given to a traced call, by key; kept for the
# process's life, so that no later object takes a key's identity.
_kept: dict[str, Any] = {}
_keys: dict[int, str] = {}
_keys_lock = threading.Lock()


def _name_of(pair: Any) -> str:
    """A readable name of a codec pair (``int8/bf16``, or by host), a codec, or another object."""
    if isinstance(pair, HostCodecs):
        return f"same_host={_name_of(pair.same_host)}+other_host={_name_of(pair.other_host)}"
    if hasattr(pair, "forward") and hasattr(pair, "backward"):
        return f"{codec_info(pair.forward).name}/{codec_info(pair.backward).name}"
    if hasattr(pair, "encode"):
        return codec_info(pair).name
    return type(pair).__name__


def _object_key(value: Any) -> str:
    """
    The key under which ``value`` (codecs, residuals) crosses an operator's
    boundary: ``""`` for ``None``. Run while tracing, with the real object;
    the compiled graph holds the key as a constant (and recompiles for
    another object).
    """
    if value is None:
        return ""
    with _keys_lock:
        key = _keys.get(id(value))
        if key is None:
            key = f"{_name_of(value)}#{len(_kept) + 1}"
            _kept[key] = value
            _keys[id(value)] = key
    return key


def kept(key: str, name: str) -> Any:
    """The object a traced call gave under ``key`` (``None`` for ``""``)."""
    if not key:
        return None
    try:
        return _kept[key]
    except KeyError:
        raise CodecError(
            f"{name}: no object was kept under the key {key!r} in this process (a graph "
            f"traced in another process): trace the model in the process that runs it"
        ) from None


def _group_name(group: Any) -> str:
    """The name of ``group`` (``None``: the default group), checked as an eager call does."""
    return resolve_group(group)[0].group_name


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """
    Marks ``fn`` as ``torch.compiler.assume_constant_result`` does: while
    tracing, dynamo runs it with the real arguments and the graph holds its
    result as a constant. The mark is set here, as that function sets it,
    because calling it imports ``torch._dynamo``: a process that never
    compiles should not pay for that import, and with it imported, ranks
    spawned by ``tools/gpu_check.py`` aborted at exit.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# Run while tracing, with the real objects (the graph holds their results as
# constants, guarded on the objects).
object_key: Callable[[Any], str] = constant_result(_object_key)
group_name: Callable[[Any], str] = constant_result(_group_name)


def ordered(op: Any) -> None:
    """
    Registers ``op`` as an ordered effect: the compiler keeps it where its
    output is unused (its peers wait for the call). The order of the calls
    is kept by :func:`_chained_with_inner` (inductor reordered effectful
    operators of ranks whose shapes differ, effects registered or not).
    """
    _register_effectful_op(op, _EffectType.ORDERED)


def group_of(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(cast(Any, name))


def _unaliased(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    # An operator's output may not share its input's memory (a call on one
    # rank returns its input as it is).
    if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        return output.clone()
    return output


@dataclasses.dataclass(frozen=True)
class Collective:
    """
    One collective's operators.

    Args:
        name (str): the public function's name, and the operators' stem.
        params (tuple[tuple[str, str], ...]): the schema type and name of
            each parameter between the input and :data:`_COMMON`, as the
            public function names it.
        eager (Callable): the public function.
        gradient (Callable): ``gradient(grad, back, codec, input_shape,
            **keywords)``, the input's gradient through the inverse
            collective: ``back`` is the backward call, ``codec`` the backward
            codec by peer, the keywords the public function's but ``group``
            and ``codecs``.
        shape (Callable): ``shape(input_shape, rank, world, **own)``, the
            output's shape, for the fake implementation; it does not check
            (invalid arguments raise in the call, on every rank).
    """

    name: str
    params: tuple[tuple[str, str], ...]
    eager: Callable[..., Any]
    gradient: Callable[..., torch.Tensor]
    shape: Callable[..., list[Any]]

    def schema(self, first: str) -> str:
        own = ", ".join(f"{kind} {name}" for kind, name in self.params)
        return f"({first}, {own + ', ' if own else ''}{_COMMON}) -> Tensor"

    def keywords(self, values: Sequence[Any]) -> dict[str, Any]:
        """The public function's keywords from an operator's parameters after its tensors."""
        names = [name for _, name in self.params] + ["group", "codecs", "chunk_bytes"]
        given = dict(zip(names, values))
        given["group"] = group_of(given["group"])
        given["codecs"] = kept(given["codecs"], f"{self.name}: codecs")
        return given

    def own(self, values: Sequence[Any]) -> dict[str, Any]:
        """The collective's own parameters (between the input and the common ones)."""
        return dict(zip([name for _, name in self.params], values))


def define(collective: Collective) -> Callable[..., Awaitable[torch.Tensor]]:
    """
    Registers ``collective``'s start, wait and backward operators; returns
    what its public function runs while ``torch.compile`` traces it:
    ``traced(input, own, group, codecs, chunk_bytes)``, ``own`` the values of
    the collective's own parameters in order.
    """
    name = collective.name
    start_op = chained(
        f"{name}_start",
        collective.schema("Tensor input"),
        _start_impl(collective),
        _start_fake,
    )
    wait_op, inner_wait = _chained_with_inner(
        f"{name}_wait",
        collective.schema("Tensor handle, Tensor input, Tensor anchor"),
        _wait_impl(collective),
        _wait_fake(collective),
    )
    backward_op = opaque(
        f"{name}_backward",
        collective.schema("Tensor grad, Tensor handle, SymInt[] input_shape"),
        _backward_impl(collective),
        _backward_fake,
    )
    inner_wait.register_autograd(_backward_of(backward_op), setup_context=_remember_shape)

    def traced(
        input: torch.Tensor, own: Sequence[Any], group: Any, codecs: Any, chunk_bytes: Any
    ) -> Awaitable[torch.Tensor]:
        values = (*own, group_name(group), object_key(codecs), chunk_bytes)
        handle = start_op(input, *values)
        return Started(wait_op, handle, input, values)

    return traced


# The operators the public ones are made of (see chained()).
_Library: Any = torch.library.Library  # untyped in torch's stubs
_library = _Library("qcomm", "FRAGMENT")


def opaque(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """
    Registers ``qcomm::_{name}``: ``impl`` and ``fake`` with an ordering
    argument first (``Tensor? after``, which they ignore: see
    :func:`chained`), as an ordered effect, which the compiler keeps where
    its output is unused.
    """
    op = torch.library.custom_op(
        f"qcomm::_{name}",
        lambda after, *args: impl(*args),
        mutates_args=(),
        schema=f"(Tensor? after, {schema[1:]}",
    )
    op.register_fake(lambda after, *args: fake(*args))
    ordered(op)
    return op


def chained(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """
    Registers ``qcomm::{name}`` (``impl`` runs it, ``fake`` gives its output's
    shape) and returns it; see :func:`_chained_with_inner`.
    """
    return _chained_with_inner(name, schema, impl, fake)[0]


def _chained_with_inner(
    name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any]
) -> tuple[Any, Any]:
    """
    Registers ``qcomm::{name}``, made of the opaque ``qcomm::_{name}``
    (returned second) given the output of the operator traced before it in
    the same graph: ranks whose graphs differ in shapes would otherwise have
    their calls put in different orders by the compiler (which orders
    independent operators by what they cost), and their exchanges would not
    pair. The chain is made while the graph is traced, so it follows the
    program's order (and autograd's, in the backward pass), alike on every
    rank.
    """
    inner = opaque(name, schema, impl, fake)
    _library.define(f"{name}{schema}")

    def composite(*args: Any) -> Any:
        return follow(inner(after(), *args))

    _library.impl(name, composite, "CompositeImplicitAutograd")
    return getattr(torch.ops.qcomm, name).default, inner


# The last output of a qcomm operator in the graph this thread traces, and
# the tracer (weakly held: a graph traced is let go).
_tracing = threading.local()


def after() -> torch.Tensor | None:
    """What the next qcomm operator of the graph being traced comes after (``None`` when not tracing)."""
    tracer = get_proxy_mode()
    last = getattr(_tracing, "last", None)
    if tracer is None or last is None or last[0]() is not tracer:
        return None
    output: torch.Tensor | None = last[1]()
    return output


def follow(output: torch.Tensor) -> torch.Tensor:
    """Makes ``output`` what the next qcomm operator of the graph being traced comes after."""
    tracer = get_proxy_mode()
    if tracer is not None:
        _tracing.last = (weakref.ref(tracer), weakref.ref(output))
    return output


class Started(Awaitable[torch.Tensor]):
    """A compiled call in flight: :meth:`wait` is its wait operator."""

    def __init__(
        self, wait_op: Any, handle: torch.Tensor, input: torch.Tensor, values: tuple[Any, ...]
    ) -> None:
        super().__init__()
        self._wait_op = wait_op
        self._args = (handle, input, _ANCHOR, *values)

    def _wait_impl(self) -> torch.Tensor:
        output: torch.Tensor = self._wait_op(*self._args)
        return output


# A leaf that needs a gradient, given to every wait made where autograd
# records: the output then needs a gradient on every rank, whether or not
# this rank's input does, so that no rank's compiled graph skips the
# backward exchange its peers run (as the eager calls' anchor).
_ANCHOR = torch.zeros((), requires_grad=True)


def _start_impl(collective: Collective) -> Callable[..., torch.Tensor]:
    def start(input: torch.Tensor, *values: Any) -> torch.Tensor:
        _events.emit("compiled_call", f"{collective.name}_start")
        given = collective.keywords(values)
        # The number the eager call gets on its group: its backward is named
        # after it, as the eager backward is (see _backward_impl).
        call = next_number(given["group"])
        with torch.no_grad():
            pending = collective.eager(input.detach(), **given)
        serial = next(_handles)
        _started[serial] = pending
        handle = torch.tensor([serial, call], dtype=torch.int64)
        weakref.finalize(handle, _started.pop, serial, None)
        return handle

    return start


def _start_fake(input: torch.Tensor, *values: Any) -> torch.Tensor:
    # The handle is two numbers on the CPU, whatever the input's device.
    return torch.empty(2, dtype=torch.int64)


def _wait_impl(collective: Collective) -> Callable[..., torch.Tensor]:
    def wait(
        handle: torch.Tensor, input: torch.Tensor, anchor: torch.Tensor, *values: Any
    ) -> torch.Tensor:
        _events.emit("compiled_call", f"{collective.name}_wait")
        pending = _started.pop(int(handle[0]), None)
        if pending is None:
            raise CodecError(
                f"{collective.name}: its call was waited for already (each start is waited once)"
            )
        with torch.no_grad():
            return _unaliased(pending.wait(), input)

    return wait


def _wait_fake(collective: Collective) -> Callable[..., torch.Tensor]:
    def fake(
        handle: torch.Tensor, input: torch.Tensor, anchor: torch.Tensor, *values: Any
    ) -> torch.Tensor:
        group = group_of(values[-3])
        shape = collective.shape(
            list(input.shape),
            dist.get_rank(group),
            dist.get_world_size(group),
            **collective.own(values),
        )
        return input.new_empty(shape)

    return fake


def _backward_impl(collective: Collective) -> Callable[..., torch.Tensor]:
    def backward(
        grad: torch.Tensor, handle: torch.Tensor, input_shape: list[int], *values: Any
    ) -> torch.Tensor:
        _events.emit("compiled_call", f"{collective.name}_backward")
        given = collective.keywords(values)
        group, codecs = given.pop("group"), given.pop("codecs")
        # Named as the eager backward is: ranks whose backward passes run in
        # different orders raise instead of swapping gradients, and a rank
        # running eager pairs with a peer running compiled.
        name = f"{collective.name} backward of call {int(handle[1])}"
        # The forward call has checked the arguments.
        with begin(name, group, grad) as back:
            codec = back.by_peer(resolve_codecs(codecs, grad.dtype, back.backend)[1])
            grad_input = collective.gradient(grad, back, codec, list(input_shape), **given)
        return _unaliased(grad_input, grad)

    return backward


def _backward_fake(
    grad: torch.Tensor, handle: torch.Tensor, input_shape: list[int], *values: Any
) -> torch.Tensor:
    return grad.new_empty(input_shape)


def _remember_shape(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    # inputs: after, handle, input, anchor, then the parameters.
    ctx.save_for_backward(inputs[1])
    ctx.input_shape = list(inputs[2].shape)
    ctx.dtype = inputs[2].dtype
    ctx.values = inputs[4:]


def _backward_of(backward_op: Any) -> Callable[..., tuple[Any, ...]]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Every rank runs the backward exchange, also where its input needs
        # no gradient (only the anchor does): its peers wait for it.
        grad = grad.to(ctx.dtype).contiguous()
        (handle,) = ctx.saved_tensors
        grad_input = follow(backward_op(after(), grad, handle, ctx.input_shape, *ctx.values))
        return (None, None, grad_input, None, *([None] * len(ctx.values)))

    return backward
