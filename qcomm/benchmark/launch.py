r"""
Where the ranks of ``qcomm bench`` come from, and the watchdog that keeps a
run from hanging.

Under a launcher (``torchrun``) this process is one rank
(:func:`run_distributed`). Without one, :func:`spawn_local` starts
``world_size`` local gloo ranks with the environment a launcher would give,
and ends the whole run at once when a rank crashes or is stuck: a rank
writes a heartbeat file naming its step, and one silent for twice the
timeout plus a minute is taken as stuck.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from qcomm import config as qcomm_config
from qcomm.benchmark.children import PARENT_ENV, describe, end_with_parent, exit_status
from qcomm.benchmark.link import Link, LinkError, parse_rate
from qcomm.benchmark.measure import run_rank
from qcomm.benchmark.options import BenchConfig
from qcomm.benchmark.profile import run_profile
from qcomm.benchmark.session import (
    CONFIG_ENV,
    EXIT_CODEC_FAILED,
    EXIT_ERROR,
    HEARTBEAT_ENV,
    LINK_CONTROL_ENV,
    RANKS_PER_HOST_ENV,
    Session,
)
from qcomm.benchmark.train import run_train
from qcomm.benchmark.train_fsdp import run_train_fsdp
from qcomm.benchmark.train_mlp import run_train_mlp
from qcomm.config import child_env, launch_env

__all__ = ["run_distributed", "spawn_local"]


def run_distributed(config: BenchConfig, local: bool = False) -> int:
    r"""
    run_distributed(config: BenchConfig, local: bool = False) -> int

    Runs this rank's part of ``qcomm bench``; rank 0 prints and writes the report.

    Args:
        config (BenchConfig): the run's settings.
        local (bool, optional): spawned by :func:`spawn_local`. Default: ``False``.

    Returns:
        int: ``0``, :data:`~qcomm.benchmark.session.EXIT_CODEC_FAILED` (rank 0
        only) or :data:`~qcomm.benchmark.session.EXIT_ERROR` (the error is on
        this rank's stderr).
    """
    rank = launch_env("RANK") or "?"
    # Before any collective: qcomm's codecs by host follow the setting.
    per_host = {} if config.ranks_per_host is None else {"ranks_per_host": config.ranks_per_host}
    with qcomm_config.configured(**per_host):
        return _run_rank(config, local, rank)


def _run_rank(config: BenchConfig, local: bool, rank: str) -> int:
    try:
        session = Session(config, local)
    except Exception:
        print(f"qcomm bench: rank {rank}: could not join the process group:", file=sys.stderr)
        traceback.print_exc()
        return EXIT_ERROR
    try:
        if config.train:
            train = {"mlp": run_train_mlp, "fsdp": run_train_fsdp}.get(
                config.train_model, run_train
            )
            return train(config, session)
        if config.profile:
            return run_profile(config, session)
        return run_rank(config, session)
    except Exception:
        print(f"qcomm bench: rank {rank}: error:", file=sys.stderr)
        traceback.print_exc()
        return EXIT_ERROR
    finally:
        session.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").rstrip()
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def spawn_local(config: BenchConfig, poll_s: float = 0.2) -> int:
    r"""
    spawn_local(config: BenchConfig, poll_s: float = 0.2) -> int

    Runs ``qcomm bench`` on ``config.world_size`` local gloo ranks, over an
    emulated link when ``config.link`` is set (:mod:`~qcomm.benchmark.link`),
    and waits for them. Every rank is told its host's size
    (``QCOMM_RANKS_PER_HOST``: ``config.ranks_per_host``, else 1, each rank a
    host of its own, as the report's model of the link counts them). Each
    rank gets ``cpu_count / world_size`` threads unless ``OMP_NUM_THREADS``
    is set; rank 0 shares this terminal, the others' output is shown if they
    fail.

    Args:
        config (BenchConfig): the run's settings.
        poll_s (float, optional): seconds between checks on the ranks. Default: ``0.2``.

    Returns:
        int: ``0`` when every codec ran, ``1`` when the run completed but a
        qcomm codec failed, ``2`` when it did not complete or the link could
        not be built.
    """
    if config.link is None:
        return _spawn(config, poll_s, None)
    try:
        per_host = config.ranks_per_host or 1
        with Link(config.world_size, parse_rate(config.link), per_host) as link:
            return _spawn(config, poll_s, link)
    except LinkError as err:
        print(f"qcomm bench: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"qcomm bench: {describe(err)}", file=sys.stderr)
        return exit_status(err)


def _spawn(config: BenchConfig, poll_s: float, link: Link | None) -> int:
    world_size = config.world_size
    stuck_after = 2 * config.timeout + 60
    threads = launch_env("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world_size))
    with tempfile.TemporaryDirectory(prefix="qcomm-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        base_env = {
            CONFIG_ENV: config.to_json(),
            "MASTER_ADDR": "127.0.0.1" if link is None else link.address(0),
            # A fresh namespace has every port free.
            "MASTER_PORT": str(_free_port()) if link is None else "29500",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": threads,
            # Over any value of this shell's: the link's namespaces follow this one.
            RANKS_PER_HOST_ENV: str(config.ranks_per_host or 1),
            PARENT_ENV: str(os.getpid()),
        }
        control = workdir / "link-request"
        if link is not None:
            base_env["GLOO_SOCKET_IFNAME"] = link.interface
            base_env[LINK_CONTROL_ENV] = str(control)
        procs: list[subprocess.Popen[bytes]] = []
        logs = [workdir / f"rank{r}.log" for r in range(world_size)]
        beats = [workdir / f"rank{r}.step" for r in range(world_size)]
        try:
            for rank in range(world_size):
                env = {
                    **child_env(base_env),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    HEARTBEAT_ENV: str(beats[rank]),
                }
                argv = [sys.executable, "-m", "qcomm.benchmark.launch"]
                with open(logs[rank], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            argv if link is None else link.command(rank, argv),
                            env=env,
                            stdout=None if rank == 0 else log,
                            stderr=None if rank == 0 else log,
                        )
                    )
            problem = _watch(procs, beats, stuck_after, poll_s, _link_requests(link, control))
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM/SIGHUP under the CLI
            _stop(procs)
            print(f"qcomm bench: {describe(err)}", file=sys.stderr)
            return exit_status(err)
        if problem is not None:
            rank, message = problem
            _stop(procs)
            print(f"qcomm bench: {message}; the run was stopped", file=sys.stderr)
            tail = _tail(logs[rank]) if rank != 0 else ""
            if tail:
                print(f"--- end of rank {rank}'s output ---\n{tail}", file=sys.stderr)
            return 2
        codes = [proc.returncode for proc in procs]
        return 1 if EXIT_CODEC_FAILED in codes else 0


def _link_requests(link: Link | None, control: pathlib.Path) -> Callable[[], None]:
    # Carries out rank 0's requests to lift or restore the rate limit.
    def serve() -> None:
        if link is None or not control.exists():
            return
        link.set_shaping(control.read_text().strip() == "on")
        control.unlink()

    return serve


def _watch(
    procs: list[subprocess.Popen[bytes]],
    beats: list[pathlib.Path],
    stuck_after: float,
    poll_s: float,
    serve: Callable[[], None] = lambda: None,
) -> tuple[int, str] | None:
    # Heartbeat files are compared by age, on the wall clock their mtime uses.
    wall_start = time.time()
    while True:
        serve()
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0, EXIT_CODEC_FAILED):
                return rank, f"rank {rank} {_describe_exit(code)}"
        if all(code is not None for code in codes):
            return None
        now = time.time()
        for rank, (code, beat) in enumerate(zip(codes, beats)):
            if code is not None:
                continue
            try:
                last, step = beat.stat().st_mtime, beat.read_text()
            except OSError:
                last, step = wall_start, "starting up"
            if now - last > stuck_after:
                return rank, (
                    f"rank {rank} made no progress for {now - last:.0f} s "
                    f"(limit {stuck_after:.0f} s, from --timeout) at step: {step}"
                )
        time.sleep(poll_s)


def _child_main() -> int:
    parent = launch_env(PARENT_ENV)
    if parent:
        end_with_parent(int(parent))
    config = BenchConfig.from_json(launch_env(CONFIG_ENV) or "")
    return run_distributed(config, local=True)


if __name__ == "__main__":
    status = _child_main()
    # Results are reported: skip the interpreter's teardown, in which the
    # TorchRec/fbgemm stack can abort after the work is done, which would
    # turn a finished rank into a crashed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
