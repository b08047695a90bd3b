"""qcomm's operators for ``torch.compile`` on one rank: registered in the
``qcomm`` namespace, reached by a compiled call (counted), and clear about
what they cannot do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from counting import counting

import qcomm
from qcomm import CodecError
from qcomm.collectives import _compiled, all_to_all_pooled

NAMES = ("all_to_all_pooled", "all_to_all_sequence", "reduce_scatter_pooled", "all_gather_pooled")


def test_every_collective_has_its_operators() -> None:
    for name in NAMES:
        for part in ("start", "wait"):
            assert hasattr(torch.ops.qcomm, f"{name}_{part}"), f"{name}_{part}"
        for part in ("start", "wait", "backward"):
            assert hasattr(torch.ops.qcomm, f"_{name}_{part}"), f"_{name}_{part}"
    assert hasattr(torch.ops.qcomm, "all_reduce")


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_call_runs_qcomms_operators_and_equals_eager(
    backend: str, fullgraph: bool
) -> None:
    pair = qcomm.load_pair("int8/bf16")

    def pooled(x: torch.Tensor) -> torch.Tensor:
        return all_to_all_pooled(x * 2, [4], [3], codecs=pair).wait()

    x = torch.linspace(-1, 1, 12).view(4, 3).requires_grad_()
    eager = pooled(x)
    eager.sum().backward()
    eager_grad, x.grad = x.grad, None
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with counting("compiled_call") as calls:
        compiled = torch.compile(pooled, backend=backend, fullgraph=fullgraph)(x)
        compiled.sum().backward()
    assert torch.equal(compiled, eager)
    assert x.grad is not None and eager_grad is not None
    assert torch.equal(x.grad, eager_grad)
    # Without fullgraph a break would pass silently: counted, none.
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert calls == {
        "all_to_all_pooled_start": 1,
        "all_to_all_pooled_wait": 1,
        "all_to_all_pooled_backward": 1,
    }


def test_an_unknown_codec_key_names_the_argument() -> None:
    with pytest.raises(CodecError, match="all_to_all_pooled: codecs: no object was kept"):
        _compiled.kept("int8/bf16#999999", "all_to_all_pooled: codecs")


def test_keys_are_readable_and_one_per_object() -> None:
    pair = qcomm.load_pair("int8/bf16")
    key = _compiled._object_key(pair)
    assert key.startswith("int8/bf16#")
    assert _compiled._object_key(pair) == key
    assert _compiled._object_key(qcomm.load_pair("int8/bf16")) != key
    assert _compiled.kept(key, "codecs") is pair
    assert _compiled._object_key(None) == ""


@pytest.mark.usefixtures("one_rank")
def test_a_call_is_waited_for_once() -> None:
    x = torch.ones(2, 3)
    group = dist.distributed_c10d._get_default_group().group_name
    handle = torch.ops.qcomm.all_to_all_pooled_start(x, [2], [3], False, group, "", None)
    args = (handle, x, torch.zeros(()), [2], [3], False, group, "", None)
    assert torch.equal(torch.ops.qcomm.all_to_all_pooled_wait(*args), x)
    with pytest.raises(CodecError, match="waited for already"):
        torch.ops.qcomm.all_to_all_pooled_wait(*args)


def test_importing_qcomm_does_not_import_the_compiler() -> None:
    # torch._dynamo costs a process that never compiles its import, and with
    # it imported, spawned ranks of tools/gpu_check.py aborted at exit.
    code = (
        "import sys, qcomm, qcomm.collectives, qcomm.torchrec_exchange\n"
        "print('torch._dynamo' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False", found.stderr
