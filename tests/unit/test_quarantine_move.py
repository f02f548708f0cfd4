"""Issue 45 finding 4: a quarantined replica re-created on another node is detached (a restarted
supervisor's roster finds it by name: Ray ends a non-detached actor with its owner), lands on a node
of its site's label, and the hot-spare promotion that follows its death never takes the id back
(a spare of its cluster's group may sit on the very node it left)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors import quarantine as quarantine_actor
from actors import startup
from actors.round_runner import RoundRunner
from hsgd.config.capacity import LABEL_KEY
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from tests.fakes.configs import tiny_cfg
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster

N1, N2, N3 = ("11" * 28, "22" * 28, "33" * 28)  # Ray's node ids are hex
FINDING = "issue 45 finding 4: a quarantined replica moved without detaching, ignoring its label, undone by a spare"


def _node(nid: str, label: str | None) -> dict:
    return {"NodeID": nid, "Alive": True, "Labels": {LABEL_KEY: label} if label else {}}


@pytest.fixture
def world(monkeypatch):
    """c0 of label `a` on node n1 (where c0r1 keeps dying), n2 of label `b` with more room, n3 of `a`."""
    nodes = [_node(N1, "a"), _node(N2, "b"), _node(N3, "a")]
    free = {N1: {"CPU": 8.0}, N2: {"CPU": 8.0}, N3: {"CPU": 2.0}}
    started: list[dict] = []
    monkeypatch.setattr(quarantine_actor, "ray", SimpleNamespace(kill=lambda *a, **k: None, nodes=lambda: nodes))
    monkeypatch.setattr(quarantine_actor, "available_resources_per_node", lambda: free)
    monkeypatch.setattr(quarantine_actor, "time", SimpleNamespace(time=lambda: 1000.0))

    def start_replica(container, name, options, *args, index_table, lifetime=None):
        started.append({"name": name, "options": options, "lifetime": lifetime})
        return f"handle of {name}"

    monkeypatch.setattr(startup, "start_replica", start_replica)
    topology = Topology.of_sites([2, 2], labels=["a", "b"])
    spares = {str(c): [f"spare-c{c}-0"] for c in range(topology.clusters)}  # a ready spare in every cluster
    roster, state, log = FakeRoster(topology, nodes=(N1, N2), spares=spares), RunState(run_id="run-1"), EventLog()
    state.death_times = {"c0r1": [900.0, 950.0]}  # two deaths already: the next quarantines it
    cfg = tiny_cfg(
        ["faults.quarantine_after=3", "topology.cpus_per_replica=1", "run.dir=/nowhere", "run.sweep_dir=/nowhere"]
    )
    q = quarantine_actor.Quarantine(cfg, "run-1", "/nowhere", state, roster, log, save=lambda: None)
    roster.on_death = q.death
    return SimpleNamespace(roster=roster, state=state, log=log, started=started, quarantine=q, free=free)


def test_a_moved_replica_is_detached_and_lands_on_a_node_of_its_sites_label(world):
    world.quarantine.death("c0r1")
    (made,) = world.started
    assert made["lifetime"] == "detached", "Ray would end it with the supervisor that made it"
    assert made["options"]["scheduling_strategy"].node_id == N3, "n2 has more room, but not site a's label"
    (moved,) = world.log.named("replica_quarantined")
    assert (moved["node"], moved["moved_to"]) == (N1, N3)
    assert world.roster.names["c0r1"] == made["name"] == "hsgd:run-1:c0r1-q1", "the durable identity names it"


def test_no_node_of_its_label_keeps_it_out(world):
    world.roster.replica_info["c0r1"]["node_id"] = N3  # it died on n3: n1 is full, n2 is site b's
    world.free[N1] = {}
    world.quarantine.death("c0r1")
    assert world.started == [] and world.roster.gone == {"c0r1"}
    assert world.state.quarantined["c0r1"]["moved_to"] is None


class _Machine:
    def __init__(self, deaths):
        self.deaths, self.progress, self.epoch = deaths, {}, 3

    def cluster_of(self, rid):
        return int(rid[1])


def _log_deaths(world, deaths) -> None:
    """RoundRunner._log_deaths over fakes: the machine took in `deaths`; the roster logs each."""
    runner = object.__new__(RoundRunner)
    runner.m, runner.deaths_logged, runner.phase, runner.r = _Machine(deaths), 0, "inner", 4
    runner.probes = SimpleNamespace(forget=lambda rid: None)  # (actors/probes.py: no questions outstanding)
    runner.p = SimpleNamespace(roster=world.roster, state=world.state, store=None, store_addr=None)
    runner.heals = SimpleNamespace(release_groups_of=lambda *a, **k: None)
    runner._log_deaths()


def test_the_spare_promotion_after_the_death_never_takes_the_moved_id_back(world):
    _log_deaths(world, [("c1r0", "died"), ("c0r1", "died")])
    assert world.roster.names["c0r1"] == "hsgd:run-1:c0r1-q1"
    assert world.roster.promoted == ["c1r0"], "a spare took c0r1 back from the node it was moved to"


def test_a_kept_out_replica_takes_no_spare_either(world):
    world.roster.replica_info["c0r1"]["node_id"] = N3
    world.free[N1] = {}
    _log_deaths(world, [("c0r1", "died")])
    assert world.roster.gone == {"c0r1"} and world.roster.promoted == []


def test_the_run_end_stops_the_moved_replicas_it_detached(world, monkeypatch, tmp_path):
    world.quarantine.death("c0r1")
    world.state.write(tmp_path)
    killed: list[str] = []
    monkeypatch.setattr(quarantine_actor, "lookup", lambda name: name if name.endswith("-q1") else None)
    monkeypatch.setattr(quarantine_actor, "ray", SimpleNamespace(kill=lambda handle, no_restart: killed.append(handle)))
    quarantine_actor.stop_moved(str(tmp_path), "run-1")
    assert killed == ["hsgd:run-1:c0r1-q1"]
