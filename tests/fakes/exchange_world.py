"""An outer exchange among N holders in one process, one thread each, over benchmarks.outer_sweep's
in-process group (it counts bytes as hsgd.train.comm.LevelGroup does): for the tests of
hsgd.train.exchange that need no real process group."""

from __future__ import annotations

import threading
from collections.abc import Callable

from benchmarks.outer_sweep import ThreadGroup


def run_holders(work: Callable[[int, ThreadGroup.Rank], object], world: int, timeout_s: float = 120.0):
    """work(rank, group rank) on `world` threads at once; (their results in rank order, their group
    ranks: bytes_sent / bytes_received). The first error is raised here, the others released."""
    group = ThreadGroup(world)
    ranks = [ThreadGroup.Rank(group, k) for k in range(world)]
    results: list = [None] * world
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = work(k, ranks[k])
        except BaseException as err:  # noqa: BLE001 — raised in the caller's thread
            errors.append(err)
            group._barrier.abort()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout_s)
    if errors:
        raise errors[0]
    assert not any(th.is_alive() for th in threads), "a holder never finished its exchange"
    return results, ranks
