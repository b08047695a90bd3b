"""`qcomm bench --profile`: one run per transport on 2 local gloo ranks (the
pooled all-to-all, no-op and int8, a small and a large message), checked
phase by phase: every phase a call is made of was entered (its functions'
calls counted), encoding only where a codec encodes, the hand-off to the
background thread only for a large call on the point-to-point transport,
and TorchRec's call and the bare exchange timed beside it. Every function a
phase names still exists (a rename would silently empty its phase)."""

from __future__ import annotations

import json
import pathlib

import pytest
from dist_utils import TRANSPORTS

from qcomm.benchmark.command import config_from_args
from qcomm.benchmark.launch import spawn_local
from qcomm.benchmark.options import BenchConfig
from qcomm.benchmark.profile import PHASES, _target, phases_timed
from qcomm.cli import build_parser

SMALL, LARGE = 16 << 10, 4 << 20
ALWAYS = [
    "arguments",
    "call and agreement",
    "layout",
    "chunking",
    "status",
    "exchange",
    "transport",
    "waiting for peers",
    "decode and store",
    "autograd",
]


def test_every_phase_names_functions_that_exist() -> None:
    for phase, specs in PHASES.items():
        for spec in specs:
            _, _, fn = _target(spec)
            assert callable(fn) or isinstance(fn, staticmethod), f"{phase}: {spec}"
    with phases_timed() as clock:  # wraps and unwraps without a call
        assert set(clock.seconds) == set(PHASES)
    for specs in PHASES.values():
        for spec in specs:
            assert not hasattr(_target(spec)[2], "__wrapped__"), f"{spec} left wrapped"


def test_the_option_is_checked() -> None:
    parser = build_parser()
    with pytest.raises(ValueError, match="--profile"):
        config_from_args(parser.parse_args(["bench", "--profile", "--train"]))
    with pytest.raises(ValueError, match="--profile"):
        config_from_args(parser.parse_args(["bench", "--profile", "--backward"]))
    assert config_from_args(parser.parse_args(["bench", "--profile"])).profile


@pytest.fixture(scope="module", params=TRANSPORTS)
def profiled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict]:
    transport = request.param
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    config = BenchConfig(
        profile=True,
        codecs=["noop", "int8"],
        sizes=[SMALL, LARGE],
        ops=["pooled_embeddings_all_to_all"],
        rounds=1,
        budget=0.02,
        json_path=str(path),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QCOMM_TRANSPORT", transport)
        assert spawn_local(config) == 0
    return transport, json.loads(pathlib.Path(path).read_text())


def test_every_phase_of_a_call_is_entered(profiled: tuple[str, dict]) -> None:
    transport, report = profiled
    assert report["transport"] == transport and report["world_size"] == 2
    for rank in report["ranks"]:
        assert {(p["codec"], p["size_bytes"]) for p in rank} == {
            (codec, size) for codec in ("noop", "int8") for size in (SMALL, LARGE)
        }
        for p in rank:
            where = f"{p['codec']} at {p['size_bytes']} on {transport}"
            for phase in ALWAYS:
                assert p["calls"][phase] >= 1, f"{where}: {phase} never entered"
            assert (p["calls"]["encode"] > 0) == (p["codec"] == "int8"), where
            # A call that encodes is timed measuring its errors and not; the
            # profiled calls run as the settings stand (a plain codec: not).
            measures = p["codec"] == "int8"
            assert p["calls"]["error measurement"] == 0, where
            assert (p["unmeasured_s"] is not None) == measures, where
            assert len(p["measuring"]) == (1 if measures else 0), where
            handed = transport == "point_to_point" and p["size_bytes"] == LARGE
            assert (p["calls"]["background hand-off"] > 0) == handed, where
            assert p["call_s"] > 0 and p["profiled_s"] > 0, where
            assert p["torchrec_s"] is not None and p["bare_s"] is not None, where
            # The phases account for the call: what none claims is a small rest.
            assert p["phases_s"]["other"] < 0.5 * p["profiled_s"], where
