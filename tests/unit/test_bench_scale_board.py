"""benchmarks/scale.py part 3's `BoardWriter` (the light replicas' progress publishers, in one process)
writes what a replica's Publisher writes, `round,step,pid` with each light actor's own pid: the
runner's board read keeps a value only from the process the roster knows for that replica."""

import time

from benchmarks.scale import BoardWriter
from hsgd.train.comm import new_run_secret, rendezvous_address, start_store
from hsgd.train.progress_board import Board


def test_the_bench_board_writer_publishes_each_light_actors_pid_as_the_publisher_does():
    writer = BoardWriter.__ray_actor_class__()  # the class itself, in this process (no Ray)
    store = start_store("127.0.0.1", 5.0)
    addr = rendezvous_address("127.0.0.1", store.port, new_run_secret())
    board = Board(store, addr)
    assert board.reset(["c0r0", "c0r1"])
    writer.connect(addr, ["c0r0", "c0r1"])
    pids = {"c0r0": 4101, "c0r1": 4102}
    writer.start(addr, 2, pids, 10, 1.0, interval_s=0.2)
    deadline = time.monotonic() + 5.0
    while len(got := board.read(["c0r0", "c0r1"]) or {}) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {rid: (r, pid) for rid, (r, _, pid) in got.items()} == {"c0r0": (2, 4101), "c0r1": (2, 4102)}, (
        f"each replica's value must carry its own actor's pid (the runner drops others): {got}"
    )
    assert all(20 <= step < 30 for _, step, _ in got.values()), f"round 2's steps: {got}"
    assert writer.written() > 0
