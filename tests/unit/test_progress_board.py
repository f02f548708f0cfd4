"""issue 36, Build 1: replicas push their steps to the run's store; the supervisor reads them all with
one round trip (hsgd/train/progress_board.py), and nothing waits on a store that is gone."""

import os
import threading
import time

from hsgd.train.comm import new_run_secret, rendezvous_address, start_store
from hsgd.train.progress_board import Board, Publisher


def _until(probe, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.02)
    return probe()


def test_published_steps_are_read_in_one_round_trip_and_cleared_at_a_round_start():
    store = start_store("127.0.0.1", 5.0)
    addr = rendezvous_address("127.0.0.1", store.port, new_run_secret())
    board = Board(store, addr)
    assert board.read(["c0r0"]) is None, "a key never cleared is never read (a multi_get would wait for it)"
    assert board.reset(["c0r0", "c0r1", "c1r0"])
    assert board.read(["c0r0", "c0r1"]) == {}, "nothing published since the reset: no observation"
    pubs = {rid: Publisher(rid, interval_s=0.05) for rid in ("c0r0", "c0r1")}
    for i, pub in enumerate(pubs.values()):
        pub.address(addr)
        pub.publish(3, 60 + i)
    got = _until(lambda: (r := board.read(["c0r0", "c0r1", "c1r0"])) and len(r) == 2 and r)
    me = os.getpid()  # the process that wrote it: a dead one's value is told apart from its successor's
    assert got == {"c0r0": (3, 60, me), "c0r1": (3, 61, me)}
    pubs["c0r0"].publish(3, 65)
    assert _until(lambda: board.read(["c0r0"]) == {"c0r0": (3, 65, me)})
    assert board.reset(["c0r0", "c0r1", "c1r0"]) and board.read(["c0r0", "c0r1"]) == {}, (
        "a new round: stale values gone"
    )
    pubs["c0r0"].address(addr)  # the next run_inner call: the current value is written again
    assert _until(lambda: board.read(["c0r0"]) == {"c0r0": (3, 65, me)})


def test_another_runs_store_or_secret_is_not_read():
    store = start_store("127.0.0.1", 5.0)
    ours = rendezvous_address("127.0.0.1", store.port, new_run_secret())
    theirs = rendezvous_address("127.0.0.1", store.port, new_run_secret())
    board = Board(store, ours)
    board.reset(["c0r0"])
    pub = Publisher("c0r0", interval_s=0.05)
    pub.address(theirs)
    pub.publish(0, 5)
    time.sleep(0.3)
    assert board.read(["c0r0"]) == {}, "keys live under the run's secret"


def test_the_training_thread_never_waits_on_a_store_that_is_gone(monkeypatch):
    from torchft import process_group

    reached: list[threading.Thread] = []  # the threads that went to a store
    connect = process_group.create_store_client

    def recorded(*args, **kwargs):
        reached.append(threading.current_thread())
        return connect(*args, **kwargs)

    monkeypatch.setattr(process_group, "create_store_client", recorded)
    store = start_store("127.0.0.1", 5.0)
    addr = rendezvous_address("127.0.0.1", store.port, new_run_secret())
    pub = Publisher("c0r0", interval_s=0.05, timeout_s=0.5)
    pub.address(addr)
    del store  # the supervisor died: its store with it
    for step in range(1000):
        pub.publish(0, step)
    # a new supervisor's store: the next call names it, and the steps arrive there
    store2 = start_store("127.0.0.1", 5.0)
    addr2 = rendezvous_address("127.0.0.1", store2.port, new_run_secret())
    board = Board(store2, addr2)
    board.reset(["c0r0"])
    pub.address(addr2)
    pub.publish(1, 25)
    assert _until(lambda: board.read(["c0r0"]) == {"c0r0": (1, 25, os.getpid())}, timeout_s=10)
    assert reached and threading.current_thread() not in reached, "publish only records the step"
