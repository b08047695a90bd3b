"""qcomm's settings (``qcomm.config``): the environment as the defaults, read
once at the first use; fields set in code and for a block; every bad value
refused with the name of its variable or field; and each setting reaching
the code that obeys it."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting import counted
from dist_utils import TRANSPORTS, run_ranks, transport_env

import qcomm
from qcomm import CodecError, config, torchrec_exchange
from qcomm.collectives import _agreement, _background, _hosts, _transport

_VARIABLES = {
    "QCOMM_TRANSPORT",
    "QCOMM_VERIFY",
    "QCOMM_RANKS_PER_HOST",
    "LOCAL_WORLD_SIZE",
    "QCOMM_TORCHREC_COLLECTIVES",
    "QCOMM_EXIT_TIMEOUT",
    "QCOMM_PLUGINS",
    "QCOMM_CODECS",
    "QCOMM_MEASURE_ERRORS",
}


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No variable of qcomm's set: every field at its default."""
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _reading(reads: collections.Counter[str], field: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, which must read ``field`` through qcomm.config."""
    before = reads[field]
    out = fn()
    assert reads[field] > before, f"{fn} did not read {field}"
    return out


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """The fields read through qcomm.config by qcomm's modules, counted; and
    how often the environment was read (``"environment"``)."""
    counts: collections.Counter[str] = collections.Counter()
    read, read_environment = config._read, config._read_environment

    def counting_read(field: str) -> tuple[Any, str]:
        counts[field] += 1
        return read(field)

    def counting_environment() -> Any:
        counts["environment"] += 1
        return read_environment()

    monkeypatch.setattr(config, "_read", counting_read)
    monkeypatch.setattr(config, "_read_environment", counting_environment)
    config._reread()
    yield counts


def test_the_defaults(clean: pytest.MonkeyPatch) -> None:
    assert config.get() == config.Settings()
    assert config.get() == config.Settings(
        transport="auto",
        verify="first",
        ranks_per_host=None,
        torchrec_collectives="qcomm",
        exit_timeout=10.0,
        plugins="",
        codecs="",
        measure_errors=False,
    )
    assert set(config.VARIABLES.values()) == _VARIABLES - {"LOCAL_WORLD_SIZE"}


@pytest.mark.parametrize(
    "variable, text, field, value",
    [
        ("QCOMM_TRANSPORT", " All_To_All ", "transport", "all_to_all"),
        ("QCOMM_TRANSPORT", "point_to_point", "transport", "point_to_point"),
        ("QCOMM_TRANSPORT", "auto", "transport", "auto"),
        ("QCOMM_VERIFY", "1", "verify", "always"),
        ("QCOMM_VERIFY", "0", "verify", "never"),
        ("QCOMM_VERIFY", "", "verify", "first"),
        ("QCOMM_RANKS_PER_HOST", "4", "ranks_per_host", 4),
        ("LOCAL_WORLD_SIZE", "8", "ranks_per_host", 8),
        ("QCOMM_TORCHREC_COLLECTIVES", " TorchRec", "torchrec_collectives", "torchrec"),
        ("QCOMM_TORCHREC_COLLECTIVES", "qcomm", "torchrec_collectives", "qcomm"),
        ("QCOMM_EXIT_TIMEOUT", "2.5", "exit_timeout", 2.5),
        ("QCOMM_PLUGINS", " qcomm,good-codecs ", "plugins", "qcomm,good-codecs"),
        ("QCOMM_CODECS", "fp16/bf16", "codecs", "fp16/bf16"),
        ("QCOMM_MEASURE_ERRORS", "1", "measure_errors", True),
        ("QCOMM_MEASURE_ERRORS", " On", "measure_errors", True),
        ("QCOMM_MEASURE_ERRORS", "0", "measure_errors", False),
        ("QCOMM_MEASURE_ERRORS", "", "measure_errors", False),
    ],
)
def test_each_variable_gives_its_field(
    clean: pytest.MonkeyPatch, variable: str, text: str, field: str, value: Any
) -> None:
    clean.setenv(variable, text)
    assert getattr(config.get(), field) == value
    assert config._read(field) == (value, variable)


def test_qcomm_ranks_per_host_comes_before_torchruns(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("LOCAL_WORLD_SIZE", "8")
    clean.setenv("QCOMM_RANKS_PER_HOST", "2")
    assert config._read("ranks_per_host") == (2, "QCOMM_RANKS_PER_HOST")


def test_the_environment_is_read_once(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    # setitem, not setenv: the conftest's setenv reads the environment anew,
    # and both leave the variables as they were after the test.
    clean.setitem(os.environ, "QCOMM_VERIFY", "1")
    assert reads["environment"] == 0  # nothing read before the first use
    assert config.get().verify == "always"
    # Changed afterwards, in this process: not read again.
    clean.setitem(os.environ, "QCOMM_VERIFY", "0")
    clean.setitem(os.environ, "QCOMM_TRANSPORT", "all_to_all")
    for _ in range(3):
        assert config.get().verify == "always" and config.get().transport == "auto"
    assert _agreement.mode() == "always"
    assert reads["environment"] == 1
    # The test hook reads it again.
    config._reread()
    assert config.get().verify == "never" and reads["environment"] == 2


@pytest.mark.parametrize(
    "variable, text, field",
    [
        ("QCOMM_TRANSPORT", "nccl", "transport"),
        ("QCOMM_VERIFY", "yes", "verify"),
        ("QCOMM_MEASURE_ERRORS", "sometimes", "measure_errors"),
        ("QCOMM_RANKS_PER_HOST", "two", "ranks_per_host"),
        ("QCOMM_RANKS_PER_HOST", "0", "ranks_per_host"),
        ("LOCAL_WORLD_SIZE", "-1", "ranks_per_host"),
        ("QCOMM_TORCHREC_COLLECTIVES", "gloo", "torchrec_collectives"),
        ("QCOMM_EXIT_TIMEOUT", "soon", "exit_timeout"),
        ("QCOMM_EXIT_TIMEOUT", "nan", "exit_timeout"),
    ],
)
def test_an_invalid_variable_is_named(
    clean: pytest.MonkeyPatch, variable: str, text: str, field: str
) -> None:
    clean.setenv(variable, text)
    with pytest.raises(ValueError, match=rf"^{variable}: expected .*got '{text}'"):
        config.get()
    with pytest.raises(ValueError, match=rf"^{variable}: "):
        config._read(field)
    # Only what reads that field fails; a value set in code stands in for it.
    assert all(config._read(f) for f in config.VARIABLES if f != field)
    with config.configured(**{field: getattr(config.Settings(), field)}) as settings:
        assert settings == config.Settings()


def test_two_invalid_variables_are_both_named(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("QCOMM_TRANSPORT", "nccl")
    clean.setenv("QCOMM_VERIFY", "yes")
    with pytest.raises(ValueError, match="QCOMM_TRANSPORT: .*; QCOMM_VERIFY: "):
        config.get()


@pytest.mark.parametrize(
    "fields, error, words",
    [
        ({"transport": "nccl"}, ValueError, "transport: expected 'auto', 'point_to_point'"),
        ({"transport": None}, ValueError, "transport: expected"),
        ({"verify": "1"}, ValueError, "verify: expected 'first', 'always' or 'never'"),
        ({"ranks_per_host": 0}, ValueError, "ranks_per_host: expected a positive int"),
        ({"ranks_per_host": "2"}, ValueError, "ranks_per_host: expected a positive int"),
        ({"ranks_per_host": True}, ValueError, "ranks_per_host: expected a positive int"),
        ({"torchrec_collectives": "nccl"}, ValueError, "torchrec_collectives: expected"),
        ({"exit_timeout": -1}, ValueError, "exit_timeout: expected a finite number"),
        ({"exit_timeout": float("inf")}, ValueError, "exit_timeout: expected a finite"),
        ({"exit_timeout": "5"}, ValueError, "exit_timeout: expected a finite number"),
        ({"plugins": ["qcomm"]}, TypeError, "plugins: expected a str, got list"),
        ({"codecs": None}, TypeError, "codecs: expected a str, got NoneType"),
        ({"trasnport": "auto"}, TypeError, "unknown field.*'trasnport'.*fields: transport"),
    ],
)
def test_a_bad_field_is_named_and_nothing_is_set(
    clean: pytest.MonkeyPatch, fields: dict[str, Any], error: type[Exception], words: str
) -> None:
    before = config.get()
    beside = {"plugins": "qcomm"} if "codecs" in fields else {"codecs": "fp16"}
    for set_fields in (config.configure, config.configured):
        with pytest.raises(error, match=words):
            # With a good field beside it: that one is not set either.
            set_fields(**{**beside, **fields})  # type: ignore[operator]
        assert config.get() == before


def test_configured_sets_and_restores(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("QCOMM_VERIFY", "1")
    with config.configured(verify="never", exit_timeout=3) as settings:
        assert settings.verify == "never" and settings.exit_timeout == 3.0
        assert config._read("verify") == ("never", "qcomm.config.verify")
        with config.configured(verify="first"):
            assert config.get().verify == "first"
        assert config.get().verify == "never"
        with pytest.raises(RuntimeError), config.configured(ranks_per_host=2):
            raise RuntimeError("inside")
        assert config.get().ranks_per_host is None
    # Back to the variable, and to the default where none is set.
    assert config._read("verify") == ("always", "QCOMM_VERIFY")
    assert config.get().exit_timeout == 10.0


def test_configure_holds_until_a_block_around_it_ends(clean: pytest.MonkeyPatch) -> None:
    with config.configured(codecs="fp16"):
        config.configure(codecs="bf16")
        assert config.get().codecs == "bf16"
    # The block puts back what was there before it: nothing set in code.
    assert config._read("codecs") == ("", "QCOMM_CODECS")


def test_launch_env_reads_the_launchers_variables_now(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("LOCAL_RANK", "3")
    assert config.launch_env("LOCAL_RANK") == "3"
    clean.setenv("LOCAL_RANK", "1")
    assert config.launch_env("LOCAL_RANK") == "1"
    clean.delenv("LOCAL_RANK")
    assert config.launch_env("LOCAL_RANK") is None
    with pytest.raises(ValueError, match="QCOMM_VERIFY is qcomm's setting 'verify'"):
        config.launch_env("QCOMM_VERIFY")


def test_child_env_is_this_processs_with_extra(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("QCOMM_VERIFY", "1")
    with config.configured(verify="never"):
        env = config.child_env({"RANK": "2", "QCOMM_TRANSPORT": "all_to_all"})
    assert env["RANK"] == "2" and env["QCOMM_TRANSPORT"] == "all_to_all"
    assert env["QCOMM_VERIFY"] == "1"  # what is set in code does not travel
    assert env["PATH"] == os.environ["PATH"]
    with pytest.raises(TypeError, match="child_env: extra: .*'RANK': 2"):
        config.child_env({"RANK": 2})  # type: ignore[dict-item]


# -- each setting reaches the code that obeys it (counted) -----------------------


def test_transport_reaches_the_transport(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    choice = _transport.choice
    clean.setenv("QCOMM_TRANSPORT", "point_to_point")
    assert _reading(reads, "transport", choice) == "point_to_point"
    with config.configured(transport="all_to_all"):
        assert _reading(reads, "transport", choice) == "all_to_all"
    with config.configured(transport="auto"):
        assert _reading(reads, "transport", choice) is None


def test_verify_reaches_the_agreement(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    clean.setenv("QCOMM_VERIFY", "0")
    assert _reading(reads, "verify", _agreement.mode) == "never"
    with config.configured(verify="always"):
        assert _reading(reads, "verify", _agreement.mode) == "always"


def test_ranks_per_host_reaches_the_hosts(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    def hosts() -> Any:
        return _hosts.ranks_per_host(None)

    clean.setenv("LOCAL_WORLD_SIZE", "4")
    assert _reading(reads, "ranks_per_host", hosts) == (4, "LOCAL_WORLD_SIZE")
    with config.configured(ranks_per_host=2):
        assert _reading(reads, "ranks_per_host", hosts) == (2, "qcomm.config.ranks_per_host")
    with config.configured(ranks_per_host=None):
        assert _reading(reads, "ranks_per_host", hosts) == (None, "host names")


def test_torchrec_collectives_reaches_the_door(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    clean.setenv("QCOMM_TORCHREC_COLLECTIVES", "torchrec")
    assert not _reading(reads, "torchrec_collectives", torchrec_exchange.enabled)
    with config.configured(torchrec_collectives="qcomm"):
        assert _reading(reads, "torchrec_collectives", torchrec_exchange.enabled)


def test_exit_timeout_reaches_the_exit(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    clean.setenv("QCOMM_EXIT_TIMEOUT", "2.5")
    assert _reading(reads, "exit_timeout", _background.exit_timeout) == 2.5
    with config.configured(exit_timeout=0):
        assert _reading(reads, "exit_timeout", _background.exit_timeout) == 0.0


def test_plugins_reach_discovery(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    every = _reading(reads, "plugins", qcomm.available_codecs)
    with config.configured(plugins="no-such-dist"):
        with pytest.raises(CodecError, match=r"^qcomm.config.plugins='no-such-dist': "):
            _reading(reads, "plugins", qcomm.available_codecs)
    clean.setenv("QCOMM_PLUGINS", "no-such-dist")
    with pytest.raises(CodecError, match=r"^QCOMM_PLUGINS='no-such-dist': "):
        _reading(reads, "plugins", lambda: qcomm.load_codec("fp16"))
    with config.configured(plugins="qcomm"):  # the example plugin's codecs left out
        kept = _reading(reads, "plugins", qcomm.available_codecs)
    assert "fp16" in kept and "example_fp16_scaled" in set(every) - set(kept)


def test_codecs_reach_the_registry(
    clean: pytest.MonkeyPatch, reads: collections.Counter[str]
) -> None:
    build = qcomm.build_registry
    assert _reading(reads, "codecs", build) == {}
    clean.setenv("QCOMM_CODECS", "fp16")
    kinds = {type(p.forward).__name__ for p in _reading(reads, "codecs", build).values()}
    assert kinds == {"FP16Codec"}
    with config.configured(codecs="pooled_embeddings_all_to_all=bf16"):
        registry = _reading(reads, "codecs", build)
    assert list(registry) == ["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert type(registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].backward).__name__ == "BF16Codec"
    with config.configured(codecs="pooled_embeddings_all_to_all=int9"):
        with pytest.raises(CodecError, match=r"^qcomm.config.codecs\[POOLED"):
            _reading(reads, "codecs", build)


# -- in spawned ranks: each reads its own environment, once ----------------------


def _read_once_in_a_rank(rank: int, world: int, transport: str) -> dict[str, Any]:
    environment_reads: list[int] = []
    read_environment = config._read_environment

    def counting() -> Any:
        environment_reads.append(1)
        return read_environment()

    config._read_environment = counting  # type: ignore[assignment]
    config._reread()
    x = torch.full((2 * world, 3), float(rank))
    before = counted("transport_opened").copy()
    for _ in range(3):
        qcomm.all_to_all_pooled(x, [2] * world, [3] * world).wait()
    opened = dict(counted("transport_opened") - before)
    # Set in code, over the environment, alike on every rank.
    other = "all_to_all" if transport == "point_to_point" else "point_to_point"
    before = counted("transport_opened").copy()
    with config.configured(transport=other):
        qcomm.all_to_all_pooled(x, [2] * world, [3] * world).wait()
    dist.barrier()
    return {
        "reads": len(environment_reads),
        "settings": config.get(),
        "opened": opened,
        "configured": dict(counted("transport_opened") - before),
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_spawned_rank_reads_its_own_environment_once(transport: str) -> None:
    classes = {"point_to_point": "PointToPoint", "all_to_all": "OneAllToAll"}
    other = "all_to_all" if transport == "point_to_point" else "point_to_point"
    env = {**transport_env(transport), "QCOMM_VERIFY": "1", "QCOMM_RANKS_PER_HOST": "1"}
    with config.configured(verify="never"):  # the launcher's own: not the ranks'
        results = run_ranks(_read_once_in_a_rank, 2, transport, env=env)
    for r in results:
        assert r["reads"] == 1, r
        assert r["settings"].transport == transport, r
        assert (r["settings"].verify, r["settings"].ranks_per_host) == ("always", 1), r
        assert r["opened"] == {classes[transport]: 3}, r
        assert r["configured"] == {classes[other]: 1}, r
