r"""
Results that are ready later, like TorchRec's ``Awaitable``: every collective
returns one, so the caller can overlap other work with the communication.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Awaitable", "NoWait"]

W = TypeVar("W")

_NOT_READY = object()


class Awaitable(abc.ABC, Generic[W]):
    r"""
    A result that is ready after :meth:`wait`; subclasses implement
    ``_wait_impl``, which :meth:`wait` runs once.

    Examples::

        >>> a = NoWait(3)
        >>> a.callbacks.append(lambda x: x + 1)
        >>> a.wait()
        4
    """

    def __init__(self) -> None:
        #: functions applied in order to the result by :meth:`wait`
        self.callbacks: list[Callable[[W], W]] = []
        self._result: object = _NOT_READY
        self._failed: Exception | None = None

    @abc.abstractmethod
    def _wait_impl(self) -> W: ...

    def wait(self) -> W:
        r"""
        wait() -> W

        Blocks until the result is ready and returns it passed through
        :attr:`callbacks`; later calls return the same object.

        Raises:
            Exception: what the call or a callback raised, on every later call too.
        """
        if self._failed is not None:
            raise self._failed
        if self._result is _NOT_READY:
            try:
                result = self._wait_impl()
                for callback in self.callbacks:
                    result = callback(result)
            except Exception as err:
                # The call cannot be waited for twice: every later wait()
                # raises the same error.
                self._failed = err
                raise
            self._result = result
        return self._result  # type: ignore[return-value]


class NoWait(Awaitable[W]):
    r"""
    An :class:`Awaitable` whose result is already there.

    Args:
        obj (W): the result.
    """

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj
