"""hsgd.train.comm: all_gather on real gloo groups, and the simulated link per level (hsgd.train.simulate, issue 22,
Build 5): LinkModel's arithmetic, LevelGroup pacing each collective to the link's modeled time
(recorded in link_s), and the `links.*` config.

Timing: only lower bounds are asserted (a collective over a simulated link lasts at least its
modeled time: that is the behaviour); never an upper bound.
"""

import os
import time
import traceback

import pytest
import torch

from hsgd.config import ConfigError, HsgdConfig, validate
from hsgd.train import comm
from hsgd.train.comm import CollectiveError, LevelGroup, WrongLevelError
from hsgd.train.simulate import LinkModel, link_from_config
from tests.fakes.gloo_world import run_ranks
from tests.fakes.process_group import FakePG, FakeWork

TIMEOUT_S = 5.0
CONFIGURE_TIMEOUT_S = 10.0


# -- LinkModel ------------------------------------------------------------------------------------
def test_link_time_is_latency_plus_bytes_at_the_bandwidth():
    link = LinkModel(gbps=1.0, latency_ms=50.0)
    assert link.seconds(0) == pytest.approx(0.05)
    assert link.seconds(125_000_000) == pytest.approx(0.05 + 1.0)  # 1 Gbit at 1 Gb/s
    assert LinkModel(gbps=8.0, latency_ms=0.0).seconds(10**9) == pytest.approx(1.0)


def test_jitter_stays_within_its_bound_and_follows_the_seed():
    a = LinkModel(gbps=1.0, latency_ms=10.0, jitter_ms=5.0, seed=7)
    b = LinkModel(gbps=1.0, latency_ms=10.0, jitter_ms=5.0, seed=7)
    c = LinkModel(gbps=1.0, latency_ms=10.0, jitter_ms=5.0, seed=8)
    draws = [a.seconds(1000) for _ in range(200)]
    base = 0.010 + 1000 * 8 / 1e9
    assert all(base <= d <= base + 0.005 + 1e-12 for d in draws), "jitter must stay in [0, jitter_ms]"
    assert max(draws) - min(draws) > 0.001, "jitter must actually vary"
    assert draws == [b.seconds(1000) for _ in range(200)], "the same seed gives the same delays"
    assert draws != [c.seconds(1000) for _ in range(200)], "another seed gives other delays"


def test_link_from_config_is_off_at_zero_gbps():
    cfg = HsgdConfig()
    assert link_from_config(cfg.links.outer) is None and link_from_config(None) is None
    cfg.links.outer.gbps, cfg.links.outer.latency_ms, cfg.links.outer.jitter_ms = 2.0, 30.0, 4.0
    link = link_from_config(cfg.links.outer)
    assert (link.gbps, link.latency_ms, link.jitter_ms) == (2.0, 30.0, 4.0)


# -- pacing, with a fake process group (no processes) ----------------------------------------------
def _live(group, pg, world_size=2, rank=0):
    group._pg, group.world_size, group.rank, group._usable, group.prefix = (
        pg,
        world_size,
        rank,
        True,
        "run/epoch1/outer",
    )
    return group


def test_each_collective_lasts_its_modeled_time_and_link_s_records_it():
    link = LinkModel(gbps=1.0, latency_ms=40.0)
    group = _live(LevelGroup("outer", link=link), FakePG(), world_size=3, rank=0)
    payload = 250_000 * 4  # 1 MB: 8 ms at 1 Gb/s
    t0 = time.monotonic()
    group.allreduce_mean([torch.zeros(250_000)], level="outer")
    t1 = time.monotonic()
    assert t1 - t0 >= 0.040 + payload * 8 / 1e9
    group.broadcast([torch.zeros(250_000)], root=0, level="outer")  # the root sends to 2 members
    t2 = time.monotonic()
    assert t2 - t1 >= 0.040 + 2 * payload * 8 / 1e9
    group.all_gather(torch.zeros(250_000), level="outer")  # sends its chunk and forwards one
    t3 = time.monotonic()
    assert t3 - t2 >= 0.040 + 2 * payload * 8 / 1e9
    assert group.link_s >= 3 * 0.040 + 5 * payload * 8 / 1e9
    assert t3 - t0 + 1e-6 >= group.link_s, "link_s counts time inside collectives only"


def test_a_broadcast_receiver_waits_for_the_bytes_it_received():
    group = _live(LevelGroup("inner", link=LinkModel(gbps=1.0, latency_ms=0.0)), FakePG(), world_size=2, rank=1)
    t0 = time.monotonic()
    group.broadcast([torch.zeros(2_500_000)], root=0, level="inner")  # 10 MB: 80 ms at 1 Gb/s
    assert time.monotonic() - t0 >= 0.080
    assert group.bytes_sent == 0, "a receiver sends nothing"


def test_without_a_link_nothing_sleeps(monkeypatch):
    slept = []
    monkeypatch.setattr(comm.time, "sleep", lambda s: slept.append(s))
    group = _live(LevelGroup("outer"), FakePG())
    group.allreduce_mean([torch.zeros(1000)], level="outer")
    group.all_gather(torch.zeros(10, dtype=torch.uint8), level="outer")
    assert slept == [] and group.link_s >= 0.0


def test_a_failed_collective_does_not_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(comm.time, "sleep", lambda s: slept.append(s))
    group = _live(
        LevelGroup("outer", link=LinkModel(gbps=1.0, latency_ms=500.0)),
        FakePG(work=FakeWork(wait=RuntimeError("Connection closed by peer"))),
    )
    with pytest.raises(CollectiveError) as info:
        group.allreduce_mean([torch.zeros(10)], level="outer")
    assert info.value.kind == "peer_gone"
    assert slept == [], "a failed collective must not sleep the link's time"


def test_the_link_sleep_is_outside_the_collective_deadline():
    """The op's and the wait's deadlines are the payload's at comm.min_gbps, whatever the link."""
    from datetime import timedelta

    pg = FakePG()
    group = _live(LevelGroup("outer", timeout_s=10.0, link=LinkModel(gbps=1.0, latency_ms=30.0)), pg)
    group.allreduce_mean([torch.zeros(4)], level="outer")
    assert pg.op_timeouts == pg.work.waits == [timedelta(seconds=10.0 + 16 * 8 / 1e9)]


def test_an_overlapped_collective_hides_the_link_behind_compute_between_launches(monkeypatch):
    real_sleep, slept = time.sleep, []
    monkeypatch.setattr(comm.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    group = _live(LevelGroup("inner", link=LinkModel(gbps=1.0, latency_ms=60.0)), FakePG())
    # compute longer than the link's time between launch and wait: nothing left to sleep
    t0 = time.monotonic()
    launched = [group.launch_sum(torch.zeros(1000))[1:]]
    real_sleep(0.1)  # "the rest of the backward"
    group.wait_sums(launched, t0)
    assert time.monotonic() - t0 >= 0.060
    assert slept == [], "a link hidden behind compute costs no extra wait"
    # no compute between launch and wait: the whole modeled time is waited, and recorded
    before = group.link_s
    t1 = time.monotonic()
    launched = [group.launch_sum(torch.zeros(1000))[1:], group.launch_sum(torch.zeros(1000))[1:]]
    group.wait_sums(launched, t1)
    modeled = 0.060 + 8000 * 8 / 1e9  # one latency for the stream of buckets, both buckets' bytes
    assert time.monotonic() - t1 >= modeled
    assert len(slept) == 1 and group.link_s - before >= modeled, "an exposed link is recorded in link_s"


def test_all_gather_refuses_a_payload_that_is_not_1d():
    group = _live(LevelGroup("outer"), FakePG())
    with pytest.raises(ValueError, match="1-D"):
        group.all_gather(torch.zeros(2, 2), level="outer")
    with pytest.raises(WrongLevelError):
        group.all_gather(torch.zeros(2), level="inner")


def test_all_gather_on_a_group_of_one_returns_the_payload_and_sends_nothing():
    link = LinkModel(gbps=1.0, latency_ms=500.0)
    paced: list[int] = []
    link.pace = lambda start, payload_bytes: paced.append(payload_bytes)  # its sleep, recorded
    group = LevelGroup("outer", link=link)
    group.configure(None, "run/epoch1/outer", rank=0, world_size=1, epoch=1)
    p = torch.arange(5, dtype=torch.uint8)
    out = group.all_gather(p, level="outer")
    assert len(out) == 1 and out[0] is p
    assert group.bytes_sent == 0 and group.link_s == 0.0
    assert paced == [], "a group of one has no link to cross"


def test_an_error_issuing_all_gather_is_a_collective_error_and_the_group_unusable():
    group = _live(LevelGroup("outer"), FakePG(issue=RuntimeError("lazy init failed")))
    with pytest.raises(CollectiveError) as info:
        group.all_gather(torch.zeros(3), level="outer")
    assert info.value.kind == "issue"
    with pytest.raises(CollectiveError) as again:
        group.all_gather(torch.zeros(3), level="outer")
    assert again.value.kind == "aborted"
    with comm.one_collective("next"):  # the one-collective guard was released
        pass


# -- real gloo groups -----------------------------------------------------------------------------
def _gather_worker(world_size, with_link):
    def worker(rank, port, results):
        out = {"rank": rank}
        try:
            addr = f"127.0.0.1:{port}"
            link = LinkModel(gbps=1.0, latency_ms=50.0) if with_link else None
            group = LevelGroup("outer", "gloo", timeout_s=TIMEOUT_S, configure_timeout_s=CONFIGURE_TIMEOUT_S, link=link)
            group.configure(addr, "run/epoch1/outer", rank=rank, world_size=world_size, epoch=1)
            mine = torch.tensor([rank, 200 + rank, 7], dtype=torch.uint8)
            out["uint8"] = [(t.dtype, t.tolist()) for t in group.all_gather(mine, level="outer")]
            out["mine_untouched"] = mine.tolist()
            f = torch.full((4,), float(rank) + 0.5)
            out["fp32"] = [(t.dtype, t.tolist()) for t in group.all_gather(f, level="outer")]
            out["bytes_after_gathers"] = group.bytes_sent
            link_before = group.link_s
            t = torch.full((250_000,), float(rank))  # 1 MB
            start = time.monotonic()
            group.allreduce_mean([t], level="outer")
            out["allreduce_s"] = time.monotonic() - start
            out["allreduce_link_s"] = group.link_s - link_before
            out["mean"] = t[0].item()
            if rank == world_size - 1:
                results.put(out)
                results.close()
                results.join_thread()
                os._exit(0)  # a crashed peer
            try:
                group.all_gather(torch.zeros(3, dtype=torch.uint8), level="outer")
                out["after_death"] = "no error"
            except CollectiveError as err:
                out["after_death"] = err.kind
            group.abort()
        except BaseException:  # noqa: BLE001 — report everything to the parent
            out["exception"] = traceback.format_exc()
        results.put(out)

    return worker


# spawn pickles the worker by reference: module-level callables only
def _worker_2_link(rank, port, results):
    _gather_worker(2, True)(rank, port, results)


def _worker_3_plain(rank, port, results):
    _gather_worker(3, False)(rank, port, results)


@pytest.fixture(scope="module")
def two_with_link():
    return run_ranks(_worker_2_link, 2, timeout_s=40, store_timeout_s=30, join_s=5)


@pytest.fixture(scope="module")
def three_plain():
    return run_ranks(_worker_3_plain, 3, timeout_s=40, store_timeout_s=30, join_s=5)


@pytest.mark.parametrize("session", ["two_with_link", "three_plain"])
def test_all_gather_returns_every_members_payload_in_rank_order(session, request):
    outs = request.getfixturevalue(session)
    n = len(outs)
    for rank, o in outs.items():
        assert o["uint8"] == [(torch.uint8, [r, 200 + r, 7]) for r in range(n)], f"rank {rank}: uint8 gather"
        assert o["fp32"] == [(torch.float32, [r + 0.5] * 4) for r in range(n)], f"rank {rank}: fp32 gather"
        assert o["mine_untouched"] == [rank, 200 + rank, 7]


@pytest.mark.parametrize("session", ["two_with_link", "three_plain"])
def test_all_gather_counts_what_a_member_sends_in_a_ring(session, request):
    outs = request.getfixturevalue(session)
    n = len(outs)
    for rank, o in outs.items():
        assert o["bytes_after_gathers"] == 3 * (n - 1) + 16 * (n - 1), f"rank {rank}: bytes_sent"


@pytest.mark.parametrize("session", ["two_with_link", "three_plain"])
def test_a_dead_peer_makes_all_gather_raise_collective_error(session, request):
    outs = request.getfixturevalue(session)
    for rank in range(len(outs) - 1):
        assert outs[rank]["after_death"] in ("peer_gone", "wait", "timeout"), (
            f"rank {rank}: {outs[rank]['after_death']}"
        )


def test_a_real_allreduce_over_a_simulated_link_lasts_its_modeled_time(two_with_link):
    modeled = 0.050 + 1_000_000 * 8 / 1e9
    for rank, o in two_with_link.items():
        assert o["mean"] == 0.5
        assert o["allreduce_s"] >= modeled, f"rank {rank}: {o['allreduce_s']:.4f}s, under the modeled {modeled:.4f}s"
        assert o["allreduce_link_s"] >= modeled, f"rank {rank}: link_s must record the modeled wait"


def test_without_a_link_a_real_allreduce_does_not_wait_a_latency(three_plain):
    """The same 1 MB all-reduce without a link: link_s still records the collective's time, within
    the call's own (how long loopback gloo takes is a timing, not checked here)."""
    for o in three_plain.values():
        assert o["mean"] == 1.0
        assert o["allreduce_s"] >= o["allreduce_link_s"] > 0


# -- config ---------------------------------------------------------------------------------------
def _links(**changes) -> HsgdConfig:
    cfg = HsgdConfig()
    for dotted, value in changes.items():
        level, key = dotted.split("__")
        setattr(getattr(cfg.links, level), key, value)
    return cfg


def _refused(cfg, field):
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{field}:"), text
    return text


@pytest.mark.parametrize("level", ["outer", "inner"])
@pytest.mark.parametrize("key", ["gbps", "latency_ms", "jitter_ms"])
def test_negative_link_settings_are_refused_naming_the_field(level, key):
    _refused(_links(**{f"{level}__{key}": -1.0}), f"links.{level}.{key}")


@pytest.mark.parametrize("level", ["outer", "inner"])
def test_a_latency_without_a_bandwidth_is_refused_not_ignored(level):
    text = _refused(_links(**{f"{level}__latency_ms": 50.0}), f"links.{level}.latency_ms")
    assert f"links.{level}.gbps" in text


def test_a_link_slower_than_the_deadlines_assume_is_refused():
    text = _refused(_links(outer__gbps=0.5), "links.outer.gbps")
    assert "comm.min_gbps" in text
    cfg = _links(outer__gbps=0.5)
    cfg.comm.min_gbps = 0.5
    validate(cfg)


def test_a_one_gbps_fifty_ms_link_is_valid():
    validate(_links(outer__gbps=1.0, outer__latency_ms=50.0, outer__jitter_ms=5.0, inner__gbps=100.0))
