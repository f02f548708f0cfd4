"""hsgd.train.comm: level-checked collectives, and real gloo groups that fail fast and can be re-formed.

The multi-process test runs ONE spawned session of three processes (spawn + torch import is the
slow part) and checks several promises in it: mean all-reduce, root broadcast, byte accounting, a
dead peer turning the survivors' next collective into CollectiveError within the timeout, the
group being unusable after an error, and the survivors re-forming under a fresh epoch prefix.
"""

import os
import time
import traceback

import pytest
import torch

from hsgd.train.comm import CollectiveError, LevelGroup, WrongLevelError
from tests.fakes.deadlines import HANG_S
from tests.fakes.gloo_world import run_ranks
from tests.fakes.process_group import FakePG

TIMEOUT_S = 5.0
CONFIGURE_TIMEOUT_S = 10.0


# -- no processes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("group_level,call_level", [("inner", "outer"), ("outer", "inner")])
def test_collective_on_the_wrong_level_raises(group_level, call_level):
    group = LevelGroup(group_level)
    t = [torch.ones(3)]
    with pytest.raises(WrongLevelError, match=call_level):
        group.allreduce_mean(t, level=call_level)
    with pytest.raises(WrongLevelError):
        group.broadcast(t, root=0, level=call_level)
    assert torch.equal(t[0], torch.ones(3)), "a refused collective must not touch the tensors"


def test_wrong_level_is_checked_even_on_a_group_of_one():
    group = LevelGroup("inner")
    group.configure(None, "epoch1/inner/c0", rank=0, world_size=1, epoch=1)
    with pytest.raises(WrongLevelError):
        group.allreduce_mean([torch.ones(1)], level="outer")


def test_unknown_level_is_refused():
    with pytest.raises(AssertionError):
        LevelGroup("middle")


def test_world_size_one_does_nothing():
    group = LevelGroup("outer")
    group.configure(None, "epoch3/outer", rank=0, world_size=1, epoch=3)
    t = [torch.arange(4.0), torch.full((2, 2), 7.0)]
    group.allreduce_mean(t, level="outer")
    group.broadcast(t, root=0, level="outer")
    assert torch.equal(t[0], torch.arange(4.0)) and torch.equal(t[1], torch.full((2, 2), 7.0))
    assert group.bytes_sent == 0, "a group of one must not communicate"
    group.abort()
    group.allreduce_mean(t, level="outer")  # still usable: nothing to abort


# -- real gloo groups -----------------------------------------------------------------------------
def _worker(rank, port, results):
    out = {"rank": rank}
    try:
        addr = f"127.0.0.1:{port}"
        group = LevelGroup("inner", "gloo", timeout_s=TIMEOUT_S, configure_timeout_s=CONFIGURE_TIMEOUT_S)
        group.configure(addr, "epoch1/inner/c0", rank=rank, world_size=3, epoch=1)
        t = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 * rank)]
        group.allreduce_mean(t, level="inner")
        out["mean"] = [x.tolist() for x in t]
        out["bytes_after_allreduce"] = group.bytes_sent
        b = [torch.full((3,), 100.0 + rank), torch.full((2,), -1.0 * rank)]
        group.broadcast(b, root=1, level="inner")
        out["broadcast"] = [x.tolist() for x in b]
        out["bytes_after_broadcast"] = group.bytes_sent
        try:
            group.allreduce_mean(t, level="outer")
        except WrongLevelError:
            out["wrong_level_refused"] = True
        if rank == 2:
            results.put(out)
            results.close()
            results.join_thread()  # flush the queue's feeder thread: os._exit skips it
            os._exit(0)  # a crashed peer
        start = time.monotonic()
        try:
            group.allreduce_mean([torch.ones(4)], level="inner")
            out["after_death"] = "no error"
        except CollectiveError as err:
            out["after_death"] = "CollectiveError"
            out["error_text"] = str(err)
        out["detect_s"] = time.monotonic() - start
        try:
            group.allreduce_mean([torch.ones(4)], level="inner")
            out["reuse"] = "no error"
        except CollectiveError:
            out["reuse"] = "CollectiveError"
        group.configure(addr, "epoch2/inner/c0", rank=rank, world_size=2, epoch=2)
        r = [torch.full((2,), float(rank + 1))]
        group.allreduce_mean(r, level="inner")
        out["reformed_mean"] = r[0].tolist()
        out["prefix"] = group.prefix
        group.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def gloo_session():
    return run_ranks(_worker, 3, timeout_s=30, store_timeout_s=30, join_s=5)


def test_allreduce_mean_gives_the_mean_on_every_member(gloo_session):
    for rank, o in gloo_session.items():
        assert o["mean"] == [[1.0] * 3, [[10.0, 10.0], [10.0, 10.0]]], f"rank {rank} did not get the mean"


def test_broadcast_gives_roots_tensors_to_every_member(gloo_session):
    for rank, o in gloo_session.items():
        assert o["broadcast"] == [[101.0] * 3, [-1.0, -1.0]], f"rank {rank} did not get root 1's tensors"


def test_bytes_sent_counts_collective_payload(gloo_session):
    payload = (3 + 4) * 4  # float32 elements of the all-reduce
    bcast = (3 + 2) * 4
    for rank, o in gloo_session.items():
        assert o["bytes_after_allreduce"] == payload
        extra = bcast * 2 if rank == 1 else 0  # root sends to world_size - 1 peers
        assert o["bytes_after_broadcast"] == payload + extra, f"rank {rank} byte count"


def test_wrong_level_refused_on_a_live_group(gloo_session):
    assert all(o.get("wrong_level_refused") for o in gloo_session.values())


def test_dead_peer_makes_next_collective_fail_within_timeout(gloo_session):
    for rank in (0, 1):
        o = gloo_session[rank]
        assert o["after_death"] == "CollectiveError", f"rank {rank}: a dead peer must raise CollectiveError"
        # invariant 4: it raises (here within TIMEOUT_S; a wait past its deadline is a hang)
        assert o["detect_s"] < HANG_S, f"rank {rank}: failure took {o['detect_s']:.1f}s"
        assert "epoch1/inner/c0" in o["error_text"], "the error should name the group"


def test_group_is_unusable_after_an_error_until_reconfigured(gloo_session):
    for rank in (0, 1):
        assert gloo_session[rank]["reuse"] == "CollectiveError"


def test_survivors_reform_under_a_new_prefix(gloo_session):
    for rank in (0, 1):
        o = gloo_session[rank]
        assert o["reformed_mean"] == [1.5, 1.5], f"rank {rank}: re-formed group must work"
        assert o["prefix"] == "epoch2/inner/c0"


def test_a_process_is_never_in_two_collectives_at_once():
    """Invariant 3 is enforced per process, across levels: a second collective while one is in
    flight raises instead of silently nesting (the seeds' inner/outer deadlock)."""
    from hsgd.train import comm

    with (
        comm.one_collective("inner allreduce"),
        pytest.raises(comm.OverlappingCollectiveError, match="outer broadcast"),
        comm.one_collective("outer broadcast"),
    ):
        pass
    with comm.one_collective("outer broadcast"):  # released again afterwards
        pass


def test_nccl_path_is_importable_behind_the_same_interface(monkeypatch):
    """The NCCL group cannot even be built on this CPU-only torch, but it sits behind the same
    interface: `backend="nccl"` selects torchft's ProcessGroupNCCL with the configured timeout."""
    import torchft.process_group as tpg

    from hsgd.train import comm

    assert hasattr(tpg, "ProcessGroupNCCL")
    built = {}
    monkeypatch.setattr(tpg, "ProcessGroupNCCL", lambda timeout: built.setdefault("nccl", timeout))
    comm._make_torchft_group("nccl", 5.0)
    assert built["nccl"].total_seconds() == 5.0
    group = comm.LevelGroup("outer", backend="nccl", timeout_s=5)
    assert group.backend == "nccl" and group.level == "outer"


def test_collective_timeout_scales_with_payload_at_the_slowest_link():
    from hsgd.train.comm import collective_timeout_s

    assert collective_timeout_s(10.0, 0, 1.0) == 10.0
    assert collective_timeout_s(10.0, 1_000_000, 1.0) == pytest.approx(10.008)  # 1 MB inner all-reduce
    assert collective_timeout_s(10.0, 4 * 10**9, 1.0) == pytest.approx(42.0)  # 4 GB outer all-reduce


def test_each_collective_waits_for_its_own_payload():
    """A multi-GB outer all-reduce must not inherit the 1 MB inner one's deadline (the pg's own
    default): the operation and the wait both carry the payload-scaled timeout."""
    from datetime import timedelta

    pg = FakePG()
    group = LevelGroup("outer", timeout_s=10.0, min_gbps=0.001)  # 1 Mbit/s
    group._pg, group.world_size, group._usable = pg, 2, True
    group.allreduce_mean([torch.zeros(250_000)], level="outer")  # 1 MB -> 8 s at 1 Mbit/s
    assert pg.op_timeouts == [timedelta(seconds=18.0)] and pg.work.waits == [timedelta(seconds=18.0)]


def test_a_broadcast_waits_for_its_own_payload_too():
    """The outer commit's broadcast carries the whole model across the slow link, like the reduce."""
    from datetime import timedelta

    pg = FakePG()
    group = LevelGroup("outer", timeout_s=10.0, min_gbps=0.002)  # 2 Mbit/s
    group._pg, group.world_size, group._usable = pg, 3, True
    group.broadcast([torch.zeros(500_000)], root=1, level="outer")  # 2 MB -> 8 s at 2 Mbit/s
    assert pg.calls == [("broadcast", 500_000)]
    assert pg.op_timeouts == [timedelta(seconds=18.0)] and pg.work.waits == [timedelta(seconds=18.0)]
