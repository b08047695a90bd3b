"""The multi-rank helper itself (``dist_utils``): a rank that fails or dies is
reported with its traceback, nothing hangs, and a case's transports are
checked against the one its spawn forced."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from dist_utils import RankFailure, run_ranks, wrong_transport


def raise_on_rank_zero(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError(f"rank zero gives up ({os.environ.get('QCOMM_TEST_MARK')})")
    dist.barrier()  # waits for rank 0, which never comes


def exit_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)


def test_run_ranks_reports_the_failing_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(
            raise_on_rank_zero, 2, timeout=60.0, grace=1.0, env={"QCOMM_TEST_MARK": "env set"}
        )
    assert "rank zero gives up (env set)" in info.value.tracebacks[0]
    assert isinstance(info.value.exceptions[0], ValueError)


def test_run_ranks_reports_a_rank_that_dies() -> None:
    with pytest.raises(RankFailure, match="rank 1 exited with code 3"):
        run_ranks(exit_on_rank_one, 2, timeout=60.0)


def test_run_ranks_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        run_ranks(sleep_forever, 2, timeout=5.0)


def test_wrong_transport_names_what_each_rank_opened() -> None:
    assert wrong_transport([{"OneAllToAll": 3}, {"OneAllToAll": 1}], "all_to_all") is None
    assert wrong_transport([{"PointToPoint": 2}] * 2, "point_to_point") is None
    for opened, said in (
        ([{"OneAllToAll": 3}, {"PointToPoint": 3}], "rank 1 opened {'PointToPoint': 3}"),
        ([{"OneAllToAll": 3, "PointToPoint": 1}], "rank 0 opened {'OneAllToAll': 3, 'Point"),
        ([{"OneAllToAll": 3}, {}], "rank 1 opened no transport"),
    ):
        problem = wrong_transport(opened, "all_to_all")
        assert problem is not None and said in problem, problem
        assert "expected only OneAllToAll (QCOMM_TRANSPORT=all_to_all)" in problem
