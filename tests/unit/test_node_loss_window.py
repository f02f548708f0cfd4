"""Issue 45 finding 8: replicas of one node dying together (a raylet crash, an OOM) are the node's
death, not one death of each replica: three whole-node losses on a one-node run quarantine nobody
(quarantining all would end the run in `quorum lost` where a restore from the checkpoint is due)."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import open_dict

from actors import quarantine as quarantine_actor
from hsgd.core import quarantine as rule
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from tests.fakes.configs import tiny_cfg
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster

RIDS = ("c0r0", "c0r1", "c0r2")


def test_replicas_of_one_node_dying_together_are_the_nodes_death_not_theirs():
    deaths = [(100.0, "n1", "c0r0"), (100.4, "n1", "c0r1"), (101.2, "n1", "c0r2"), (300.0, "n1", "c0r1")]
    assert rule.own_deaths(deaths, 5.0) == {"c0r1": [300.0]}, "alone, 200 s later: c0r1's own"
    (loss,) = rule.node_losses(deaths, 5.0)
    assert (loss.node, loss.t, loss.rids) == ("n1", 100.0, ("c0r0", "c0r1", "c0r2"))


def test_what_is_no_node_loss():
    apart = [(0.0, "n1", "c0r0"), (6.0, "n1", "c0r1")]  # further apart than the window
    two_nodes = [(0.0, "n1", "c0r0"), (0.1, "n2", "c1r0")]
    unknown = [(0.0, None, "c0r0"), (0.1, None, "c0r1")]  # a replica that never answered up: no node
    one_replica = [(0.0, "n1", "c0r0"), (1.0, "n1", "c0r0")]  # a crash loop of its own
    for deaths in (apart, two_nodes, unknown, one_replica):
        assert rule.node_losses(deaths, 5.0) == [], deaths
        assert sum(len(t) for t in rule.own_deaths(deaths, 5.0).values()) == 2, deaths
    assert rule.node_losses(apart, 0.0) == [] and rule.node_losses(apart, 6.0), "0 turns it off; 6 s joins them"


def test_a_slow_node_loss_chains_replica_to_replica():
    deaths = [(float(i), "n1", f"c0r{i}") for i in range(6)]  # 1 s apart: 5 s from first to last
    (loss,) = rule.node_losses(deaths, 1.5)
    assert len(loss.rids) == 6 and rule.own_deaths(deaths, 1.5) == {}


def test_death_log_quarantines_a_replica_for_its_own_deaths_only():
    log = rule.DeathLog(after=3, window_s=600.0, node_loss_window_s=5.0)
    for loss in range(3):  # three node losses, each replica reported in another order each time
        t = 100.0 * loss
        order = RIDS[loss:] + RIDS[:loss]
        assert not any(log.died(t + 0.3 * i, "n1", rid) for i, rid in enumerate(order)), f"node loss {loss}"
    assert all(log.own(rid, 250.0) == [] for rid in RIDS)
    # c0r2 then dies alone, three times: its own deaths
    assert not log.died(400.0, "n1", "c0r2") and not log.died(410.0, "n1", "c0r2")
    assert log.died(420.0, "n1", "c0r2") and log.own("c0r2", 420.0) == [400.0, 410.0, 420.0]
    log.forget("c0r2")  # moved elsewhere: a fresh count
    assert log.own("c0r2", 420.0) == [] and not log.died(430.0, "n2", "c0r2")


def test_the_first_reported_death_of_a_node_loss_is_its_own_until_the_next_one_comes():
    """What a supervisor knows when a death is reported: only the deaths before it. So the first
    replica reported of a node loss counts it as its own until a second replica's death joins it;
    a replica is never quarantined for node losses alone (it needs after - 1 deaths of its own)."""
    log = rule.DeathLog(after=3, window_s=600.0, node_loss_window_s=5.0)
    log.died(10.0, "n1", "c0r0")
    log.died(20.0, "n1", "c0r0")
    assert log.died(30.0, "n1", "c0r0"), "its third death, the node loss not yet seen: due"
    log = rule.DeathLog(after=3, window_s=600.0, node_loss_window_s=5.0)
    for t in (10.0, 20.0):
        log.died(t, "n1", "c0r0")
        log.died(t + 0.5, "n1", "c0r1")
    assert log.own("c0r0", 20.5) == [] and not log.died(30.0, "n1", "c0r0")


def test_three_whole_node_losses_on_one_node_quarantine_no_replica(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(quarantine_actor, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(
        quarantine_actor,
        "ray",
        SimpleNamespace(kill=lambda *a, **k: None, nodes=lambda: [{"NodeID": "n1", "Alive": True}]),
    )
    monkeypatch.setattr(quarantine_actor, "available_resources_per_node", lambda: {"n1": {"CPU": 8.0}})
    cfg = tiny_cfg(["faults.quarantine_after=3", "faults.quarantine_window_s=600"])
    with open_dict(cfg.faults):  # (this test was written before the key)
        cfg.faults.node_loss_window_s = 5.0
    state, roster, log = RunState(), FakeRoster(Topology(1, len(RIDS)), nodes=("n1",)), EventLog()
    q = quarantine_actor.Quarantine(cfg, "run-1", "/nowhere", state, roster, log, save=lambda: None)
    for loss in range(3):
        for i, rid in enumerate(RIDS):
            now[0] = 60.0 * loss + 0.5 * i
            q.death(rid)
    assert roster.aside == [] and state.quarantined == {}, "a node's deaths quarantined its replicas"
    assert roster.replaced == [], "a replica moved on a one-node run"
    assert not log.named("replica_quarantined")
    for t in (300.0, 310.0, 320.0):  # c0r1 alone: its own deaths, kept out (no other node)
        now[0] = t
        q.death("c0r1")
    assert roster.aside == ["c0r1"] and state.quarantined["c0r1"]["moved_to"] is None
    assert roster.replaced == [], "a replica moved on a one-node run"
    assert state.death_times["c0r1"] == [300.0, 310.0, 320.0], "the durable count: its own deaths"
