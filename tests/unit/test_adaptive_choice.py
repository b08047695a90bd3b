"""AdaptiveCodec's options, specs and choice, and the error measurement of a sample, on one process."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch

import qcomm
from qcomm.adaptive import DEFAULT_MAX_ERROR, DEFAULT_WINDOW, AdaptiveCodec, _choose
from qcomm.collectives import _measure
from qcomm.history import CallRecord, error_history


def _load(spec: str) -> AdaptiveCodec:
    codec = qcomm.load_codec(spec)
    assert isinstance(codec, AdaptiveCodec), codec
    return codec


@pytest.fixture(params=["own figures", "encoded and decoded"])
def measured_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each measurement twice: with the built-in codecs' C kernels (their own
    round_trip_error), and with qcomm encoding and decoding the sample."""
    if request.param == "encoded and decoded":
        monkeypatch.setattr(_measure, "_quick", lambda codec, x: None)
    return str(request.param)


def _record(codec: str = "int8") -> CallRecord:
    return CallRecord("all_to_all_pooled forward", 0, codec, (0.0,), (0.0,), 10, 40)


def _learn(codec: AdaptiveCodec, errors: list[list[float]], key: str = "c") -> int:
    """One call's figures (``errors[rank][candidate]``); the next call's candidate."""
    used = codec.current(key)
    codec.learn(key, None, used, errors, _record())
    return codec.current(key)


def test_a_spec_builds_the_candidates_in_order_with_their_own_options() -> None:
    codec = _load("adaptive:mx4|int8:row_dim=64|bf16,max_error=0.01,window=3")
    assert isinstance(codec, AdaptiveCodec)
    assert codec.names == ("mx4", "int8", "bf16")
    assert codec.candidates[1].row_dim == 64
    assert (codec.max_error, codec.window, codec.on_exceed) == (0.01, 3, "warn")


def test_the_defaults_are_the_advice_budget_and_eight_calls() -> None:
    from qcomm.benchmark.advice import DEFAULT_MAX_ERROR as ADVICE

    codec = _load("adaptive:int8|bf16")
    assert codec.max_error == DEFAULT_MAX_ERROR == ADVICE
    assert codec.window == DEFAULT_WINDOW == 8


def test_a_budget_on_any_spec_makes_a_guard_of_one_candidate() -> None:
    codec = _load("int8:max_error=1e-2,on_exceed=raise")
    assert isinstance(codec, AdaptiveCodec)
    assert codec.names == ("int8",)
    assert (codec.max_error, codec.on_exceed) == (0.01, "raise")


def test_a_pair_spec_gives_each_direction_its_own_adaptive_codec() -> None:
    registry = qcomm.build_registry(forward="adaptive:mx4|int8", backward="bf16:max_error=0.1")
    pair = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(pair.forward, AdaptiveCodec)
    assert isinstance(pair.backward, AdaptiveCodec)
    others = [p.forward for k, p in registry.items() if k != "POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert all(o is not pair.forward for o in others)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("adaptive:", "empty candidate"),
        ("adaptive:int8||bf16", "empty candidate"),
        ("adaptive:int8|bf16,max_error=0", "max_error"),
        ("adaptive:int8|bf16,max_error=nan", "max_error"),
        ("adaptive:int8|bf16,window=0", "window"),
        ("adaptive:int8|bf16,on_exceed=stop", "on_exceed"),
        ("adaptive:int8|bf16,max_error=0.1,max_error=0.2", "given twice"),
        ("adaptive:int8|adaptive:bf16", "cannot be a candidate"),
        ("adaptive:int8|nosuch", "unknown codec 'nosuch'"),
        ("int8:max_error=-1", "max_error"),
    ],
)
def test_a_bad_adaptive_spec_raises_naming_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(qcomm.CodecError, match=says):
        qcomm.load_codec(spec)


def test_bad_arguments_raise_naming_the_argument() -> None:
    int8 = qcomm.load_codec("int8")
    with pytest.raises(ValueError, match="candidates"):
        AdaptiveCodec([])
    with pytest.raises(TypeError, match="candidates"):
        AdaptiveCodec("int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"candidates\[1\]"):
        AdaptiveCodec([int8, object()])
    with pytest.raises(TypeError, match=r"candidates\[0\]: an AdaptiveCodec"):
        AdaptiveCodec([AdaptiveCodec([int8])])
    with pytest.raises(ValueError, match="window"):
        AdaptiveCodec([int8], window=True)  # type: ignore[arg-type]


def test_an_adaptive_codec_refuses_to_encode_outside_qcomms_exchange() -> None:
    codec = _load("adaptive:int8|bf16")
    for call in (
        lambda: codec.encode(torch.ones(4)),
        lambda: codec.decode(torch.ones(4)),
        lambda: codec.calc_quantized_size(4),
        codec.create_context,
    ):
        with pytest.raises(qcomm.CodecError, match="qcomm's exchange only"):
            call()


def test_the_most_precise_candidate_is_used_until_measured() -> None:
    codec = _load("adaptive:mx4|int8|bf16,window=2")
    assert codec.current("c") == 2


def test_a_cheaper_candidate_is_taken_after_window_calls_within_budget_on_every_rank() -> None:
    codec = _load("adaptive:mx4|int8|bf16,max_error=0.05,window=3")
    # mx4 within budget on rank 0 but over on rank 1: int8 it is, after 3 calls.
    fine = [[0.01, 0.004, 0.002], [0.09, 0.004, 0.002]]
    assert [_learn(codec, fine) for _ in range(3)] == [2, 2, 1]
    good = [[0.01, 0.004, 0.002], [0.02, 0.004, 0.002]]
    assert [_learn(codec, good) for _ in range(3)] == [1, 1, 0]


def test_a_call_over_budget_moves_to_a_more_precise_candidate_at_once() -> None:
    codec = _load("adaptive:mx4|int8|bf16,max_error=0.05,window=2")
    for _ in range(2):
        _learn(codec, [[0.01, 0.004, 0.002]] * 2)
    assert codec.current("c") == 0
    # mx4 and int8 both over on one rank: straight to bf16.
    assert _learn(codec, [[0.01, 0.004, 0.002], [0.2, 0.08, 0.003]]) == 2
    # And back to mx4 only after two clean calls of it.
    assert [_learn(codec, [[0.01, 0.004, 0.002]] * 2) for _ in range(2)] == [2, 0]


def test_a_candidate_not_measured_on_any_rank_is_not_taken() -> None:
    codec = _load("adaptive:mx4|bf16,window=1")
    assert _learn(codec, [[math.nan, 0.002]] * 2) == 1


def test_collectives_and_passes_adapt_apart() -> None:
    codec = _load("adaptive:mx4|bf16,window=1")
    _learn(codec, [[0.001, 0.001]], key="forward")
    assert (codec.current("forward"), codec.current("backward")) == (0, 1)


def test_the_choice_rule_picks_the_first_candidate_that_qualifies() -> None:
    from collections import deque

    seen = [deque([0.1, 0.01], maxlen=2), deque([0.01, 0.01], maxlen=2), deque([0.01], maxlen=2)]
    assert _choose(seen, 2, 0.05, 2) == 1
    assert _choose(seen, 1, 0.05, 2) == 1
    seen = [deque([0.1], maxlen=2), deque([0.1], maxlen=2), deque([0.1], maxlen=2)]
    assert _choose(seen, 0, 0.05, 2) == 2  # none qualifies: the last


def test_the_last_candidate_over_budget_warns_once_per_collective() -> None:
    codec = _load("adaptive:mx4|bf16,max_error=0.01,window=1")
    over = [[0.5, 0.02], [0.5, 0.03]]
    with pytest.warns(RuntimeWarning, match=r"c: bf16's relative RMS error 0.03 on rank 1"):
        _learn(codec, over)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _learn(codec, over)  # not again for this collective


def test_a_guard_with_on_exceed_raise_returns_the_error_naming_collective_rank_and_error() -> None:
    codec = _load("int8:max_error=0.01,on_exceed=raise")
    used = codec.current("all_to_all_pooled forward")
    error = codec.learn(
        "all_to_all_pooled forward",
        None,
        used,
        [[0.001], [0.002], [0.04]],
        _record(),
    )
    assert isinstance(error, qcomm.CodecError)
    assert str(error) == (
        "all_to_all_pooled forward: int8's relative RMS error 0.04 on rank 2 exceeds the "
        "budget 0.01 (max_error)"
    )


def test_a_switch_is_logged_at_info_and_kept_in_the_history(
    caplog: pytest.LogCaptureFixture,
) -> None:
    codec = _load("adaptive:mx4|bf16,window=1")
    with caplog.at_level("INFO", logger="qcomm.adaptive"):
        _learn(codec, [[0.001, 0.001]])
    assert "c: bf16 -> mx4" in caplog.text
    history = error_history(qcomm.QuantizedCommCodecs(forward=codec))
    assert [r.switched_to for r in history] == ["mx4"]


def test_an_adaptive_codec_pickles_with_its_options_and_a_fresh_choice() -> None:
    codec = _load("adaptive:mx4|bf16,max_error=0.02,window=1")
    _learn(codec, [[0.001, 0.001]])
    copy = pickle.loads(pickle.dumps(codec))
    assert (copy.names, copy.max_error, copy.window) == (("mx4", "bf16"), 0.02, 1)
    assert copy.current("c") == 1 and error_history(copy) == []


def test_the_sample_is_measured_on_whole_scale_blocks_as_the_call_encodes_them(
    measured_by: str,
) -> None:
    int8 = qcomm.load_codec("int8")
    x = torch.randn(64, 96)
    x[5, 3] = 1e4  # one row's scale, and only that row's, is wrecked
    whole = int8.decode(int8.encode(x.reshape(-1))).reshape(64, 96)
    rms, top = _measure._error(int8, x.reshape(-1), torch.float32)
    lost = whole - x
    assert rms == pytest.approx(float(lost.norm() / x.norm()), rel=1e-5)
    assert top == pytest.approx(float(lost.abs().max() / x.abs().max()), rel=1e-5)


def test_an_underflowing_codec_measures_a_relative_error_of_one(measured_by: str) -> None:
    fp16 = qcomm.load_codec("fp16")
    rms, top = _measure._error(fp16, torch.randn(1000) * 1e-9, torch.float32)
    assert rms == pytest.approx(1.0) and top == pytest.approx(1.0)


def test_a_saturating_codec_measures_its_loss_and_nonfinite_inputs_are_left_out(
    measured_by: str,
) -> None:
    fp16 = qcomm.load_codec("fp16")
    x = torch.ones(100)
    x[0] = 1e6  # fp16 saturates at 65504: most of this value is lost
    rms = _measure._error(fp16, x, torch.float32)[0]
    assert rms == pytest.approx((1e6 - 65504) / math.sqrt(1e12 + 99), rel=1e-3)
    x[0] = math.nan
    assert _measure._error(fp16, x, torch.float32)[0] == 0.0


def test_an_all_zero_sample_measures_no_error(measured_by: str) -> None:
    mx4 = qcomm.load_codec("mx4")
    assert _measure._error(mx4, torch.zeros(64), torch.float32) == [0.0, 0.0]


def test_a_registry_wide_budget_guards_every_codec_without_one_of_its_own() -> None:
    registry = qcomm.build_registry(
        "pooled_embeddings_all_to_all=int8/adaptive:fp16|bf16,"
        "pooled_embeddings_reduce_scatter=adaptive:mx4|int8,max_error=0.2/noop",
        max_error=0.01,
        on_exceed="raise",
    )
    pooled = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(pooled.forward, AdaptiveCodec)
    assert (pooled.forward.names, pooled.forward.max_error) == (("int8",), 0.01)
    assert pooled.forward.on_exceed == "raise"
    assert (pooled.backward.names, pooled.backward.max_error) == (("fp16", "bf16"), 0.01)
    scatter = registry["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    assert scatter.forward.max_error == 0.2  # its own budget stays
    assert isinstance(scatter.backward, qcomm.NoOpQuantizedCommCodec)


def test_a_registry_wide_budget_reaches_codecs_by_host_and_is_checked() -> None:
    registry = qcomm.build_registry(
        {"POOLED_EMBEDDINGS_ALL_TO_ALL": "same_host=noop+other_host=int8/bf16"}, max_error=0.05
    )
    pair = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(pair, qcomm.HostCodecs)
    assert isinstance(pair.same_host.forward, qcomm.NoOpQuantizedCommCodec)
    assert pair.other_host.backward.names == ("bf16",)
    with pytest.raises(qcomm.CodecError, match="max_error"):
        qcomm.build_registry(forward="int8", max_error=-1.0)
    with pytest.raises(qcomm.CodecError, match="on_exceed is given without max_error"):
        qcomm.build_registry(forward="int8", on_exceed="raise")


@pytest.mark.parametrize(
    "spec",
    ["adaptive:mx4|int8", "int8:max_error=0.1", "same_host=noop+other_host=bf16:on_exceed=raise"],
)
def test_the_collective_bench_refuses_budgets_and_adaptive_codecs(spec: str) -> None:
    from qcomm.benchmark.options import check_spec

    with pytest.raises(qcomm.CodecError, match="qcomm bench --train"):
        check_spec(spec)


def test_a_stochastic_codec_is_measured_without_moving_the_users_random_stream() -> None:
    codec = qcomm.load_codec("mx4:rounding=stochastic")
    assert qcomm.codec_info(codec).stochastic
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    rms, _ = _measure._error(codec, torch.randn(4096, generator=torch.Generator()), torch.float32)
    assert 0 < rms < 0.2
    assert torch.equal(torch.rand(3), expected)


def test_a_stateful_codec_is_not_measured() -> None:
    from qcomm.collectives._coding import Coding, Side

    int8 = qcomm.load_codec("int8")

    class Stateful:
        info = qcomm.CodecInfo("stateful", 10.0, stateful=True)

        def __getattr__(self, name: str) -> Any:
            return getattr(int8, name)

    codec = Stateful()
    side = Side(codec, 0, Coding(codec, torch.float32))
    assert not _measure.measured(side) and _measure.slots_of(side) == 0
    assert _measure.slots_of(Side(int8, 0, Coding(int8, torch.float32))) == 1
