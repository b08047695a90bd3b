"""Ranks that make different calls: other splits, shapes, dtypes, codecs or
codec options (even ones only a codec's behaviour shows), another collective,
another ``QCOMM_VERIFY``. Every rank raises a ``CodecError`` naming the odd
rank and what differs, and the next call works. The full check (an agreement
exchange) runs on the first call of each collective on a group, and on every
call with ``QCOMM_VERIFY=1``; after the first call, each call's headers (with
``QCOMM_VERIFY=1``) and its in-band statuses (by default) catch what would
corrupt or hang it. The DDP all-reduce is checked like the other collectives.

The multi-rank cases run on the spawn of 3 gloo ranks per transport that
test_arguments and test_failures share (``three_ranks``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import ForeignIdentityCodec, expect, run_all
from ddp_bucket import Bucket
from dist_utils import TRANSPORTS
from three_ranks import (
    NaNRefusingCodec,
    agreement_exchanges,
    both,
    check,
    exact_on,
    in_step,
    raises,
    runs,
    with_env,
)

import qcomm
import qcomm.collectives._agreement as qverify
import qcomm.collectives._describe as qdescribe
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives.all_reduce import all_reduce, layout


class ScaledCodec(ForeignIdentityCodec):
    """No repr: its option shows only in its attributes."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.info = CodecInfo(name="scaled", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1) * self.scale

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad / self.scale


class HiddenScaleCodec(ForeignIdentityCodec):
    """A foreign codec keeping its option where only its behaviour shows it."""

    def __init__(self, scale: float) -> None:
        self.options = {"scale": scale}
        self.info = CodecInfo(name="scaled", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1) * self.options["scale"]

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad / self.options["scale"]


class RankPaddedCodec(ForeignIdentityCodec):
    """Describes itself alike on every rank but pads rows by the rank: the
    wire sizes differ, which only the call's own headers can see."""

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        extra = dist.get_rank() if dist.is_initialized() else 0
        return dim_per_rank[my_rank] + extra, extra


def fbgemm_fp16(loss_scale: float | None) -> Any:
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.distributed.fbgemm_qcomm_codec import FbgemmQuantizedCommCodec

    return FbgemmQuantizedCommCodec(comm_precision=SparseType.FP16, loss_scale=loss_scale)


def exact_all_reduce(group: Any, rank: int, world: int) -> None:
    """A valid exact all-reduce on ``group``."""
    got = all_reduce(torch.full((100,), float(rank + 1)), group=group)
    expected = float(world * (world + 1) // 2)
    assert torch.equal(got, torch.full((100,), expected)), f"all_reduce gave {got[:4].tolist()}"


# --------------------------------------------------------------------------
# Every call checked (QCOMM_VERIFY=1): the odd rank and the field are named.


def disagreements(rank: int, world: int) -> list[tuple[str, Callable[[], Any], dict[int, tuple]]]:
    """(label, call, expected) with expected[r] = (error type, words) on rank r.

    The odd rank is the last one, so that with 3 ranks the other two are the
    majority and the message must single it out.
    """
    odd = world - 1
    me_odd = rank == odd
    a2a, rs, seq = qcomm.all_to_all_pooled, qcomm.reduce_scatter_pooled, qcomm.all_to_all_sequence
    batches, dims = [2] * world, [3] * world
    x = torch.ones(sum(batches), dims[rank])

    def pair(spec: str) -> QuantizedCommCodecs:
        return QuantizedCommCodecs(qcomm.load_codec(spec), qcomm.load_codec(spec))

    def all_ranks(*words: str) -> dict[int, tuple]:
        return {r: (CodecError, (f"rank {odd} differ", *words)) for r in range(world)}

    odd_batches = [3] + [1] + [2] * (world - 2)  # same total, other split
    odd_dims = [4] + dims[1:] if odd != 0 else dims
    sends = [2] * world
    recvs_wrong = [3] + [2] * (world - 2) + [1]
    return [
        (
            "pooled batch_size_per_rank",
            lambda: a2a(x, odd_batches if me_odd else batches, dims),
            all_ranks("batch_size_per_rank", str(odd_batches), str(batches)),
        ),
        (
            "pooled dim_sum_per_rank",
            lambda: a2a(x, batches, odd_dims if me_odd else dims),
            all_ranks("dim_sum_per_rank", str(odd_dims)),
        ),
        (
            "pooled codec class",
            lambda: a2a(x, batches, dims, codecs=pair("bf16" if me_odd else "fp16")),
            all_ranks("codecs.forward", "BF16Codec", "FP16Codec"),
        ),
        (
            "pooled codec option",
            lambda: a2a(x, batches, dims, codecs=pair("int8:row_dim=64" if me_odd else "int8")),
            all_ranks("codecs.forward", "row_dim=64", "row_dim=32"),
        ),
        (
            "backward codec only",
            lambda: rs(
                x,
                codecs=QuantizedCommCodecs(
                    qcomm.load_codec("fp16"), qcomm.load_codec("bf16" if me_odd else "fp16")
                ),
            ),
            all_ranks("codecs.backward", "BF16Codec"),
        ),
        (
            "codec without repr, option in attributes",
            lambda: seq(
                x,
                input_splits=sends,
                output_splits=sends,
                codecs=QuantizedCommCodecs(ScaledCodec(2.0 if me_odd else 1.0), ScaledCodec(1.0)),
            ),
            all_ranks("codecs.forward", "scale=2.0", "scale=1.0"),
        ),
        (
            "reduce-scatter input_splits",
            lambda: rs(x, input_splits=odd_batches if me_odd else batches),
            all_ranks("input_splits", str(odd_batches)),
        ),
        (
            "reduce-scatter trailing shape",
            lambda: rs(torch.ones(sum(batches), 4 if me_odd else 3), input_splits=batches),
            all_ranks("input.shape[1:]", "[4]", "[3]"),
        ),
        (
            "sequence trailing shape",
            lambda: seq(
                torch.ones(sum(sends), 5 if me_odd else 3), input_splits=sends, output_splits=sends
            ),
            all_ranks("input.shape[1:]", "[5]"),
        ),
        (
            "input dtype without codecs",
            lambda: seq(x.half() if me_odd else x, input_splits=sends, output_splits=sends),
            all_ranks("codecs.forward", "float16", "float32"),
        ),
        (
            "sequence splits that do not mirror",
            lambda: seq(x, input_splits=sends, output_splits=recvs_wrong if rank == 0 else sends),
            {
                r: (
                    CodecError,
                    (
                        "do not match",
                        "rank 0 sends 2 rows to rank 0 (its input_splits[0])",
                        f"but rank 0 expects {recvs_wrong[0]} from rank 0 (its output_splits[0])",
                    ),
                )
                for r in range(world)
            },
        ),
        (
            "different collectives at once",
            lambda: rs(x, input_splits=batches) if me_odd else a2a(x, batches, dims),
            {
                r: (
                    CodecError,
                    (
                        "different collectives",
                        f"rank {odd} reduce_scatter_pooled",
                        "rank 0 all_to_all_pooled",
                    ),
                )
                for r in range(world)
            },
        ),
        (
            "one rank's arguments are invalid",
            lambda: a2a(x, [9] + batches[1:] if me_odd else batches, dims),
            {
                r: (ValueError, ("batch_size_per_rank", "summing"))
                if r == odd
                else (CodecError, (f"rank {odd} rejected", "batch_size_per_rank", "ValueError"))
                for r in range(world)
            },
        ),
    ]


def case_disagreement(rank: int, world: int) -> None:
    checks = []
    for label, call, expected in disagreements(rank, world):
        error, words = expected[rank]

        def check(
            label: str = label,
            call: Callable[[], Any] = call,
            error: type = error,
            words: tuple = words,
        ) -> None:
            try:
                expect(error, words, lambda: call().wait())
            except AssertionError as err:
                raise AssertionError(f"{label}: {err}") from None

        checks.append(check)
    with_env("1", lambda: run_all(checks))
    in_step(rank, world, "after-disagreement")


# --------------------------------------------------------------------------
# When the check runs, and what it sees of a codec.


def case_verification_modes(rank: int, world: int) -> None:
    """When the agreement exchange runs: first call per (group, op) by default,
    every call with QCOMM_VERIFY=1, never with QCOMM_VERIFY=0."""
    with agreement_exchanges() as exchanges:
        batches, dims = [2] * world, [3] * world
        x = torch.ones(sum(batches), dims[rank])

        def calls(group: Any) -> list[str]:
            exchanges.clear()
            qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()
            qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()
            qcomm.reduce_scatter_pooled(x, group=group).wait()
            qcomm.reduce_scatter_pooled(x, group=group).wait()
            # The DDP all-reduce, with codecs as its hook runs it.
            for _ in range(2):
                all_reduce(torch.ones(64), group=group, reduce_codec=int8, gather_codec=fp16)
            return list(exchanges)

        int8, fp16 = qcomm.load_codec("int8"), qcomm.load_codec("fp16")
        first = ["all_to_all_pooled", "reduce_scatter_pooled", "all_reduce"]
        every = ["all_to_all_pooled"] * 2 + ["reduce_scatter_pooled"] * 2 + ["all_reduce"] * 2
        results = {
            "default, new group": with_env(None, lambda: calls(dist.new_group())),
            "QCOMM_VERIFY=1": with_env("1", lambda: calls(None)),
            "QCOMM_VERIFY=0, new group": with_env("0", lambda: calls(dist.new_group())),
            "default, another new group": with_env(None, lambda: calls(dist.new_group())),
        }
        expected = {
            "default, new group": first,
            "QCOMM_VERIFY=1": every,
            "QCOMM_VERIFY=0, new group": [],
            "default, another new group": first,
        }
        assert results == expected, f"exchanges per mode: {results}, expected {expected}"

        # By default, ranks that disagree on the first call of a group are
        # caught; a failed check is not remembered as done, so the next call
        # is checked again (and, agreeing, passes).
        group = dist.new_group()
        exchanges.clear()
        odd = [3, 1] + [2] * (world - 2)

        def first_call() -> None:
            qcomm.all_to_all_pooled(
                x, odd if rank == world - 1 else batches, dims, group=group
            ).wait()

        with_env(None, lambda: expect(CodecError, (f"rank {world - 1} differ",), first_call))
        with_env(None, lambda: qcomm.all_to_all_pooled(x, batches, dims, group=group).wait())
        with_env(None, lambda: qcomm.all_to_all_pooled(x, batches, dims, group=group).wait())
        assert exchanges == ["all_to_all_pooled"] * 2, exchanges

        # Ranks with different QCOMM_VERIFY would fall out of step: told on
        # every call while they still meet, until they agree.
        group = dist.new_group()
        mixed = "1" if rank == 0 else None

        def pooled() -> Any:
            return qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()

        for _ in range(2):
            with_env(
                mixed, lambda: expect(CodecError, ("different QCOMM_VERIFY", "rank 0"), pooled)
            )
        with_env("1", pooled)
    in_step(rank, world, "after-modes")


def test_describe_codec_ignores_device_index_and_address_and_sees_options() -> None:
    class OnDevice(ForeignIdentityCodec):
        def __init__(self, device: str) -> None:
            self.device = device
            self.info = CodecInfo(name="on_device", bits_per_element=32)

    class AddressRepr(ForeignIdentityCodec):
        def __repr__(self) -> str:
            return f"<AddressRepr at {hex(id(self))}>"

    describe = qdescribe.describe_codec
    assert describe(OnDevice("cuda:0")) == describe(OnDevice("cuda:1"))
    assert describe(AddressRepr()) == describe(AddressRepr())
    assert describe(ScaledCodec(1.0)) != describe(ScaledCodec(2.0))
    assert describe(qcomm.load_codec("mx4")) != describe(qcomm.load_codec("mx4:rounding=floor"))


def case_codec_options(rank: int, world: int) -> None:
    """Codecs differing only in an option the old check could not see."""
    batches, dims = [2] * world, [4] * world
    x = torch.ones(sum(batches), dims[rank])
    odd = rank == world - 1

    def pooled(codecs: QuantizedCommCodecs) -> Any:
        return qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs).wait()

    pairs = [
        ("fbgemm loss_scale", fbgemm_fp16(None), fbgemm_fp16(1024.0)),
        ("foreign option", HiddenScaleCodec(1.0), HiddenScaleCodec(2.0)),
        ("fp16 loss_scale", qcomm.load_codec("fp16"), qcomm.load_codec("fp16:loss_scale=1024")),
    ]
    for label, same, other in pairs:
        mine = both(other if odd else same)
        group = dist.new_group()

        def call(mine: QuantizedCommCodecs = mine) -> Any:
            # The group of the moment, read when called.
            return qcomm.all_to_all_pooled(
                x,
                batches,
                dims,
                codecs=mine,
                group=group,  # noqa: B023
            ).wait()

        # Checked on every call (the first call of a group and a later one),
        # then by default (the first call of a new group only).
        for verify, calls in (("1", 2), (None, 1)):
            if verify is None:
                group = dist.new_group()
            for _ in range(calls):
                try:
                    with_env(verify, lambda: raises(CodecError, (f"rank {world - 1}",), call))
                except AssertionError as err:
                    raise AssertionError(f"{label}, QCOMM_VERIFY={verify}: {err}") from err
        pooled(both(same))
    in_step(rank, world, "codec-options")


# --------------------------------------------------------------------------
# After the first call: each call's headers and its in-band statuses.


def case_after_first_call(rank: int, world: int) -> None:
    """With QCOMM_VERIFY=1 the headers alone (the full check switched off
    here) catch splits, codecs and wire sizes that differ, on every call."""
    real = qverify.Agreement._exchange
    qverify.Agreement._exchange = lambda self, failed: None  # type: ignore[method-assign]
    try:
        with_env("1", lambda: after_first_call(rank, world))
    finally:
        qverify.Agreement._exchange = real  # type: ignore[method-assign]
    in_step(rank, world, "after-first-call")


def after_first_call(rank: int, world: int) -> None:
    """Splits and backward codecs that differ after a first good call."""
    batches, dims = [2] * world, [4] * world
    odd = rank == world - 1
    group = dist.new_group()
    x = torch.ones(sum(batches), dims[rank])
    qcomm.all_to_all_pooled(x, batches, dims, group=group).wait()  # verified, agreeing

    # Splits: a pooled call whose batch sizes differ on one rank.
    bad = [3, 1] + [2] * (world - 2) if odd else batches

    def pooled_splits() -> Any:
        return qcomm.all_to_all_pooled(x, bad, dims, group=group).wait()

    raises(CodecError, ("rank",), pooled_splits)
    # Sequence: one rank expects more rows from rank 0 than it sends.
    s_in = [1] * world
    s_out = [2] + [1] * (world - 1) if odd else s_in
    y = torch.ones(world, 4)
    qcomm.all_to_all_sequence(y, input_splits=s_in, output_splits=s_in, group=group).wait()
    expected = ("rank 0", f"rank {world - 1}") if rank in (0, world - 1) else ("rank",)
    raises(
        CodecError,
        expected,
        lambda: qcomm.all_to_all_sequence(
            y, input_splits=s_in, output_splits=s_out, group=group
        ).wait(),
    )
    # A backward codec that differs on one rank: the forward is fine, the
    # backward raises on every rank.
    fwd = qcomm.load_codec("fp16")
    bwd = qcomm.load_codec("int8" if odd else "bf16")
    codecs = QuantizedCommCodecs(forward=fwd, backward=bwd)
    xg = torch.ones(sum(batches), dims[rank], requires_grad=True)
    qcomm.all_to_all_pooled(xg, batches, dims, group=group, codecs=both(fwd)).wait()
    out = qcomm.all_to_all_pooled(xg, batches, dims, group=group, codecs=codecs).wait()
    raises(CodecError, ("backward", "rank"), lambda: out.sum().backward())
    # Wire sizes that differ though the codecs describe themselves alike:
    # with full verification too (it used to abort the process).
    padded = both(RankPaddedCodec())
    raises(
        CodecError,
        ("wire elements",),
        lambda: qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=padded).wait(),
    )


def case_codec_differs_later(rank: int, world: int) -> None:
    """A later call whose codec differs on the last rank, with the same wire
    size (its bytes fit what the peers expect): every rank raises, naming the
    other side, on the forward or the backward pass; the next call works."""
    odd = rank == world - 1
    batches, dims = [2] * world, [4] * world
    group = dist.new_group()
    fp16 = qcomm.load_codec("fp16")
    x = torch.ones(sum(batches), dims[rank], requires_grad=True)
    qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=both(fp16)).wait()
    pairs = [
        ("fp16 loss_scale", fp16, qcomm.load_codec("fp16:loss_scale=1024")),
        ("bf16 for fp16", fp16, qcomm.load_codec("bf16")),
        ("foreign option", HiddenScaleCodec(1.0), HiddenScaleCodec(2.0)),
    ]
    others = tuple(f"rank {r}" for r in range(world - 1))
    words = (*others, "made another call") if odd else (f"rank {world - 1}", "made another call")
    with agreement_exchanges() as exchanges:
        for label, same, other in pairs:
            mine = other if odd else same
            fwd = QuantizedCommCodecs(forward=mine, backward=same)
            bwd = QuantizedCommCodecs(forward=same, backward=mine)

            def forward(codecs: QuantizedCommCodecs = fwd) -> Any:
                return qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=codecs).wait()

            out = qcomm.all_to_all_pooled(x, batches, dims, group=group, codecs=bwd).wait()
            for passed, call in (("forward", forward), ("backward", out.sum().backward)):
                try:
                    raises(CodecError, words, call)
                except AssertionError as err:
                    raise AssertionError(f"{label}, {passed}: {err}") from err
                exact_on(group, rank, world)
    assert exchanges == [], f"the agreement check ran: {exchanges}"
    in_step(rank, world, "differs-later")


# --------------------------------------------------------------------------
# The DDP all-reduce: checked on its first call, statuses on every call.


def case_all_reduce_mistakes(rank: int, world: int) -> None:
    """Hooks or all_reduce calls with different codecs raise on the first call
    of a group (default) and on a later one with QCOMM_VERIFY=1; a later call
    whose codec differs with the same wire size, or whose reduce-scatter or
    all-gather codec fails on one rank, raises on every rank by default, and
    the next all-reduce is exact."""
    odd = rank == world - 1
    name = f"rank {world - 1}"
    group = dist.new_group()
    n = 100
    failures: list[str] = []

    def check(label: str, fn: Callable[[], Any]) -> None:
        # Every rank makes every call, whatever a check says: in step.
        try:
            fn()
        except AssertionError as err:
            failures.append(f"{label}: {err}")

    def hook(spec: str) -> Callable[[], Any]:
        state, fn = qcomm.ddp_comm_hook(spec, process_group=group)
        return lambda: fn(state, Bucket(torch.full((n,), float(rank + 1)))).wait()

    def reduce(buffer: torch.Tensor, **codecs: Any) -> Callable[[], Any]:
        return lambda: all_reduce(buffer, group=group, **codecs)

    def ones() -> torch.Tensor:
        return torch.full((n,), float(rank + 1))

    with agreement_exchanges() as exchanges:
        # The first call: hooks with different codecs, then (a failed check
        # is not remembered as done) all_reduce calls whose gather codec differs.
        differ = (f"{name} differs on reduce_codec", "gather_codec", "Int8Codec", "FP16Codec")
        check(
            "hooks, first call", lambda: raises(CodecError, differ, hook("int8" if odd else "fp16"))
        )
        gather = qcomm.load_codec("bf16" if odd else "fp16")
        check(
            "all_reduce, first call",
            lambda: raises(
                CodecError,
                (f"{name} differs on gather_codec",),
                reduce(ones(), gather_codec=gather),
            ),
        )
        check("first good call", lambda: exact_all_reduce(group, rank, world))
        # The hook reduces on its worker's own group, whose first call is
        # checked on its own: a good one, so that later hook calls are later.
        check("first good hook call", lambda: hook("fp16")())
        if exchanges != ["all_reduce"] * 4:
            failures.append(f"first calls: agreement exchanges {exchanges}")
        # A later call, checked with QCOMM_VERIFY=1.
        verified = functools.partial(
            raises,
            CodecError,
            (f"{name} differs on reduce_codec",),
            hook("int8" if odd else "fp16"),
        )
        check("QCOMM_VERIFY=1, later call", lambda: with_env("1", verified))
        # A later call by default: another codec with the same wire size.
        said = tuple(f"rank {r}" for r in range(world - 1)) if odd else (name,)
        check(
            "later call, bf16 for fp16",
            lambda: raises(
                CodecError,
                ("all_reduce", *said, "made another call"),
                hook("bf16" if odd else "fp16"),
            ),
        )
        exact_all_reduce(group, rank, world)
        # A codec failing on the last rank in the reduce-scatter (in the block
        # it sends first, to rank 0, or in a later one, to rank 1) or in the
        # all-gather (its own block, summed, then encoded once for all peers).
        bounds = layout(n, world, 1)
        words = (
            ("nan_refusing", "NaN in the input")
            if odd
            else ("all_reduce", name, "failed during the call")
        )
        for step, block, encodes in (
            ("reduce_codec", 0, 1),
            ("reduce_codec", 1, 2),
            ("gather_codec", world - 1, 1),
        ):
            codec = NaNRefusingCodec()
            buffer = ones()
            if odd:
                buffer[bounds[block]] = float("nan")
            call = reduce(buffer, **{step: codec})
            check(
                f"{step} failing in block {block}",
                functools.partial(raises, CodecError, words, call),
            )
            if odd and len(codec.encodes) != encodes:
                failures.append(f"{step} failing in block {block}: encodes {codec.encodes}")
            exact_all_reduce(group, rank, world)
    assert not failures, "\n".join(failures)
    assert exchanges == ["all_reduce"] * 5, f"agreement exchanges: {exchanges}"
    in_step(rank, world, "all-reduce-mistakes")


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_disagreement)
def test_ranks_that_make_different_calls_all_raise_naming_the_difference(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_verification_modes)
def test_qcomm_verify_says_when_the_agreement_exchange_runs(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_codec_options)
def test_codecs_that_differ_only_in_an_option_are_caught(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_after_first_call)
def test_headers_catch_splits_codecs_and_wire_sizes_that_differ_on_every_call(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_codec_differs_later)
def test_a_later_codec_change_of_the_same_wire_size_raises_on_every_rank(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@runs(case_all_reduce_mistakes)
def test_all_reduce_calls_that_differ_or_fail_on_one_rank_raise_on_every_rank(
    transport: str, request: pytest.FixtureRequest
) -> None:
    check(request, transport)
