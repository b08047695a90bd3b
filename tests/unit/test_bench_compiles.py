"""What the --train harness counts of torch.compile (graphs compiled, graph
breaks): a function compiled with one graph break is counted as such."""

from __future__ import annotations

import torch

from qcomm.benchmark.harness import Compiles


def test_a_graph_break_is_counted():
    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    x = torch.randn(8)
    before = Compiles.now()
    out = torch.compile(broken, backend="eager")(x)
    counted = Compiles.now() - before
    assert torch.equal(out, x.sin().cos())
    assert counted.breaks == 1 and counted.graphs == 2, counted
    assert before + counted == Compiles.now()
