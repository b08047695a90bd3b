"""One rank of a script that exits with qcomm calls in flight (run by test_exit.py).

    python exit_script.py RANK WORLD FORM STORE

Issues four int8 pooled all-to-alls of 4 MiB and waits for none, then ends
as FORM says: ``exit`` (``sys.exit(0)``), ``destroy``
(``dist.destroy_process_group()``, then ``sys.exit(0)``), ``drop`` (the
awaitables dropped and collected, then ``sys.exit(0)``) or ``hung`` (rank 1
issues only three calls and then sleeps until it is killed: rank 0's last
call never completes). An exit hook registered before qcomm is imported runs
after qcomm's own and prints what the background thread did, one line
starting with ``qcomm-exit``.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import gc
import sys
import threading
import time

from qcomm import _events  # loads no torch, registers no exit hook

# What the background thread did, counted from the start (qcomm keeps no count).
_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()  # events come from the background thread too


def _count(event: str, detail: str) -> None:
    with _lock:
        _counts[event] += 1


_events.listen(_count)


def _report() -> None:
    from qcomm.collectives import _background

    thread = _background._thread
    stopped = thread is None or not thread.is_alive()
    completed, dropped = _counts["background_completed"], _counts["background_dropped"]
    print(f"qcomm-exit completed={completed} dropped={dropped} stopped={stopped}")


# Before qcomm's: exit hooks run last registered first.
atexit.register(_report)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import qcomm  # noqa: E402

rank, world, form, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group(
    "gloo",
    store=dist.FileStore(store, world),
    rank=rank,
    world_size=world,
    timeout=datetime.timedelta(seconds=60),
)
codecs = qcomm.QuantizedCommCodecs(qcomm.load_codec("int8"), qcomm.load_codec("int8"))
rows = cols = 1024  # 4 MiB of float32
calls = []
for i in range(4):
    if form == "hung" and rank == 1 and i == 3:
        time.sleep(600)
    x = torch.randn(rows, cols)
    calls.append(qcomm.all_to_all_pooled(x, [rows // world] * world, [cols] * world, codecs=codecs))
if form == "destroy":
    dist.destroy_process_group()
elif form == "drop":
    del calls
    gc.collect()
sys.exit(0)
