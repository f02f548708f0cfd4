"""The torchft peer's start barrier (benchmarks/peers/torchft_peer.py, `_start_barrier`): a first
incarnation waits until every replica's Manager is up; a restarted one passes at once."""

import threading
import time

import pytest

from benchmarks.peers import torchft_peer
from benchmarks.peers.torchft_peer import _start_barrier
from tests.fakes.clock import FakeClock


def test_the_first_replica_up_waits_for_the_last_and_a_restarted_one_passes_at_once(tmp_path, monkeypatch):
    passed: dict[str, float] = {}

    def start(replica: str) -> None:
        _start_barrier(tmp_path, replica, 3, timeout_s=10, heartbeat_s=0.01)
        passed[replica] = time.monotonic()

    early = [threading.Thread(target=start, args=(r,)) for r in ("r0", "r1")]
    for t in early:
        t.start()
    time.sleep(0.3)
    assert not passed, "two of three replicas up: nobody may start"
    last_up = time.monotonic()
    start("r2")
    for t in early:
        t.join(5)
    assert set(passed) == {"r0", "r1", "r2"} and min(passed.values()) >= last_up
    clock = FakeClock()  # the barrier's own sleeps, recorded
    monkeypatch.setattr(torchft_peer, "time", clock)
    _start_barrier(tmp_path, "r1", 3, timeout_s=10, heartbeat_s=0.01)  # its restart: every file is there
    assert clock.sleeps == [2 * 0.01], "a restart never polls for the others: only its two heartbeats"


def test_a_replica_that_never_comes_up_is_a_timeout_naming_who_did(tmp_path):
    with pytest.raises(TimeoutError, match=r"r0: only \['r0'\] of 2 replicas started within 0.2 s"):
        _start_barrier(tmp_path, "r0", 2, timeout_s=0.2, heartbeat_s=0.01)
