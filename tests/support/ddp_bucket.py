"""What DDP hands a communication hook, for the hook's tests without DDP."""

from __future__ import annotations

import torch


class Bucket:
    """What DDP hands a hook, for the hook's cases: a flat buffer and its index."""

    def __init__(self, buffer: torch.Tensor, index: int = 0, shapes: tuple[int, ...] = ()) -> None:
        self._buffer = buffer
        self._index = index
        self._params = [torch.empty(s) for s in shapes] or [torch.empty(buffer.numel())]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return self._params
