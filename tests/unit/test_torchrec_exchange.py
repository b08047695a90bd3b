"""How qcomm's exchange takes TorchRec's place (``qcomm.torchrec_exchange``):
which functions it replaces, when, for which calls, and what happens when a
TorchRec upgrade moves them. That the replaced paths give TorchRec's results
is checked by test_compat_torchrec_paths.py and test_torchrec_e2e.py, which
run every path on both doors and count the calls."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from counting import counted

import qcomm
from qcomm import torchrec_exchange

pytest.importorskip("torchrec")

from torchrec.distributed import comm_ops, dist_data  # noqa: E402

# What TorchRec 1.8's sharded modules call, by the name dist_data imports.
REPLACED = [
    "alltoall_pooled",
    "variable_batch_alltoall_pooled",
    "reduce_scatter_base_pooled",
    "reduce_scatter_v_pooled",
    "reduce_scatter_v_per_feature_pooled",
    "alltoall_sequence",
]


@pytest.fixture
def fresh() -> object:
    """TorchRec's own functions before and after the test."""
    torchrec_exchange.uninstall()
    yield
    torchrec_exchange.uninstall()


def test_install_replaces_every_collective_torchrec_calls(fresh: object) -> None:
    # Fails loudly when a TorchRec upgrade renames, moves or re-signs one of
    # the functions its modules call: then nothing runs on qcomm's exchange.
    originals = {name: getattr(comm_ops, name) for name in REPLACED}
    assert all(getattr(dist_data, n) is originals[n] for n in REPLACED)
    torchrec_exchange.install()
    assert torchrec_exchange.installed()
    for name in REPLACED:
        for module in (comm_ops, dist_data):
            replaced = getattr(module, name)
            assert replaced is not originals[name], f"{module.__name__}.{name} not replaced"
            assert replaced.__wrapped__ is originals[name]
    torchrec_exchange.install()  # again: nothing wraps twice
    assert dist_data.alltoall_pooled.__wrapped__ is originals["alltoall_pooled"]
    torchrec_exchange.uninstall()
    assert all(getattr(dist_data, n) is originals[n] for n in REPLACED)
    assert all(getattr(comm_ops, n) is originals[n] for n in REPLACED)


def test_a_moved_function_is_refused_whole(fresh: object, monkeypatch: pytest.MonkeyPatch) -> None:
    def alltoall_sequence(tensor, splits, group=None, codecs=None):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    monkeypatch.setattr(comm_ops, "alltoall_sequence", alltoall_sequence)
    monkeypatch.setattr(dist_data, "alltoall_sequence", alltoall_sequence)
    with pytest.raises(RuntimeError, match="alltoall_sequence has no parameter a2a_sequence_embs"):
        torchrec_exchange.install()
    assert not torchrec_exchange.installed()
    assert dist_data.alltoall_pooled is comm_ops.alltoall_pooled
    assert not hasattr(dist_data.alltoall_pooled, "__wrapped__")
    # build_registry warns and leaves TorchRec's transport in place.
    with pytest.warns(RuntimeWarning, match="QCOMM_TORCHREC_COLLECTIVES=torchrec"):
        qcomm.build_registry(forward="fp16")
    assert not torchrec_exchange.installed()
    # dist_data calling something else than comm_ops' function is refused too.
    monkeypatch.setattr(dist_data, "alltoall_sequence", comm_ops.alltoall_pooled)
    with pytest.raises(RuntimeError, match="dist_data no longer calls comm_ops.alltoall_sequence"):
        torchrec_exchange.install()


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("", True), ("qcomm", True), (" QCOMM ", True), ("torchrec", False)):
        monkeypatch.setenv(torchrec_exchange.ENV, value)
        assert torchrec_exchange.enabled() is on
    monkeypatch.setenv(torchrec_exchange.ENV, "nccl")
    with pytest.raises(
        ValueError, match="QCOMM_TORCHREC_COLLECTIVES: expected 'qcomm' or 'torchrec'"
    ):
        torchrec_exchange.enabled()
    with pytest.raises(ValueError, match="QCOMM_TORCHREC_COLLECTIVES"):
        qcomm.build_registry(forward="fp16")


def test_other_calls_stay_on_torchrec(fresh: object) -> None:
    # TorchRec's own codecs, no codecs, and world size 1 go to TorchRec's
    # function as they are.
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    torchrec_exchange.install()
    theirs = get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.FP16))
    assert theirs is not None
    ours = qcomm.build_registry(forward="fp16")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = sum(counted("torchrec_call").values())
        x = torch.randn(4, 8)
        for codecs in (
            None,
            theirs["POOLED_EMBEDDINGS_ALL_TO_ALL"],
            ours["POOLED_EMBEDDINGS_ALL_TO_ALL"],
        ):
            out = dist_data.alltoall_pooled(x, [4], [8], codecs=codecs).wait()
            assert torch.equal(out, x)
        assert sum(counted("torchrec_call").values()) == before
    finally:
        dist.destroy_process_group()


def test_a_call_that_does_not_fit_the_signature_gets_torchrecs_own_error(fresh: object) -> None:
    # The door binds arguments itself (inspect.signature does not trace
    # under torch.compile): what does not fit goes to TorchRec's function,
    # which raises its own TypeError.
    torchrec_exchange.install()
    x = torch.randn(2, 4)
    for args, kwargs, message in (
        ((x, [2], [4]), {"bogus": 1}, "unexpected keyword argument 'bogus'"),
        ((x, [2]), {}, "missing 1 required positional argument: 'dim_sum_per_rank'"),
        ((x, [2], [4]), {"batch_size_per_rank": [2]}, "multiple values for argument"),
        ((x, [2], [4], None, None, None, None, None, 9), {}, "takes from 3 to 8 positional"),
    ):
        with pytest.raises(TypeError, match=message):
            comm_ops.alltoall_pooled(*args, **kwargs)


def test_build_registry_installs_once_torchrec_is_imported() -> None:
    # Importing TorchRec costs seconds: build_registry does not, it installs
    # when the user's own import of TorchRec happens (or at once, after it).
    script = textwrap.dedent(
        """
        import sys
        import qcomm
        from qcomm import torchrec_exchange
        qcomm.build_registry(forward="int8", backward="bf16", allow_unsummable_reduce_scatter=True)
        assert "torchrec" not in sys.modules
        assert not torchrec_exchange.installed()
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed import dist_data
        assert torchrec_exchange.installed()
        assert dist_data.alltoall_pooled.__wrapped__ is not None
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    # Under QCOMM_TORCHREC_COLLECTIVES=torchrec nothing is installed.
    off = script.replace(
        "assert torchrec_exchange.installed()", "assert not torchrec_exchange.installed()"
    )
    off = off.replace("assert dist_data.alltoall_pooled.__wrapped__ is not None", "")
    env = {**__import__("os").environ, torchrec_exchange.ENV: "torchrec"}
    done = subprocess.run(
        [sys.executable, "-c", off],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
