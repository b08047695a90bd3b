r"""
What a report of ``qcomm bench`` says of its run (the JSON's ``meta``):
versions, host, clock, ranks, the machine's load, and the run's settings.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch

import qcomm
from qcomm.benchmark.options import BenchConfig
from qcomm.benchmark.results import BenchMeta
from qcomm.benchmark.session import Session

__all__ = ["bench_meta", "cpu_model", "load", "run_meta"]


def cpu_model() -> str:
    r"""
    cpu_model() -> str

    The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> list[float] | None:
    r"""
    load() -> list[float] | None

    The 1, 5 and 15 minute load averages, how busy the machine was; ``None``
    where the system does not say.
    """
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def run_meta(session: Session, started: float, duration: float) -> dict[str, Any]:
    r"""
    run_meta(session: Session, started: float, duration: float) -> dict[str, Any]

    What every report's ``meta`` says of the run: versions, host, clock, ranks.

    Args:
        session (Session): this rank's device and process groups.
        started (float): when the run started (``time.time()``).
        duration (float): how long it took, in seconds.

    Returns:
        dict[str, Any]: the fields, JSON-ready.
    """
    return {
        "qcomm_version": qcomm.__version__,
        "torch_version": torch.__version__,
        "fbgemm_gpu_version": _version("fbgemm-gpu") or _version("fbgemm-gpu-cpu"),
        "torchrec_version": _version("torchrec"),
        "python": platform.python_version(),
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": duration,
        "backend": session.backend,
        "device": str(session.device),
        "world_size": session.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "local": session.local,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
    }


def bench_meta(config: BenchConfig, session: Session, started: float, duration: float) -> BenchMeta:
    r"""
    bench_meta(config: BenchConfig, session: Session, started: float, duration: float) -> BenchMeta

    The ``meta`` of a run of the codecs and collectives: :func:`run_meta` and
    the run's settings.

    Args:
        config (BenchConfig): the run's settings.
        session (Session): this rank's device and process groups.
        started (float): when the run started (``time.time()``).
        duration (float): how long it took, in seconds.
    """
    return BenchMeta(
        **run_meta(session, started, duration),
        quick=config.quick,
        sizes=config.sizes,
        ops=config.ops,
        dim=config.dim,
        codec_elements=max(1, config.codec_bytes // 4),
        budget_s=config.budget,
        rounds=config.rounds,
        timeout_s=config.timeout,
        link=config.link,
        ranks_per_host=config.ranks_per_host,
        backward=config.backward,
        chunk_bytes=config.chunk_bytes,
        link_gbps=config.link_gbps,
        data_scale=config.data_scale,
        command=config.command,
    )
