"""Real gloo process groups for unit tests: spawn one process per rank around a local TCPStore,
collect each rank's report, and fail with the rank's traceback (or the ranks that never reported)
instead of hanging. A worker is `worker(rank, store_port, results)` and puts one dict with
"rank" (and "exception" on failure) into `results`.

Ranks start from a fork server that has imported torch and hsgd's trainer once per test session:
a spawned interpreter per rank paid that import (seconds of CPU on two cores) in every world."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta

PRELOAD = ["torch", "torch.distributed", "hsgd.train.trainer"]


def _rank_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first world of the session
    return ctx


def run_ranks(
    worker, world_size: int, *, timeout_s: float, store_timeout_s: float = 30.0, join_s: float = 5.0
) -> dict[int, dict]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=store_timeout_s))
    ctx = _rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, store.port, results), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(outs) < world_size and time.monotonic() < deadline:
            try:
                o = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 — queue.Empty: a worker is stuck; fail below
                break
            outs[o["rank"]] = o
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    del store
    for o in outs.values():
        assert "exception" not in o, f"worker {o['rank']} failed:\n{o['exception']}"
    missing = set(range(world_size)) - set(outs)
    assert not missing, f"workers that never reported (hang?): {sorted(missing)}"
    return outs


def level_group(level: str, port: int | None, prefix: str, rank: int, size: int, *, timeout_s: float = 30, **kw):
    """A rank's gloo LevelGroup configured in epoch 1 at the world's store (`port`; None: a group of
    itself, no store). `kw`: LevelGroup's other options (configure_timeout_s 60 unless given, link)."""
    from hsgd.train.comm import LevelGroup

    group = LevelGroup(level, "gloo", timeout_s=timeout_s, **{"configure_timeout_s": 60, **kw})
    group.configure(None if port is None else f"127.0.0.1:{port}", prefix, rank=rank, world_size=size, epoch=1)
    return group
