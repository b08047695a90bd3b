"""
The result of a collective in flight, and its place in the autograd graph:
:meth:`~qcomm.Awaitable.wait` finishes the call inside an autograd function
whose input is the collective's input, as the call found it, so that the
output's backward runs the inverse collective and hands its gradient to
what made the input (not to what the caller wrote into it since).
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from qcomm.awaitable import Awaitable
from qcomm.collectives import _background, _streams


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        anchor: torch.Tensor,
        finish: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        ctx.backward_fn = backward
        ctx.dtype = input.dtype
        return finish()

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None]:
        # Every rank's backward exchange runs, also where this rank's input
        # needs no gradient (no tables, frozen ones): its peers wait for it.
        # In the input's dtype, whatever the engine hands over: the backward
        # pass's wire and result are the input's.
        grad_input = ctx.backward_fn(grad_output.to(ctx.dtype))
        return (grad_input if ctx.needs_input_grad[0] else None), None, None, None


class _Issued(_Collective):
    """
    The output's place in the autograd graph, made when the call is: its data
    arrives later, written by the exchange into the tensor it aliases (which
    needs no gradient, so that no write of it is recorded, from any thread).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        anchor: torch.Tensor,
        out: torch.Tensor,
        backward: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        ctx.backward_fn = backward
        ctx.dtype = input.dtype
        return out.detach()


class _Taken(torch.autograd.Function):
    """The input's place in the autograd graph when the call is made."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor) -> torch.Tensor:
        # A stand-in of the input's shape, dtype and device on one element
        # (never read): the input may change in place before wait() (the
        # caller refills it) without moving the gradient's way to what made
        # it. Strides of 0 rather than a view: autograd tracks views at a
        # cost.
        return input.new_empty_strided(input.shape, (0,) * input.dim())

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def untracked(input: torch.Tensor) -> torch.Tensor:
    """
    ``input`` as the exchange reads it: detached where autograd tracks it
    (each view taken of it would be recorded), else itself (a detach is a
    step of its own, a fair share of a small call).
    """
    return input.detach() if input.requires_grad else input


def taken(input: torch.Tensor) -> torch.Tensor:
    """What :class:`Pending` ties the output to: ``input`` as the call found it."""
    if input.requires_grad and torch.is_grad_enabled():
        # Function.apply is untyped in torch's stubs.
        apply: Callable[[torch.Tensor], torch.Tensor] = _Taken.apply
        return apply(input)
    return input


# A leaf that needs a gradient, given to every call made where autograd
# records: the output then needs a gradient on every rank, whether or not
# this rank's input does, so that no rank skips the backward pass its peers
# run. It never receives a gradient.
_ANCHOR = torch.zeros((), requires_grad=True)


class Pending(Awaitable[torch.Tensor]):
    """A collective's output, ready after :meth:`~qcomm.Awaitable.wait`."""

    def __init__(
        self,
        input: torch.Tensor,
        finish: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], torch.Tensor],
        output: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        #: the output tied into the autograd graph now, where ``finish``
        #: fills ``output`` (known from the start) and autograd records:
        #: one autograd function per call rather than two
        self._issued: torch.Tensor | None = None
        if output is not None and torch.is_grad_enabled():
            issue: Callable[..., torch.Tensor] = _Issued.apply
            self._issued = issue(input, _ANCHOR, output, backward)
        else:
            self._input = taken(input)
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._backward = backward
        # Everything the call gave the current stream is issued by now.
        device = input.device
        self._mark = _streams.issued(device) if device.type == "cuda" else None
        _unwaited.add(self)

    def _wait_impl(self) -> torch.Tensor:
        # Function.apply is untyped in torch's stubs.
        apply: Callable[..., torch.Tensor] = _Collective.apply
        # Taken first: a call whose wait failed is never finished again.
        finish, self._finish = self._finish, None
        _unwaited.discard(self)
        mark = self._mark  # None off CUDA: no streams to order
        if mark is not None:
            _streams.join(mark)
        assert finish is not None
        if self._issued is not None:
            finish()
            # Waited for where autograd does not record: no graph, as a call
            # tied in at wait() would have none.
            output = self._issued if torch.is_grad_enabled() else self._issued.detach()
            self._issued = None
        else:
            output = apply(self._input, _ANCHOR, finish, self._backward)
            del self._input
        if mark is not None:
            _streams.keep(mark, output)
        # Drop what the call held so that wait() frees the wire buffers.
        del self._backward
        return output

    def __del__(self) -> None:
        # Dropped without a wait: its peers still wait for its messages.
        finish = getattr(self, "_finish", None)
        if finish is not None:
            _background.drop(finish)


# Calls issued and not yet waited for, finished in the background at exit.
_unwaited: weakref.WeakSet[Pending] = weakref.WeakSet()


def _at_exit() -> None:
    # While the interpreter still runs: a call's rest left to gloo's threads
    # and to the background thread would end in the interpreter's teardown,
    # which aborts the process. A later wait() (another exit hook) joins it.
    for pending in list(_unwaited):
        finish = pending._finish
        if finish is not None:
            pending._finish = _background.later(finish)
    timeout = _background.exit_timeout()
    if not _background.close(timeout):
        warnings.warn(
            f"qcomm: calls in flight at exit not done after {timeout:g} s "
            f"(qcomm.config exit_timeout, QCOMM_EXIT_TIMEOUT), given up on: a peer has not sent its part",
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(_at_exit)
