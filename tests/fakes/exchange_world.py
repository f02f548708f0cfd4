"""An outer exchange among N holders in one process, one thread each, over benchmarks.outer_sweep's
in-process group (it counts bytes as hsgd.train.comm.LevelGroup does): for the tests of
hsgd.train.exchange that need no real process group."""

from __future__ import annotations

import threading
from collections.abc import Callable

from benchmarks.outer_sweep import ThreadGroup


class FailingRank(ThreadGroup.Rank):
    """A member whose `fail_at` collective ("all_to_all" or "all_gather") moves its bytes on every rank,
    then fails as a peer's death does (CollectiveError kind peer_gone): every rank's call raises alike."""

    def __init__(self, group: ThreadGroup, rank: int, fail_at: str):
        super().__init__(group, rank)
        self.fail_at = fail_at

    def all_to_all(self, chunks, recv_numel: int, *, level: str):
        got = super().all_to_all(chunks, recv_numel, level=level)
        return self._fail("all_to_all") or got

    def all_gather(self, payload, *, level: str):
        got = super().all_gather(payload, level=level)
        return self._fail("all_gather") or got

    def _fail(self, op: str) -> None:
        from hsgd.train.comm import CollectiveError

        if op == self.fail_at:
            raise CollectiveError(f"outer: {op} failed on the fake group: connection closed by peer", "peer_gone")


def run_holders(
    work: Callable[[int, ThreadGroup.Rank], object], world: int, timeout_s: float = 120.0, fail_at: str | None = None
):
    """work(rank, group rank) on `world` threads at once; (their results in rank order, their group
    ranks: bytes_sent / bytes_received). The first error is raised here, the others released.
    `fail_at`: that collective fails on every rank (FailingRank)."""
    group = ThreadGroup(world)
    ranks = [ThreadGroup.Rank(group, k) if fail_at is None else FailingRank(group, k, fail_at) for k in range(world)]
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
