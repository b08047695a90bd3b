"""Reliability: bad arguments, lying codecs, ranks that disagree, ranks that die,
malformed wire data and plugin isolation.

One spawn of 3 gloo ranks per transport (forced with ``QCOMM_TRANSPORT``:
gloo's point-to-point, and the all-to-all NCCL takes) runs the multi-rank cases
(each reported as its own test, which also checks that the case opened the
transport it names and no other); every case ends with a valid call whose
exact result shows that the failures before it sent nothing and left the
ranks in step. Dead and stalled ranks get spawns of their own with a short
process-group timeout, on each transport too. Malformed
wire data and ``qcomm list`` run in fresh interpreters, so that a crash or an
import is seen instead of taking pytest down or hiding behind earlier imports.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from codec_names import BUILTIN
from dist_utils import (
    TRANSPORTS,
    Outcome,
    RankFailure,
    check_case,
    outcomes_per_world_size,
    run_ranks,
    transport_env,
    wrong_transport,
)
from fake_dists import make_dist
from test_collectives import (
    POOLED,
    CastFP16Codec,
    ForeignIdentityCodec,
    RowInt8Codec,
    check_pooled,
    expect,
    run_all,
)

import qcomm
import qcomm.collectives._agreement as qverify
import qcomm.collectives._describe as qdescribe
import qcomm.collectives._transport as qtransport
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs
from qcomm.collectives.all_reduce import all_reduce

WORLD = 3


def in_step(rank: int, world: int, tag: str) -> None:
    """A valid exact call: fails unless every rank is at the same point."""
    batches, dims = POOLED[world][0]
    check_pooled(rank, world, batches, dims, tag, None)


# --------------------------------------------------------------------------
# Point 1: arguments checked before any communication (what test_collectives'
# case_validation does not cover).


class UncallableEncodeCodec(ForeignIdentityCodec):
    encode = 5  # type: ignore[assignment]


class StringDtypeCodec(ForeignIdentityCodec):
    @property
    def quantized_dtype(self) -> Any:
        return "uint8"


class Int16WireCodec(ForeignIdentityCodec):
    """A correct codec whose wire dtype gloo cannot carry."""

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1).round().to(torch.int16)

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad.float()

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.int16


def case_arguments(rank: int, world: int) -> None:
    a2a, rs, seq = qcomm.all_to_all_pooled, qcomm.reduce_scatter_pooled, qcomm.all_to_all_sequence
    batches, dims = [2] * world, [3] * world
    x = torch.zeros(sum(batches), dims[rank])

    def codecs(codec: Any) -> QuantizedCommCodecs:
        return QuantizedCommCodecs(forward=codec, backward=ForeignIdentityCodec())

    cases: list[tuple[type[Exception], tuple[str, ...], Callable[[], Any]]] = [
        (TypeError, ("input", "dense", "sparse"), lambda: rs(torch.ones(world, 2).to_sparse())),
        (
            TypeError,
            ("codecs.forward.encode", "method", "int"),
            lambda: a2a(x, batches, dims, codecs=codecs(UncallableEncodeCodec())),
        ),
        (
            TypeError,
            ("codecs.forward.quantized_dtype", "torch.dtype", "'uint8'"),
            lambda: rs(x, input_splits=batches, codecs=codecs(StringDtypeCodec())),
        ),
        (
            CodecError,
            ("codecs.forward", "Int16WireCodec", "torch.int16", "gloo"),
            lambda: seq(
                x, input_splits=batches, output_splits=batches, codecs=codecs(Int16WireCodec())
            ),
        ),
        (
            TypeError,
            ("input", "gloo", "torch.float8_e4m3fn"),
            lambda: seq(x.to(torch.float8_e4m3fn), input_splits=batches, output_splits=batches),
        ),
        (
            ValueError,
            ("QCOMM_VERIFY", "'yes'"),
            lambda: with_env("yes", lambda: rs(x)),
        ),
    ]
    run_all([functools.partial(expect, e, w, f) for e, w, f in cases])
    # new_group hands the processes it leaves out a marker, not a group.
    sub = dist.new_group(list(range(world - 1)))
    if rank == world - 1:
        expect(ValueError, ("group", "not a member"), lambda: a2a(x, batches, dims, group=sub))
    else:
        y = torch.full((4, 2), float(rank))
        out = a2a(y, [2] * (world - 1), [2] * (world - 1), group=sub).wait()
        assert out.tolist() == [[float(k) for k in range(world - 1) for _ in range(2)]] * 2
    in_step(rank, world, "after-arguments")


def with_env(value: str | None, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(qverify.ENV)
    if value is None:
        os.environ.pop(qverify.ENV, None)
    else:
        os.environ[qverify.ENV] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(qverify.ENV, None)
        else:
            os.environ[qverify.ENV] = old


# --------------------------------------------------------------------------
# Point 2: an encoded size other than calc_quantized_size raises CodecError
# naming the codec, before anything is sent; on every path.


class BlockLiar(RowInt8Codec):
    """A block codec (encoded segment by segment) whose wire is a byte too long."""

    def __init__(self) -> None:
        super().__init__()
        self.info = CodecInfo(name="block_liar", bits_per_element=12, error_block=self.ROW)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        wire = super().encode(input_tensor, ctx)
        return torch.cat([wire, wire.new_zeros(1)])


class ShortSummableLiar(CastFP16Codec):
    """Summable (reduce-scatter sums it natively) and a wire one element short."""

    def __init__(self) -> None:
        super().__init__()
        self.info = CodecInfo(name="short_summable_liar", bits_per_element=16, summable=True)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return super().encode(input_tensor, ctx)[1:]


class NoInfoLiar(ForeignIdentityCodec):
    """A foreign codec without info, whose size promise is off by one."""

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len + 1


def case_lying_codecs(rank: int, world: int) -> None:
    batches, dims = [2] * world, [8] * world
    x = torch.ones(sum(batches), dims[rank])
    checks = []
    for liar, name in (
        (BlockLiar, "block_liar"),
        (ShortSummableLiar, "short_summable_liar"),
        (NoInfoLiar, "NoInfoLiar"),
    ):
        pair = QuantizedCommCodecs(forward=liar(), backward=liar())
        calls = [
            lambda pair=pair: qcomm.all_to_all_pooled(x, batches, dims, codecs=pair),
            lambda pair=pair: qcomm.reduce_scatter_pooled(x, codecs=pair),
            lambda pair=pair: qcomm.all_to_all_sequence(
                x, input_splits=batches, output_splits=batches, codecs=pair
            ),
        ]
        checks += [
            lambda call=call, name=name: expect(
                CodecError, (repr(name), "calc_quantized_size"), call
            )
            for call in calls
        ]
    run_all(checks)
    # A backward codec that lies is caught on the backward pass, on every rank.
    for start in (
        lambda y, p: qcomm.all_to_all_pooled(y, batches, dims, codecs=p),
        lambda y, p: qcomm.reduce_scatter_pooled(y, codecs=p),
        lambda y, p: qcomm.all_to_all_sequence(
            y, input_splits=batches, output_splits=batches, codecs=p
        ),
    ):
        pair = QuantizedCommCodecs(forward=ForeignIdentityCodec(), backward=BlockLiar())
        y = x.clone().requires_grad_(True)
        out = start(y, pair).wait()
        expect(CodecError, ("'block_liar'", "calc_quantized_size"), out.sum().backward)
    in_step(rank, world, "after-lies")


# --------------------------------------------------------------------------
# Point 3: ranks that disagree raise CodecError naming the rank and the field.


class ScaledCodec(ForeignIdentityCodec):
    """No repr: its option shows only in its attributes."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.info = CodecInfo(name="scaled", bits_per_element=32)

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_tensor.reshape(-1) * self.scale

    def decode(self, input_grad: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return input_grad / self.scale


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


def case_verification_modes(rank: int, world: int) -> None:
    """When the agreement exchange runs: first call per (group, op) by default,
    every call with QCOMM_VERIFY=1, never with QCOMM_VERIFY=0."""
    exchanges: list[str] = []
    real = qverify.Agreement._exchange

    def counting(self: qverify.Agreement, failed: BaseException | None) -> None:
        exchanges.append(self.collective)
        real(self, failed)

    qverify.Agreement._exchange = counting  # type: ignore[method-assign]
    try:
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
    finally:
        qverify.Agreement._exchange = real  # type: ignore[method-assign]
    in_step(rank, world, "after-modes")


CASES: dict[str, Callable[[int, int], None]] = {
    "arguments": case_arguments,
    "lying_codecs": case_lying_codecs,
    "disagreement": case_disagreement,
    "verification_modes": case_verification_modes,
}


def run_case(case: str, rank: int, world: int) -> None:
    CASES[case](rank, world)


@pytest.fixture(scope="module")
def spawned() -> dict[str, Callable[[int], dict[str, Outcome]]]:
    return {
        transport: outcomes_per_world_size(
            run_case, list(CASES), env=transport_env(transport), timeout=300.0, pg_timeout=20.0
        )
        for transport in TRANSPORTS
    }


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_multi_rank(
    transport: str, case: str, spawned: dict[str, Callable[[int], dict[str, Outcome]]]
) -> None:
    outcome = spawned[transport](WORLD)[case]
    check_case(outcome, f"{case} on {WORLD} ranks, {transport}", transport)


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


# --------------------------------------------------------------------------
# Point 4: a rank that dies or stalls makes the survivors raise within the
# process group's timeout. run_ranks reports a rank that raised with its
# traceback; one that hangs is killed after `grace` seconds and has none.

PG_TIMEOUT = 3.0


def start_any(rank: int, world: int, i: int) -> Any:
    x = torch.full((2 * world, 4), float(i))
    op = i % 3
    if op == 0:
        return qcomm.all_to_all_pooled(x, [2] * world, [4] * world)
    if op == 1:
        return qcomm.reduce_scatter_pooled(x)
    return qcomm.all_to_all_sequence(x, input_splits=[2] * world, output_splits=[2] * world)


def dying_rank(rank: int, world: int, scenario: str) -> None:
    try:
        die_or_survive(rank, world, scenario)
    except Exception as err:
        # The survivor's error says which transports it opened.
        raise RuntimeError(f"opened {dict(qtransport.opened)!r}") from err


def die_or_survive(rank: int, world: int, scenario: str) -> None:
    if scenario == "exit_mid_run":
        # Rank 1 exits with calls of its own in flight; rank 0 keeps going.
        for i in range(400):
            pending = start_any(rank, world, i)
            if rank == 1 and i == 25:
                os._exit(7)
            pending.wait()
    elif scenario == "exit_before_first_call":
        # Rank 0's first call of an op waits in the agreement exchange.
        if rank == 1:
            os._exit(7)
        start_any(rank, world, 0).wait()
    elif scenario == "stall":
        # Rank 1 is alive but never calls: only the timeout can end the wait.
        if rank == 1:
            time.sleep(120)
        for i in range(3):
            start_any(rank, world, i).wait()
    raise AssertionError(f"{scenario}: rank {rank} finished without noticing the missing rank")


@pytest.mark.parametrize("scenario", ["exit_mid_run", "exit_before_first_call", "stall"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivor_raises_when_a_rank_is_gone(transport: str, scenario: str) -> None:
    # After a rank exits, rank 0 gets 4 timeouts to raise before it is killed;
    # when rank 0 raises first (stall), the sleeping rank is killed at once.
    grace = 1.0 if scenario == "stall" else 4 * PG_TIMEOUT
    with pytest.raises(RankFailure) as info:
        run_ranks(
            dying_rank,
            2,
            scenario,
            timeout=90.0,
            pg_timeout=PG_TIMEOUT,
            grace=grace,
            env=transport_env(transport),
        )
    tracebacks = info.value.tracebacks
    opened = re.search(r"RuntimeError: opened (\{.*\})", tracebacks.get(0, ""))
    assert opened is not None, f"rank 0 did not say what it opened: {tracebacks}"
    problem = wrong_transport([ast.literal_eval(opened.group(1))], transport)
    assert problem is None, problem
    assert 0 in tracebacks, f"rank 0 hung until killed instead of raising: {tracebacks}"
    survivor = tracebacks[0]
    assert "finished without noticing" not in survivor, survivor
    # It raised from inside a qcomm collective (the wait or the agreement
    # exchange), with the backend's error.
    assert "qcomm/collectives" in survivor, survivor
    if scenario != "stall":
        assert "exited with code 7" in tracebacks[1], tracebacks


# --------------------------------------------------------------------------
# Point 5: malformed wire data handed to decode raises (ValueError or
# CodecError) on every installed codec, and garbage bytes of the right size
# decode to the right length without crashing. In a fresh interpreter, so that
# an out-of-bounds read that crashes shows as a failure, not a dead pytest.

MALFORMED = textwrap.dedent(
    """
    import json, sys, torch, qcomm
    from qcomm import CodecError

    def malformed(wire):
        n = wire.numel()
        yield "truncated by one", wire[:-1]
        yield "truncated to one element", wire[:1]
        yield "one element extra", torch.cat([wire, wire[:1]])
        yield "empty", wire[:0]
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                      torch.uint8, torch.int8, torch.int64, torch.float8_e4m3fn):
            if dtype != wire.dtype:
                yield f"wrong dtype {dtype}", wire.to(dtype)
        if wire.element_size() in (1, 2):
            same = {1: (torch.int8, torch.uint8), 2: (torch.float16, torch.bfloat16)}
            for dtype in same[wire.element_size()]:
                if dtype != wire.dtype:
                    yield f"bytes reinterpreted as {dtype}", wire.view(dtype)
        yield "not a tensor", wire.tolist()
        yield "0-D", wire[0]
        yield "half the bytes", wire[: n // 2 + 1]

    codecs = sys.argv[1:]
    report = {}
    gen = torch.Generator().manual_seed(0)
    for name in codecs:
        codec = qcomm.load_codec(name)
        good = codec.encode(torch.randn(96, generator=gen))
        expected = good.numel()
        rows = []
        valid = {codec.calc_quantized_size(n) for n in range(0, 4 * expected + 64)}
        for label, wire in malformed(good):
            if isinstance(wire, torch.Tensor) and wire.dtype == good.dtype and wire.numel() in valid:
                # A length some input encodes to (any length, for a cast):
                # not malformed, as codecs read wires flat.
                rows.append([label, "valid wire", str(wire.numel())])
                continue
            try:
                out = codec.decode(wire)
            except (ValueError, TypeError, CodecError) as err:
                rows.append([label, "raised", type(err).__name__])
                continue
            except Exception as err:
                rows.append([label, "wrong error", f"{type(err).__name__}: {err}"])
                continue
            rows.append([label, "decoded", f"{getattr(out, 'numel', lambda: '?')()} elements"])
        # A valid wire that is not contiguous, or starts at an odd byte of a
        # larger buffer (a piece of a received wire), decodes like the wire.
        reference = codec.decode(good.clone())
        views = {
            "strided view": torch.stack([good, good], dim=1).view(-1)[::2],
            "odd byte offset": torch.cat([good[:1], good])[1:],
        }
        for label, wire in views.items():
            try:
                same = torch.equal(codec.decode(wire), reference)
                rows.append([label, "decoded" if same else "decoded differently", ""])
            except Exception as err:
                rows.append([label, "raised on valid wire", f"{type(err).__name__}: {err}"])
        # Garbage content of a valid size and dtype must decode (to anything,
        # NaN included) without crashing, to the right length.
        for trial in range(200):
            blocks = int(torch.randint(1, 9, (), generator=gen))
            size = codec.calc_quantized_size(32 * blocks)
            if good.dtype.is_floating_point:
                bits = torch.randint(0, 256, (size * good.element_size(),), dtype=torch.uint8, generator=gen)
                junk = bits.view(good.dtype)
            else:
                junk = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(good.dtype)
            try:
                out = codec.decode(junk)
                ok = out.numel() >= 32 * blocks and out.dim() == 1
                rows.append([f"garbage {trial}", "decoded" if ok else "wrong length", str(out.numel())])
            except Exception as err:
                rows.append([f"garbage {trial}", "raised on valid size", f"{type(err).__name__}: {err}"])
        report[name] = rows
    print(json.dumps(report))
    """
)


def test_malformed_wire_raises_on_every_builtin_codec() -> None:
    out = subprocess.run(
        [sys.executable, "-c", MALFORMED, *BUILTIN], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        f"the decoding process died ({out.returncode}):\n{out.stderr[-3000:]}"
    )
    report = json.loads(out.stdout)
    assert sorted(report) == sorted(BUILTIN)
    problems = []
    for name, rows in report.items():
        for label, what, detail in rows:
            garbage = label.startswith(("garbage", "strided view", "odd byte offset"))
            if what == "valid wire":
                continue
            if (garbage and what != "decoded") or (not garbage and what != "raised"):
                problems.append(f"{name}: {label}: {what} ({detail})")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# Point 6: `qcomm list` imports no plugin code (tests/test_registry.py covers
# available_codecs, load_codec and QCOMM_PLUGINS in-process).

WRAPPER = textwrap.dedent(
    """
    import atexit, json, sys
    watched = ("qcomm_builtin", "qcomm_example_codec", "loud_mod", "fbgemm_gpu")

    def report():
        found = sorted(m for m in sys.modules if m.split(".")[0] in watched)
        sys.stderr.write("IMPORTED " + json.dumps(found) + "\\n")

    atexit.register(report)
    from qcomm.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run_wrapped(args: list[str], tmp_path: Any, **env: str) -> tuple[str, list[str]]:
    environ = {**os.environ, "PYTHONPATH": str(tmp_path), **env}
    out = subprocess.run(
        [sys.executable, "-c", WRAPPER, *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )
    line = next((line for line in out.stderr.splitlines() if line.startswith("IMPORTED ")), None)
    assert line is not None, f"no import report (exit {out.returncode}):\n{out.stderr}"
    return out.stdout, json.loads(line.removeprefix("IMPORTED "))


def test_qcomm_list_imports_no_plugin(tmp_path: Any) -> None:
    # A plugin whose import would end the process: listing must not touch it.
    make_dist(tmp_path, "loud-codecs", "loud_mod", "raise SystemExit('imported!')\n", {"loud": "X"})
    stdout, imported = run_wrapped(["list"], tmp_path)
    assert "loud" in stdout and "int8" in stdout, stdout
    assert imported == [], f"`qcomm list` imported plugin modules {imported}"
    # The allow-list hides the distribution, still without importing anything.
    stdout, imported = run_wrapped(["list"], tmp_path, QCOMM_PLUGINS="qcomm")
    assert "loud" not in stdout and "int8" in stdout, stdout
    assert imported == []


def test_loading_one_builtin_imports_only_its_module() -> None:
    code = textwrap.dedent(
        """
        import sys, qcomm
        qcomm.load_codec("fp16")
        print(" ".join(sorted(m for m in sys.modules if m.startswith(("qcomm_builtin", "qcomm_ex")))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported = set(out.stdout.split())
    assert "qcomm_builtin.half" in imported, imported
    others = {"qcomm_builtin.int8", "qcomm_builtin.fp8", "qcomm_builtin.mx4", "qcomm_example_codec"}
    assert not imported & others, f"loading fp16 imported {sorted(imported & others)}"
