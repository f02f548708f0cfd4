"""No rendezvous waited out: a forming group meets in an arrival barrier in the run's store before
torchft's configure. `abort_rendezvous` (the supervisor, once it knows a member is dead) releases
every member waiting there with kind `join_aborted` and the reason, far inside configure_timeout_s;
everyone arriving — late or not — forms a working group; nobody arriving is kind `configure`; an
abort touches only its own group; an abort through a store that is gone is False, never an error.
Real TCPStores and gloo groups; the configure timeouts are long (60 s) so the only way out in time
is the abort."""

import os
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from hsgd.core.round import GroupJoin
from hsgd.train import rendezvous
from hsgd.train.comm import CollectiveError, LevelGroup
from tests.fakes.gloo_world import run_ranks

LONG_S = 60.0  # configure_timeout_s where only an abort may release a member in time
RELEASED_S = 20.0  # how long a released member may take to come back: generous, and far below LONG_S
SECRET = "5e" * 16
PREFIX = "run-x/epoch3/inner/c1"


@pytest.fixture
def store():
    master = rendezvous.start_store("127.0.0.1", timeout_s=LONG_S)
    yield master, rendezvous.rendezvous_address("127.0.0.1", master.port, SECRET)
    del master


class Member(threading.Thread):
    """One member configuring in a thread; keeps what configure raised (or None)."""

    def __init__(self, addr, prefix, rank, world_size, configure_timeout_s=LONG_S):
        super().__init__(daemon=True)
        self.args = (addr, prefix, rank, world_size)
        self.group = LevelGroup("inner", "gloo", timeout_s=5.0, configure_timeout_s=configure_timeout_s)
        self.error: BaseException | None = None
        self.start()

    def run(self):
        addr, prefix, rank, world_size = self.args
        try:
            self.group.configure(addr, prefix, rank, world_size, epoch=3)
        except BaseException as err:  # noqa: BLE001 — the test reads it
            self.error = err


def _arrived(master, addr, prefix, ranks):
    keys = torch.distributed.PrefixStore(f"{addr}/{prefix}".partition("/")[2], master)
    return keys.check([rendezvous._ARRIVED.format(rank=r) for r in ranks])


def _until(predicate, what, timeout_s=RELEASED_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.1f}s waiting for {what}"
        time.sleep(0.02)


def test_an_abort_releases_every_member_waiting_in_the_rendezvous(store):
    master, addr = store
    waiting = [Member(addr, PREFIX, rank, 3) for rank in (0, 2)]  # rank 1 died before it arrived
    _until(lambda: _arrived(master, addr, PREFIX, (0, 2)), "ranks 0 and 2 in the rendezvous")
    assert all(m.is_alive() for m in waiting), "nobody leaves before the abort: rank 1 never came"

    assert rendezvous.abort_rendezvous(master, addr, PREFIX, "c1r1 died (pid 4242)") is True
    for m in waiting:
        m.join(RELEASED_S)
        assert not m.is_alive(), "an aborted rendezvous must release its members, not keep them until the timeout"
        assert isinstance(m.error, CollectiveError) and m.error.kind == "join_aborted", repr(m.error)
        assert "c1r1 died (pid 4242)" in str(m.error) and SECRET not in str(m.error)
        with pytest.raises(CollectiveError) as info:
            m.group.allreduce_mean([torch.ones(1)], level="inner")
        assert info.value.kind == "aborted", "a group whose join was aborted stays unusable"

    late = Member(addr, PREFIX, 1, 3)  # a restarted rank 1 arriving afterwards is released too
    late.join(RELEASED_S)
    assert not late.is_alive() and getattr(late.error, "kind", None) == "join_aborted", repr(late.error)
    assert rendezvous.abort_rendezvous(master, addr, PREFIX, "again") is True, "abort is idempotent"


def test_an_abort_of_a_level_group_releases_its_shard_groups_waiting_and_late(store):
    """Replicas of k=3 ranks: rank j joins shard_prefix(PREFIX, j). The supervisor aborts PREFIX only
    (it knows replicas, not ranks): every shard group is released, even after PREFIX itself formed, and
    a shard member arriving after the abort is released as it comes."""
    master, addr = store
    formed = [Member(addr, PREFIX, rank, 2) for rank in (0, 1)]  # the replicas' rank 0s formed their group
    shard2 = Member(addr, rendezvous.shard_prefix(PREFIX, 2), 0, 2)  # rank 2 of one replica; the other's died
    _until(lambda: all(not m.is_alive() for m in formed), "the level group to form")
    assert all(m.error is None for m in formed), [repr(m.error) for m in formed]
    _until(lambda: _arrived(master, addr, rendezvous.shard_prefix(PREFIX, 2), (0,)), "rank 2's shard group waiting")
    assert rendezvous.abort_rendezvous(master, addr, PREFIX, "c1r1 died") is False, "the level group had formed"
    shard2.join(RELEASED_S)
    assert not shard2.is_alive() and getattr(shard2.error, "kind", None) == "join_aborted", repr(shard2.error)
    late = Member(addr, rendezvous.shard_prefix(PREFIX, 3), 0, 2)  # rank 3 of a replica, arriving after the abort
    late.join(RELEASED_S)
    assert not late.is_alive() and getattr(late.error, "kind", None) == "join_aborted", repr(late.error)
    assert "c1r1 died" in str(late.error)


def test_an_abort_of_one_group_leaves_another_groups_rendezvous_alone(store):
    """c1 and c10: one prefix is the start of the other, their keys still never meet."""
    master, addr = store
    other = "run-x/epoch3/inner/c10"
    aborted, untouched = Member(addr, PREFIX, 0, 2), Member(addr, other, 0, 2)
    _until(
        lambda: _arrived(master, addr, PREFIX, (0,)) and _arrived(master, addr, other, (0,)),
        "both groups' rank 0 in their rendezvous",
    )
    assert rendezvous.abort_rendezvous(master, addr, PREFIX, "c1r1 died")
    aborted.join(RELEASED_S)
    assert getattr(aborted.error, "kind", None) == "join_aborted", repr(aborted.error)
    assert untouched.is_alive(), "another group's member must keep waiting for its own peer"

    assert rendezvous.abort_rendezvous(master, addr, other, "c10r1 died") is True, "c10's rendezvous was still open"
    untouched.join(RELEASED_S)
    assert getattr(untouched.error, "kind", None) == "join_aborted" and "c10r1 died" in str(untouched.error)
    assert "c1r1" not in str(untouched.error)


def test_nobody_arriving_is_a_configure_error_naming_who_never_came(store):
    _, addr = store
    alone = Member(addr, PREFIX, 0, 3, configure_timeout_s=1.0)
    alone.join(RELEASED_S)
    assert not alone.is_alive()
    err = alone.error
    assert isinstance(err, CollectiveError) and err.kind == "configure", repr(err)
    assert "rank(s) 1, 2 of 3 did not arrive" in str(err) and SECRET not in str(err)


def test_abort_rendezvous_through_a_store_that_is_gone_is_false_not_an_error():
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from hsgd.train.rendezvous import start_store; "
            "s = start_store('127.0.0.1', 5); print(s.port, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        port = int(server.stdout.readline())
        client = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
        addr = rendezvous.rendezvous_address("127.0.0.1", port, SECRET)
        assert rendezvous.abort_rendezvous(client, addr, PREFIX, "first") is True  # the store is there
    finally:
        server.kill()
        server.wait(timeout=10)
    assert rendezvous.abort_rendezvous(client, addr, PREFIX, "the supervisor's store died") is False
    assert rendezvous.abort_rendezvous(None, addr, PREFIX, "no store at all") is False


# -- groups that form: one process per member (a process is in one collective at a time) ----------
def _forming_worker(rank, port, results):
    """Forms two groups: epoch 3 with everyone arriving together, then epoch 4 with rank 2
    arriving well after its peers (well within configure_timeout_s); all-reduces in each."""
    out = {"rank": rank}
    try:
        addr = rendezvous.rendezvous_address("127.0.0.1", port, SECRET)
        group = LevelGroup("inner", "gloo", timeout_s=10.0, configure_timeout_s=LONG_S)
        client = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        for epoch, late in ((3, False), (4, rank == 2)):
            prefix = f"run-x/epoch{epoch}/inner/c1"
            if late:
                time.sleep(2.0)
            group.configure(addr, prefix, rank, 3, epoch=epoch)
            t = [torch.full((2,), float(rank + 1))]
            group.allreduce_mean(t, level="inner")
            out[f"sum_{epoch}"] = (t[0] * 3).tolist()
            group.abort()
        out["abort_after_forming"] = rendezvous.abort_rendezvous(client, addr, "run-x/epoch3/inner/c1", "too late")
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def formed():
    return run_ranks(_forming_worker, 3, timeout_s=2 * LONG_S, store_timeout_s=LONG_S)


def test_every_member_arriving_forms_a_working_group(formed):
    for rank, o in formed.items():
        assert o["sum_3"] == [6.0, 6.0], f"rank {rank}: the all-reduce of 1+2+3 must give 6 on every member"
        assert o["abort_after_forming"] is False, "a formed group's rendezvous can no longer be aborted"


def test_a_member_arriving_late_within_the_timeout_still_forms_the_group(formed):
    for rank, o in formed.items():
        assert o["sum_4"] == [6.0, 6.0], f"rank {rank}: the group its late member joined must all-reduce"


# -- the replica's side ------------------------------------------------------------------------------
def _replica_class():
    from actors.replica import Replica

    return Replica.__ray_actor_class__


def test_the_join_fault_fires_before_the_member_arrives_and_only_when_a_group_forms():
    seen = []
    group = SimpleNamespace(configure=lambda *args: seen.append(("configure", args)))
    fake = SimpleNamespace(
        inner=group,
        epoch=-1,
        phase="idle",
        phase_since=0.0,
        trainer=SimpleNamespace(round=4),
        _hook=lambda phase, r, s: seen.append(("hook", phase, r)),
    )
    join = _replica_class()._join
    assert join(fake, group, None, "inner") == 0.0 and seen == [], "a standing group forms nothing"
    join(fake, group, GroupJoin(7, "h:1/s", "run/epoch7/inner/c1", 1, 2), "inner")
    assert seen == [("hook", "join", 4), ("configure", ("h:1/s", "run/epoch7/inner/c1", 1, 2, 7))]


def test_a_failed_collective_answer_carries_its_error_kind():
    fake = SimpleNamespace(
        phase="idle",
        phase_since=0.0,
        rid="c1r0",
        armed=[],
        trainer=SimpleNamespace(progress=lambda: {"round": 0, "step": 0}),
    )

    def fails():
        raise CollectiveError(
            "inner: joining run/epoch7/inner/c1 as rank 0/2: the rendezvous was aborted: c1r1 died", "join_aborted"
        )

    replica = _replica_class()
    fake._answer = lambda *args, **kw: replica._answer(fake, *args, **kw)  # (the one place answers are built)
    answer = replica._phase(fake, "inner", fails, None).wire()
    assert answer["outcome"] == "collective_failed" and answer["error_kind"] == "join_aborted"
