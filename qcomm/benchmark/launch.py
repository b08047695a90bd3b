r"""
Where the ranks of ``qcomm bench`` come from, and how a run is kept from
hanging.

Under a launcher (``torchrun``: ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``
set) this process is one rank: NCCL on its CUDA device when there is one,
gloo on the CPU otherwise. Without one, :func:`spawn_local` starts
``world_size`` processes on this machine with the same environment a
launcher would give (gloo, CPU, a free localhost port), and watches them:

- a collective waits at most ``timeout`` seconds for its peers (the process
  groups' timeout), so a rank that stops answering ends in an error, not a hang;
- every rank writes a heartbeat file naming its current step; a rank silent
  for longer than twice the timeout plus a minute is taken as stuck;
- a rank that crashes or is stuck ends the whole run at once, with the rank,
  its step and the end of its error output.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qcomm.benchmark.link import Link, LinkError, parse_rate
from qcomm.benchmark.options import BenchConfig

__all__ = [
    "EXIT_CODEC_FAILED",
    "EXIT_ERROR",
    "Session",
    "launcher_env",
    "run_distributed",
    "spawn_local",
]

#: exit status of a run that could not complete (a rank crashed or hung)
EXIT_ERROR = 2
#: exit status of a run that completed, but where a qcomm codec failed somewhere
EXIT_CODEC_FAILED = 3

_CONFIG_ENV = "QCOMM_BENCH_CONFIG"
_HEARTBEAT_ENV = "QCOMM_BENCH_HEARTBEAT"
# Where rank 0 asks the local launcher to lift or restore the emulated
# link's rate limit (a file it writes), and the launcher answers (one it
# removes once done).
_LINK_ENV = "QCOMM_BENCH_LINK_CONTROL"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def launcher_env() -> bool:
    r"""
    launcher_env() -> bool

    Whether a launcher such as ``torchrun`` started this process as one rank.

    Returns:
        bool: ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are all set.
    """
    return all(os.environ.get(name) for name in _LAUNCHER_VARS)


class Session:
    r"""
    This rank's part of a run: its device and process groups.

    Collectives are measured on :attr:`work`; the ranks agree on what
    happened (timings, failures) over :attr:`control`, a separate gloo group
    with a longer timeout, so that a rank that gave up on a collective can
    still tell the others. After a failed collective :meth:`renew_work`
    replaces :attr:`work`, whose ranks may no longer be in step.

    Args:
        config (BenchConfig): the run's settings (its ``timeout``).
        local (bool): spawned by :func:`spawn_local`: always gloo on the CPU.
    """

    def __init__(self, config: BenchConfig, local: bool) -> None:
        #: spawned by spawn_local (the link is loopback or emulated), not a launcher
        self.local = local
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        if not local and torch.cuda.is_available():
            self.backend = "nccl"
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        else:
            self.backend = "gloo"
            self.device = torch.device("cpu")
        self._timeout = datetime.timedelta(seconds=config.timeout)
        self._heartbeat = os.environ.get(_HEARTBEAT_ENV)
        self._link_control = os.environ.get(_LINK_ENV)
        long_timeout = 3 * self._timeout
        dist.init_process_group(
            self.backend, rank=self.rank, world_size=self.world_size, timeout=long_timeout
        )
        #: gloo group for the ranks' bookkeeping, with a long timeout
        self.control: Any = dist.new_group(backend="gloo", timeout=long_timeout)
        #: group the measured collectives run on; renewed after a failure
        self.work: Any = None
        self.renew_work()

    def gather(self, obj: Any) -> list[Any]:
        r"""
        gather(obj: Any) -> list[Any]

        Every rank's ``obj``, in rank order, on every rank (over :attr:`control`).

        Args:
            obj (Any): a picklable object.

        Returns:
            list[Any]: one object per rank.
        """
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def renew_work(self) -> None:
        r"""
        renew_work() -> None

        Replaces :attr:`work` by a fresh group; every rank must call it.
        """
        self.work = dist.new_group(backend=self.backend, timeout=self._timeout)
        # NCCL connects on a group's first collective: do it here, not in the
        # warm-up call that sizes the first measurement.
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.work)

    def beat(self, step: str) -> None:
        r"""
        beat(step: str) -> None

        Tells the local launcher's watchdog that this rank is alive at ``step``.

        Args:
            step (str): what the rank is doing now.
        """
        if self._heartbeat:
            pathlib.Path(self._heartbeat).write_text(step)

    @property
    def link_control(self) -> bool:
        r"""
        link_control() -> bool

        Whether this run's link is emulated and :meth:`set_shaping` works.
        """
        return self._link_control is not None

    def set_shaping(self, on: bool) -> None:
        r"""
        set_shaping(on: bool) -> None

        Lifts (``on=False``) or restores the emulated link's rate limit;
        every rank must call it. Rank 0 asks the launcher and waits for it.

        Args:
            on (bool): whether the link is shaped to its rate.

        Raises:
            RuntimeError: if the launcher does not answer within the timeout.
        """
        if self._link_control is None:
            raise RuntimeError("set_shaping: this run has no emulated link")
        if self.rank == 0:
            request = pathlib.Path(self._link_control)
            ready = request.with_suffix(".new")
            ready.write_text("on" if on else "off")
            os.replace(ready, request)  # the launcher never reads half a request
            deadline = time.monotonic() + self._timeout.total_seconds()
            while request.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the launcher did not change the link's shaping")
                time.sleep(0.05)
        self.gather(None)

    def close(self) -> None:
        r"""
        close() -> None

        Tears the process groups down.
        """
        dist.destroy_process_group()


def run_distributed(config: BenchConfig, local: bool = False) -> int:
    r"""
    run_distributed(config: BenchConfig, local: bool = False) -> int

    Runs this rank's part of ``qcomm bench``; rank 0 prints and writes the report.

    Args:
        config (BenchConfig): the run's settings.
        local (bool, optional): spawned by :func:`spawn_local`. Default: ``False``.

    Returns:
        int: ``0``, :data:`EXIT_CODEC_FAILED` (rank 0 only) or
        :data:`EXIT_ERROR` (the error is printed on this rank's stderr).
    """
    from qcomm.benchmark.runner import run_rank

    rank = os.environ.get("RANK", "?")
    try:
        session = Session(config, local)
    except Exception:
        print(f"qcomm bench: rank {rank}: could not join the process group:", file=sys.stderr)
        traceback.print_exc()
        return EXIT_ERROR
    try:
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

    Runs ``qcomm bench`` on ``config.world_size`` local gloo ranks and waits
    for them, ending the run if a rank crashes or gets stuck. With
    ``config.link`` the ranks run in network namespaces joined by an emulated
    link of that rate (:mod:`qcomm.benchmark.link`), removed when the run ends.

    Each rank gets ``cpu_count / world_size`` threads (unless
    ``OMP_NUM_THREADS`` is set), so that the ranks do not fight over cores.
    Rank 0 shares this process's terminal (progress bar, table); the others'
    output is kept and shown if they fail.

    Args:
        config (BenchConfig): the run's settings.
        poll_s (float, optional): how often to check on the ranks, seconds.
            Default: ``0.2``.

    Returns:
        int: ``0`` when every codec ran, ``1`` when the run completed but a
        qcomm codec failed, ``2`` when the run did not complete or the link
        could not be built.
    """
    if config.link is None:
        return _spawn(config, poll_s, None)
    try:
        with Link(config.world_size, parse_rate(config.link)) as link:
            return _spawn(config, poll_s, link)
    except LinkError as err:
        print(f"qcomm bench: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qcomm bench: interrupted", file=sys.stderr)
        return 130


def _spawn(config: BenchConfig, poll_s: float, link: Link | None) -> int:
    world_size = config.world_size
    stuck_after = 2 * config.timeout + 60
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world_size))
    with tempfile.TemporaryDirectory(prefix="qcomm-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        base_env = {
            **os.environ,
            _CONFIG_ENV: config.to_json(),
            "MASTER_ADDR": "127.0.0.1" if link is None else link.address(0),
            # A fresh namespace has every port free.
            "MASTER_PORT": str(_free_port()) if link is None else "29500",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": threads,
        }
        control = workdir / "link-request"
        if link is not None:
            base_env["GLOO_SOCKET_IFNAME"] = link.interface
            base_env[_LINK_ENV] = str(control)
        procs: list[subprocess.Popen[bytes]] = []
        logs = [workdir / f"rank{r}.log" for r in range(world_size)]
        beats = [workdir / f"rank{r}.step" for r in range(world_size)]
        try:
            for rank in range(world_size):
                env = {
                    **base_env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    _HEARTBEAT_ENV: str(beats[rank]),
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
        except KeyboardInterrupt:
            _stop(procs)
            print("qcomm bench: interrupted", file=sys.stderr)
            return 130
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
    config = BenchConfig.from_json(os.environ[_CONFIG_ENV])
    return run_distributed(config, local=True)


if __name__ == "__main__":
    status = _child_main()
    # Results are reported: skip the interpreter's teardown, in which the
    # TorchRec/fbgemm stack can abort after the work is done, which would
    # turn a finished rank into a crashed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
