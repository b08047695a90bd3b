"""The collectives' pipeline: chunks, transports and what they must not change.

- Cutting a call into chunks changes no bit: for every codec (the built-in
  plugins and the test-local codecs of ``collective_checks``) and every
  collective, forward output and input gradient with tiny chunks, with
  automatic chunks and in one piece are identical, on 2 and 3 ranks, with
  uneven splits, widths that need padding and empty blocks.
- The backend's all-to-all transport (what NCCL uses) gives the same bits as
  the point-to-point one (what gloo uses), run here on gloo: every collective,
  the DDP all-reduce too, switched with ``QCOMM_TRANSPORT`` between calls of
  one spawn, each call's transport counted.
- A call that fails half-way (a codec raising on a later chunk, or on the
  all-to-all transport a later peer's piece) leaves the group usable for the
  next call; ``chunk_bytes`` is checked and must agree on all ranks.
- Chunk boundaries (unit tests): whole rows, multiples of the codec's block.

The multi-rank cases run once per world size and forced transport; each test
also checks that its case opened the transport it names and no other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from collective_checks import (
    CODEC_NAMES,
    LOCAL_CODECS,
    CastFP16Codec,
    assert_equal,
    gen,
    pair,
    run_all,
)
from counting import counting
from dist_utils import TRANSPORTS, Outcome, check_case, outcomes_per_world_size, transport_env

import qcomm
import qcomm.collectives._exchange as qexchange
import qcomm.collectives._transport as qtransport
from qcomm import CodecError, CodecInfo, QuantizedCommCodecs, config
from qcomm.collectives.all_reduce import all_reduce

WORLD_SIZES = (2, 3)
TINY = 256  # bytes: 64 elements, many chunks even for small inputs
WHOLE = 1 << 40  # one chunk per region

# (batches, dims) of the pooled all-to-all: uneven, with an empty batch and
# widths that block codecs pad; large enough for many tiny chunks.
POOLED = {2: ([37, 0], [40, 24]), 3: ([20, 9, 0], [33, 8, 64])}
# Rows every rank sends every rank (sequence), rows per block (reduce-scatter).
SEQUENCE = {2: [[40, 7], [0, 50]], 3: [[9, 0, 30], [12, 20, 1], [0, 8, 8]]}
REDUCE_SCATTER = {2: [23, 41], 3: [15, 0, 31]}
WIDTH = (13,)


def pooled(rank: int, world: int, codec: str | None, chunk: int | None, tag: str) -> Any:
    batches, dims = POOLED[world]
    x = gen(f"{tag}:x{rank}", (sum(batches), dims[rank]), False).requires_grad_(True)
    g = gen(f"{tag}:g{rank}", (batches[rank], sum(dims)), False)
    codecs = pair(codec) if codec else None
    out = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs, chunk_bytes=chunk).wait()
    out.backward(g)
    return out.detach(), x.grad


def reduce_scatter(rank: int, world: int, codec: str | None, chunk: int | None, tag: str) -> Any:
    splits = REDUCE_SCATTER[world]
    x = gen(f"{tag}:x{rank}", (sum(splits), *WIDTH), False).requires_grad_(True)
    g = gen(f"{tag}:g{rank}", (splits[rank], *WIDTH), False)
    codecs = pair(codec) if codec else None
    out = qcomm.reduce_scatter_pooled(
        x, input_splits=splits, codecs=codecs, chunk_bytes=chunk
    ).wait()
    out.backward(g)
    return out.detach(), x.grad


def sequence(rank: int, world: int, codec: str | None, chunk: int | None, tag: str) -> Any:
    matrix = SEQUENCE[world]
    sends = matrix[rank]
    recvs = [matrix[k][rank] for k in range(world)]
    x = gen(f"{tag}:x{rank}", (sum(sends), *WIDTH), False).requires_grad_(True)
    g = gen(f"{tag}:g{rank}", (sum(recvs), *WIDTH), False)
    codecs = pair(codec) if codec else None
    out = qcomm.all_to_all_sequence(
        x, input_splits=sends, output_splits=recvs, codecs=codecs, chunk_bytes=chunk
    ).wait()
    out.backward(g)
    return out.detach(), x.grad


def reduced(rank: int, world: int, codec: str | None, chunk: int | None, tag: str) -> Any:
    # The DDP all-reduce, summing; a length no codec's block divides. No gradient.
    x = gen(f"{tag}:x{rank}", (1001,), False)
    codecs = pair(codec) if codec else None
    return all_reduce(
        x,
        reduce_codec=codecs and codecs.forward,
        gather_codec=codecs and codecs.backward,
        chunk_bytes=chunk,
    ), None


OPS: dict[str, Callable[..., Any]] = {
    "pooled": pooled,
    "reduce_scatter": reduce_scatter,
    "sequence": sequence,
}


def same_bits(what: str, a: tuple[torch.Tensor, torch.Tensor | None], b: Any) -> None:
    assert_equal(f"{what} output", b[0], a[0])
    # NaN-free inputs: equal values are equal bits, but say so for -0.0.
    assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)), f"{what}: signs of zero"
    if a[1] is not None or b[1] is not None:
        assert a[1] is not None and b[1] is not None, f"{what}: an input gradient is missing"
        assert_equal(f"{what} input gradient", b[1], a[1])


def check_chunking(rank: int, world: int, op: str, codec: str | None) -> None:
    call = OPS[op]
    whole = call(rank, world, codec, WHOLE, f"{op}")
    same_bits(f"{op} {codec} tiny chunks", whole, call(rank, world, codec, TINY, f"{op}"))
    same_bits(f"{op} {codec} 1000-byte chunks", whole, call(rank, world, codec, 1000, f"{op}"))
    same_bits(f"{op} {codec} automatic", whole, call(rank, world, codec, None, f"{op}"))


def case_chunking(rank: int, world: int, codec: str | None) -> None:
    run_all([functools.partial(check_chunking, rank, world, op, codec) for op in OPS])


def case_automatic_chunks_of_a_large_call(rank: int, world: int) -> None:
    # 2 MiB per region: the automatic size cuts it in two; int8 and fp16.
    batches, dims = [4096] * world, [128] * world
    x = gen(f"big:x{rank}", (sum(batches), dims[rank]), False)
    for codec in ("int8", "fp16"):
        codecs = pair(codec)
        auto = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs).wait()
        whole = qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs, chunk_bytes=WHOLE).wait()
        assert_equal(f"large {codec}", auto, whole)
    assert qexchange.chunk_elements(4096 * 128, None) < 4096 * 128


# The codecs both transports run: no-op, a built-in and every test-local one.
TRANSPORT_CODECS = (None, "int8", *LOCAL_CODECS)
TRANSPORT_CLASSES = {
    "point_to_point": qtransport.PointToPoint.__name__,
    "all_to_all": qtransport.OneAllToAll.__name__,
}


def case_transports_agree(rank: int, world: int) -> None:
    # Every call once on each transport, forced alike on every rank between
    # calls; the point-to-point one in tiny chunks, the all-to-all one (NCCL's)
    # in one piece per peer. Each call (forward and backward pass, or the
    # all-reduce's two exchanges) must open two transports of the kind forced.
    calls = {**OPS, "all_reduce": reduced}
    results: dict[tuple[str, str, str | None], Any] = {}
    wrong = []
    for transport, cls in TRANSPORT_CLASSES.items():
        with config.configured(transport=transport):
            for op, call in calls.items():
                for codec in TRANSPORT_CODECS:
                    with counting("transport_opened") as opened:
                        results[transport, op, codec] = call(rank, world, codec, TINY, f"t-{op}")
                    moved = dict(opened)
                    if moved != {cls: 2}:
                        wrong.append(f"{op} {codec} with {transport} forced opened {moved}")
    assert not wrong, "; ".join(wrong)
    run_all(
        [
            functools.partial(
                same_bits,
                f"{op} {codec} one all-to-all against point-to-point",
                results["point_to_point", op, codec],
                results["all_to_all", op, codec],
            )
            for op in calls
            for codec in TRANSPORT_CODECS
        ]
    )


class FailsHalfWayCodec(CastFP16Codec):
    """Counts its encodes; raises on encode number ``fail_at``: the call fails half-way."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__()
        self.info = CodecInfo(name="fails_half_way", bits_per_element=16, rel_error_bound=2.0**-11)
        self.fail_at = fail_at
        self.encodes = 0

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self.encodes += 1
        if self.encodes == self.fail_at:
            raise RuntimeError("no more chunks today")
        return super().encode(input_tensor, ctx)


def expect_error(error: type[BaseException], words: tuple[str, ...], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except error as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"{error.__name__} without {missing}: {err}"
        return
    raise AssertionError(f"expected {error.__name__} naming {words}, nothing raised")


def case_failure_half_way_leaves_the_group_usable(rank: int, world: int) -> None:
    # A call encodes one piece per chunk (point-to-point) or per peer (all-to-all,
    # NCCL's): counted on a good call, then a call fails on the encode after
    # half of them, with pieces already encoded (and some sent).
    batches, dims = [64] * world, [16] * world
    x = gen(f"fail:x{rank}", (sum(batches), dims[rank]), False)

    def call(codec: FailsHalfWayCodec) -> Any:
        codecs = QuantizedCommCodecs(forward=codec, backward=CastFP16Codec())
        return qcomm.all_to_all_pooled(x, batches, dims, codecs=codecs, chunk_bytes=TINY).wait()

    counting = FailsHalfWayCodec()
    call(counting)
    pieces = counting.encodes
    assert pieces >= 2, f"a call of {pieces} encode(s) cannot fail half-way"
    failing = FailsHalfWayCodec(fail_at=pieces // 2 + 1)
    expect_error(
        CodecError, ("fails_half_way", "no more chunks today"), functools.partial(call, failing)
    )
    assert failing.encodes == pieces // 2 + 1, f"failed on encode {failing.encodes} of {pieces}"
    # The next calls, chunked, still line up on every rank.
    for op in OPS:
        ref = OPS[op](rank, world, None, WHOLE, f"after-{op}")
        same_bits(f"{op} after a failed call", ref, OPS[op](rank, world, None, TINY, f"after-{op}"))


def case_chunk_bytes_is_checked(rank: int, world: int) -> None:
    batches, dims = [2] * world, [3] * world
    x = torch.ones(sum(batches), dims[rank])
    a2a: Any = qcomm.all_to_all_pooled  # called with wrong types on purpose
    run_all(
        [
            functools.partial(
                expect_error,
                TypeError,
                ("chunk_bytes", "float"),
                lambda: a2a(x, batches, dims, chunk_bytes=1.5),
            ),
            functools.partial(
                expect_error,
                ValueError,
                ("chunk_bytes", "positive"),
                lambda: a2a(x, batches, dims, chunk_bytes=0),
            ),
            functools.partial(
                expect_error,
                TypeError,
                ("chunk_bytes", "bool"),
                lambda: qcomm.reduce_scatter_pooled(x, chunk_bytes=True),
            ),
        ]
    )
    # Ranks that cut different chunks would mismatch messages: refused.
    with config.configured(verify="always"):
        expect_error(
            CodecError,
            ("chunk_bytes", "rank"),
            lambda: a2a(x, batches, dims, chunk_bytes=1024 * (rank + 1)).wait(),
        )


CASES: dict[str, Callable[[int, int], None]] = {
    "noop": functools.partial(case_chunking, codec=None),
    **{f"chunking[{c}]": functools.partial(case_chunking, codec=c) for c in CODEC_NAMES},
    "automatic_chunks": case_automatic_chunks_of_a_large_call,
    "failure_half_way": case_failure_half_way_leaves_the_group_usable,
    "chunk_bytes_checked": case_chunk_bytes_is_checked,
    # Switches transports itself: run in the point-to-point spawn, reported
    # by test_transports_give_the_same_bits.
    "transports_agree": case_transports_agree,
}
# What cannot mean anything on the all-to-all transport, which sends every
# peer one piece (it never chunks): comparing chunk sizes (noop, chunking[*],
# automatic_chunks: case_transports_agree compares it with chunked
# point-to-point instead), and a failure half-way on 2 ranks (one peer: one
# encode per call).
NOT_ON_ALL_TO_ALL = {
    (world, case)
    for world in WORLD_SIZES
    for case in CASES
    if case in ("noop", "automatic_chunks") or case.startswith("chunking[")
} | {(2, "failure_half_way")}
CASES_ON = {
    "point_to_point": {world: list(CASES) for world in WORLD_SIZES},
    "all_to_all": {
        world: [c for c in CASES if (world, c) not in NOT_ON_ALL_TO_ALL and c != "transports_agree"]
        for world in WORLD_SIZES
    },
}


def run_case(name: str, rank: int, world: int) -> None:
    CASES[name](rank, world)


Spawned = Callable[[str, int], dict[str, Outcome]]


@pytest.fixture(scope="module")
def spawned() -> Spawned:
    """One spawn per transport and world size, on first use, its outcome remembered."""
    runs = {
        (transport, world): outcomes_per_world_size(
            run_case, cases[world], env=transport_env(transport), timeout=600.0, pg_timeout=30.0
        )
        for transport, cases in CASES_ON.items()
        for world in WORLD_SIZES
    }
    return lambda transport, world: runs[transport, world](world)


def spawns_of(case: str) -> pytest.MarkDecorator:
    """Parametrizes a test by the transports and world sizes whose spawns run ``case``."""
    return pytest.mark.parametrize(
        ("transport", "world"),
        [(t, w) for t in TRANSPORTS for w in WORLD_SIZES if case in CASES_ON[t][w]],
    )


def check(spawned: Spawned, transport: str, world: int, case: str) -> None:
    """Fails the calling test with ``case``'s tracebacks, or unless every rank
    opened ``transport`` only."""
    check_case(spawned(transport, world)[case], f"{case} on {world} ranks, {transport}", transport)


# Each test checks its case of the spawns that run it.


@spawns_of("noop")
def test_chunked_calls_without_codecs_give_the_bits_of_whole_ones(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, "noop")


@pytest.mark.parametrize("codec", CODEC_NAMES)
@spawns_of(f"chunking[{CODEC_NAMES[0]}]")
def test_chunked_calls_with_a_codec_give_the_bits_of_whole_ones(
    transport: str, world: int, codec: str, spawned: Spawned
) -> None:
    check(spawned, transport, world, f"chunking[{codec}]")


@spawns_of("automatic_chunks")
def test_a_large_call_is_cut_in_automatic_chunks(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, "automatic_chunks")


@spawns_of("failure_half_way")
def test_a_failure_half_way_through_a_call_leaves_the_group_usable(
    transport: str, world: int, spawned: Spawned
) -> None:
    check(spawned, transport, world, "failure_half_way")


@spawns_of("chunk_bytes_checked")
def test_chunk_bytes_is_checked(transport: str, world: int, spawned: Spawned) -> None:
    check(spawned, transport, world, "chunk_bytes_checked")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_transports_give_the_same_bits(world: int, spawned: Spawned) -> None:
    outcome = spawned("point_to_point", world)["transports_agree"]
    check_case(outcome, f"transports_agree on {world} ranks", None)
    # Counted by the case call by call; here, that each rank opened both.
    for rank, opened in enumerate(outcome.opened):
        assert all(opened.get(cls, 0) > 0 for cls in TRANSPORT_CLASSES.values()), (
            f"rank {rank} opened {opened}"
        )


# --------------------------------------------------------------------------
# Chunk boundaries, without ranks.


def test_automatic_chunk_size() -> None:
    assert qexchange.chunk_elements(100, None) == 100  # small: one chunk
    assert qexchange.chunk_elements(1 << 18, None) == 1 << 18
    assert qexchange.chunk_elements(1 << 20, None) == 1 << 18  # at least 1 MiB of float32
    assert qexchange.chunk_elements(1 << 26, None) == 1 << 23  # at most 8 chunks
    assert qexchange.chunk_elements(1 << 26, None, identity=True) == 1 << 24  # no-op: 4
    assert qexchange.chunk_elements(1 << 20, None, identity=True) == 1 << 18  # still 1 MiB
    assert qexchange.chunk_elements(1 << 26, 4096) == 1024  # float32 bytes
    assert qexchange.chunk_elements(1 << 26, 4096, identity=True) == 1024  # as given


def test_rows_cut_at_whole_rows_and_blocks() -> None:
    region = qexchange.Rows(torch.zeros(100, 40), padded=48)
    chunks = region.chunks(32, 1000)
    assert chunks[0][0] == 0 and chunks[-1][1] == 100 * 48
    for start, stop in chunks:
        assert start % 48 == 0 and start % 32 == 0
        assert (stop - start) % 48 == 0
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert qexchange.Rows(torch.zeros(0, 40), 48).chunks(32, 10) == [(0, 0)]
    assert qexchange.Rows(torch.zeros(5, 0), 0).chunks(32, 10) == [(0, 0)]


def test_rows_read_pads_and_write_strips() -> None:
    base = torch.arange(30.0).view(5, 6)
    region = qexchange.Rows(base[:, 1:4], padded=8)
    chunk = region.read(8, 24)  # rows 1 and 2
    assert chunk.tolist() == [7, 8, 9, 0, 0, 0, 0, 0, 13, 14, 15, 0, 0, 0, 0, 0]
    out = torch.zeros(5, 6)
    target = qexchange.Rows(out[:, 2:5], padded=8)
    target.write(8, 24, chunk, add=False)
    assert out[1, 2:5].tolist() == [7, 8, 9] and out[2, 2:5].tolist() == [13, 14, 15]
    target.write(8, 24, chunk, add=True)
    assert out[1, 2:5].tolist() == [14, 16, 18]
    assert target.target(8, 24) is None  # padding to strip: no direct decode
    assert qexchange.Rows(out[:, 2:5], padded=3).target(3, 9) is not None


def test_flat_cut_at_blocks_and_padded_at_its_end() -> None:
    region = qexchange.Flat(torch.arange(70.0), padded=96)
    chunks = region.chunks(32, 40)
    assert chunks == [(0, 32), (32, 64), (64, 96)]
    assert region.read(64, 96).tolist() == [*range(64, 70), *[0] * 26]
    assert region.target(64, 96) is None and region.target(0, 32) is not None
    assert qexchange.Flat(torch.zeros(0), 0).chunks(32, 40) == [(0, 0)]


def test_peer_orders_mirror() -> None:
    for world in (2, 3, 5):
        for rank in range(world):
            sends = qexchange.send_order(rank, world)
            assert sorted(sends) == [r for r in range(world) if r != rank]
            # My i-th send goes to the rank whose i-th receive comes from me.
            for i, peer in enumerate(sends):
                assert qexchange.recv_order(peer, world)[i] == rank


# --------------------------------------------------------------------------
# Outputs from reused memory.


def test_leased_memory_comes_back_only_when_the_last_view_is_gone() -> None:
    import gc

    from qcomm.collectives import _buffers

    shape = (512, 1024)  # 2 MiB of float32: above MIN_BYTES
    out = _buffers.lease(shape, torch.float32, torch.device("cpu"))
    assert out.shape == shape and out.is_contiguous() and out._base is None
    address = out.data_ptr()
    out.fill_(1.0)
    view = out[10:20]
    del out
    gc.collect()
    # The view still holds the memory: a new lease must not get it.
    other = _buffers.lease(shape, torch.float32, torch.device("cpu"))
    assert other.data_ptr() != address
    other.fill_(2.0)
    assert bool((view == 1.0).all())
    del view
    gc.collect()
    again = _buffers.lease(shape, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == address  # reused, no fresh pages
    again.mul_(3.0)  # an ordinary tensor: in-place works
    with pytest.raises(RuntimeError, match="resiz"):
        again.resize_(1024, 1024)
    small = _buffers.lease((4, 4), torch.float32, torch.device("cpu"))
    small.resize_(8, 8)  # small outputs are plain tensors


def test_receive_buffers_are_reused_across_dtypes() -> None:
    from qcomm.collectives import _buffers

    first = _buffers.take(4 << 20, torch.uint8, torch.device("cpu"))
    address = first.data_ptr()
    _buffers.give(first)
    wanted = (3 << 20) // 4 - 3  # float32s: within the best-fit range of 4 MiB
    second = _buffers.take(wanted, torch.float32, torch.device("cpu"))
    assert second.data_ptr() == address and second.dtype == torch.float32
    assert second.numel() == wanted
    _buffers.give(second)
