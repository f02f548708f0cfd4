"""A site joining a running run (issue 37, join slice): the pure pieces (the widened topology and its
fresh indices, the joined-site records, the new replicas' config) and SiteChanges carrying a join out
with fake actors: started detached and never waited for, taken in only once ALL answer up, at a
round's start, durable across a supervisor restart (found again, never started twice, never logged
twice), and one site starting at a time. No Ray run: Ray's calls in actors/site_changes.py are faked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import actors.placement as placement
import actors.site_changes as site_changes
import actors.startup as startup
from actors.site_changes import SiteChanges
from hsgd.core import site_plan
from hsgd.core.site_requests import (
    APPLIED,
    REFUSED,
    Decision,
    abandoned,
    joined,
    mark_done,
    mark_joined,
    outcomes,
    requests_dir,
    write_request,
)
from hsgd.core.site_topology import applied_sites, joined_topology, widened_sites  # (moved from site_requests)
from hsgd.core.topology import Topology, topology_of
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster


# -- pure: the widened topology, the records, the new replicas' config ----------------------------------
def test_a_new_site_gets_the_next_cluster_and_fresh_indices_and_nobody_elses_index_moves():
    base = Topology(3, 2)
    wider = base.with_site(3, label="rack-b", name="berlin")
    assert wider.clusters == 4 and wider.sizes == (2, 2, 2, 3)
    assert wider.cluster_members(3) == ["c3r0", "c3r1", "c3r2"]
    assert [wider.global_index(rid) for rid in wider.cluster_members(3)] == [6, 7, 8]
    assert all(wider.global_index(rid) == base.global_index(rid) for rid in base.replica_ids())
    assert wider.label(3) == "rack-b" and wider.label(0) is None and wider.min_replicas_of(3, 1) == 1
    assert wider.describe()["sites"][3] == {"replicas": 3, "label": "rack-b", "name": "berlin", "min_replicas": None}
    # an index table that already gave ids past the topology (a drained site's, a removed one's): never reused
    table = {**dict(base.index_table), "c9r0": 11}
    assert Topology.of_sites([2, 2, 2], index_table=table).with_site(1).global_index("c3r0") == 12


def test_an_applied_add_site_record_names_its_cluster_and_keeps_what_a_successor_needs(tmp_path):
    request = write_request(tmp_path, "add-site", replicas=2, label="rack-b", name="berlin")
    record = mark_done(tmp_path, request, Decision(APPLIED, "starting", 3), 4)
    assert (record["cluster"], record["replicas"], record["label"], record["name"]) == ("c3", 2, "rack-b", "berlin")
    refused = write_request(tmp_path, "add-site", replicas=9)
    assert mark_done(tmp_path, refused, Decision(REFUSED, "no room", None), 4)["cluster"] == ""
    assert [d.id for d in applied_sites(outcomes(tmp_path))] == [request.id]


def test_the_topology_grows_by_the_joined_sites_only_in_the_order_they_were_added(tmp_path):
    first = write_request(tmp_path, "add-site", replicas=2, now=1.0)
    second = write_request(tmp_path, "add-site", replicas=1, label="rack-b", now=2.0)
    mark_done(tmp_path, first, Decision(APPLIED, "", 3), 2)
    mark_done(tmp_path, second, Decision(APPLIED, "", 4), 6)
    base = Topology(3, 2)
    assert joined_topology(base, outcomes(tmp_path), joined(tmp_path)) == base  # applied, not up yet
    mark_joined(tmp_path, first.id, "c3", 4)
    assert joined(tmp_path) == {first.id: {"id": first.id, "cluster": "c3", "round": 4, "run_id": ""}}
    assert not [p for p in requests_dir(tmp_path).iterdir() if p.name.startswith(".")]  # atomic: no temp left
    assert joined_topology(base, outcomes(tmp_path), joined(tmp_path)).sizes == (2, 2, 2, 2)
    mark_joined(tmp_path, second.id, "c4", 8)
    both = joined_topology(base, outcomes(tmp_path), joined(tmp_path))
    assert both.sizes == (2, 2, 2, 2, 1) and both.label(4) == "rack-b" and both.global_index("c4r0") == 8
    # a resumed run: c3 neither joined in it nor drained, so it stops there (c3 and c4 start again, in order)
    assert joined_topology(base, outcomes(tmp_path), {second.id: {}}) == base
    # c3 drained (it keeps its index) and c4 joined: both in, in order
    drained_c3 = joined_topology(base, outcomes(tmp_path), {second.id: {}}, drained_clusters={3})
    assert drained_c3.sizes == (2, 2, 2, 2, 1) and drained_c3.global_index("c4r0") == 8


def test_the_new_replicas_config_keeps_the_configured_sites_and_names_the_new_one():
    configured = [
        {"replicas": 2, "label": None, "name": "a", "min_replicas": 1, "min_step_s": 0.5},
        {"replicas": 1, "label": "x", "name": "b", "min_replicas": None, "min_step_s": None},
    ]
    wider = Topology.of_sites([2, 1], labels=[None, "x"], names=["a", "b"]).with_site(2, label="y", name="c")
    sites = widened_sites(configured, wider)
    assert sites[:2] == configured and sites[2]["replicas"] == 2 and sites[2]["label"] == "y"
    assert sites[2]["name"] == "c" and sites[2]["min_step_s"] is None and sites[2]["min_replicas"] is None
    uniform = widened_sites([], Topology(2, 3).with_site(1))  # the uniform keys: every site written out
    assert [s["replicas"] for s in uniform] == [3, 3, 1]


# -- SiteChanges carrying a join out, with fake actors ----------------------------------------------------


class _Ref:
    def __init__(self, actor):
        self.actor = actor


class _Actor:
    """A replica actor: `progress` answers once `answer` is set (its __init__ done)."""

    def __init__(self, name: str):
        self.name, self.answer, self.dead = name, None, False  # dead: for good (Ray's restarts spent)
        self.progress = SimpleNamespace(remote=lambda: _Ref(self))
        self.loads: list[tuple] = []  # load_checkpoint's arguments; done once it answers up
        self.load_checkpoint = SimpleNamespace(remote=lambda *args: self.loads.append(args) or _Ref(self))


class _World:
    """The named actors and Ray's calls SiteChanges makes (started, looked up, waited on)."""

    def __init__(self):
        self.actors: dict[str, _Actor] = {}
        self.started: list[tuple] = []
        self.killed: list[str] = []
        self.waits: list[float] = []  # every ray.wait's timeout
        self.groups_removed: list[str] = []

    def start(self, container, name, options, rid, run_dir, backends, index_table, lifetime=None):
        self.started.append((name, {**options, "lifetime": lifetime}, rid, container, dict(index_table)))
        self.actors[name] = _Actor(name)
        return self.actors[name]

    def up(self, *names: str) -> None:
        for name in names:
            self.actors[name].answer = {"round": 0, "step": 0, "phase": "idle", "spare": False, "pid": 1}

    def die(self, *names: str) -> None:
        for name in names:
            self.actors[name].dead = True

    def wait(self, refs, num_returns, timeout, fetch_local=True):
        self.waits.append(timeout)
        ready = [r for r in refs if r.actor.answer is not None or r.actor.dead]
        return ready, [r for r in refs if r not in ready]

    @staticmethod
    def get(ref, timeout):
        if ref.actor.dead:
            raise RuntimeError(f"ActorDiedError: {ref.actor.name}")
        return ref.actor.answer

    def kill(self, handle, no_restart=True):
        self.killed.append(handle.name)


@pytest.fixture
def world(monkeypatch):
    w = _World()
    monkeypatch.setattr(
        site_changes,
        "cluster_resources",
        lambda cfg: ([{"NodeID": "n1", "Alive": True, "Labels": {}}], {"n1": {"CPU": 8.0}}, {"CPU": 1.0}),
    )
    monkeypatch.setattr(site_changes, "lookup", lambda name: w.actors.get(name))
    monkeypatch.setattr(site_changes, "ray", SimpleNamespace(wait=w.wait, get=w.get, kill=w.kill))
    monkeypatch.setattr(site_changes, "restarts_exhausted", lambda handle: handle.dead)
    monkeypatch.setattr(placement, "remove_site_group", w.groups_removed.append)
    monkeypatch.setattr(startup, "start_replica", w.start)
    monkeypatch.setattr(
        placement,
        "site_options",
        lambda cfg, gpus, n, label, group: [
            {"num_cpus": 1.0, "group": group, "label": label, "bundle": i} for i in range(n)
        ],
    )
    return w


CFG = OmegaConf.create(
    {
        "supervisor": {
            "min_clusters": 1,
            "min_replicas_per_cluster": 1,
            "phase_timeout_s": 30.0,
            "join_timeout_s": 600.0,
        },
        "checkpoint": {"dir": None},
        "run": {"io_grace_s": 4.0},
        "faults": {"max_restarts": 3},
        "topology": {
            "clusters": 2,
            "replicas_per_cluster": 2,
            "sites": [],
            "cluster_labels": [],
            "gpus_per_replica": 1,
            "placement_strategy": "STRICT_PACK",
        },
    }
)


def _supervisor(tmp_path, events: list[dict], state: SimpleNamespace, resume_round: int | None = None, cfg=CFG, **kw):
    """A supervisor's SiteChanges as a (re)started supervisor builds it: the topology with every joined site."""
    topology = site_changes.topology_of_run(topology_of(cfg, state.replica_indices), str(tmp_path), state.run_id)
    state.replica_indices = dict(topology.index_table)
    if not state.identity:
        state.identity.update({rid: f"hsgd:run1:{rid}" for rid in topology.replica_ids()})
    handles = {rid: SimpleNamespace(name=n) for rid, n in state.identity.items()}
    roster = FakeRoster(topology, names=state.identity, handles=handles, at=(3, 12), nodes=("n1",))
    saves = []
    return SiteChanges(
        cfg, str(tmp_path), topology, roster, EventLog(events), state, lambda: saves.append(1), resume_round, **kw
    ), roster


def _state() -> SimpleNamespace:
    return SimpleNamespace(run_id="run1", replica_indices={}, identity={})


def test_a_site_is_started_at_once_and_joins_at_the_first_round_start_after_all_its_replicas_are_up(
    world, tmp_path, capsys
):
    events: list[dict] = []
    state = _state()
    sites, roster = _supervisor(tmp_path, events, state)
    request = write_request(tmp_path, "add-site", replicas=2, name="berlin")
    assert sites.at_round_start(3).clusters == 2  # applied and started, not in the topology yet
    assert world.waits and set(world.waits) == {0}, "a join is never waited for"
    [decided] = [e for e in events if e["event"] == "site_request"]
    assert (decided["outcome"], decided["cluster"], decided["round"]) == (APPLIED, "c2", 3)
    names = [s[0] for s in world.started]
    assert names == ["hsgd:run1:c2r0", "hsgd:run1:c2r1"]  # named as the driver names replicas
    for _name, options, _rid, container, table in world.started:
        assert options["lifetime"] == "detached" and options["group"] == "hsgd:run1:site-c2"  # outlives a supervisor
        assert table == {"c0r0": 0, "c0r1": 1, "c1r0": 2, "c1r1": 3, "c2r0": 4, "c2r1": 5}  # fresh global indices
        assert [s["replicas"] for s in container["topology"]["sites"]] == [2, 2, 2]
        assert container["topology"]["sites"][2]["name"] == "berlin"
    assert state.replica_indices["c2r1"] == 5  # durable before any replica reads its own
    assert "c2r0" not in roster.live and "c2r0" not in roster.names

    world.up("hsgd:run1:c2r0")  # one of two up: nobody waits, nothing joins
    assert sites.at_round_start(4).clusters == 2 and "c2r0" not in roster.live
    world.up("hsgd:run1:c2r1")
    topology = sites.at_round_start(5)  # all up: they join at this round's start
    assert topology.clusters == 3 and roster.topology is topology and topology.names[2] == "berlin"
    assert roster.live["c2r0"] == (0, 0) and roster.live["c2r1"] == (0, 0)  # behind: the round machine heals them
    assert roster.names["c2r0"] == "hsgd:run1:c2r0" and roster.handles["c2r1"] is world.actors["hsgd:run1:c2r1"]
    assert joined(tmp_path)[request.id]["round"] == 5
    [up] = [e for e in events if e["event"] == "site_up"]
    assert (up["cluster"], up["round"], up["replicas"]) == ("c2", 5, ["c2r0", "c2r1"])
    assert "site c2 up (2 replica(s)" in capsys.readouterr().err
    assert sites.topology_record()["history"] == [{"round": 3, "kind": "add-site", "cluster": "c2", "joined": 5}]

    assert not [e for e in events if e["event"] == "site_committed"]
    sites.at_round_start(6)  # its members still at round 0: round 5 did not commit with them
    assert not [e for e in events if e["event"] == "site_committed"]
    roster.live.update({"c2r0": (7, 28), "c2r1": (7, 28)})
    sites.at_round_start(7)
    sites.at_round_start(8)
    [committed] = [e for e in events if e["event"] == "site_committed"]
    assert (committed["cluster"], committed["round"], committed["replicas"]) == ("c2", 6, ["c2r0", "c2r1"])
    assert len(world.started) == 2


def test_a_restarted_supervisor_finds_a_joined_site_and_neither_starts_nor_logs_anything_again(world, tmp_path):
    events: list[dict] = []
    state = _state()
    sites, _ = _supervisor(tmp_path, events, state)
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    sites.at_round_start(4)
    logged = list(events)

    restarted, roster = _supervisor(tmp_path, events, state)  # the same durable state and run folder
    assert restarted.topology.clusters == 3 and roster.topology.sizes == (2, 2, 2)
    assert roster.handles["c2r0"].name == "hsgd:run1:c2r0" and not roster.gone
    assert restarted.at_round_start(5).clusters == 3
    assert events == logged and len(world.started) == 2  # nothing started, decided or logged twice
    assert restarted.topology.global_index("c2r1") == 5


def test_a_supervisor_restarted_before_the_join_finds_the_started_replicas_and_takes_them_in_once(world, tmp_path):
    events: list[dict] = []
    state = _state()
    sites, _ = _supervisor(tmp_path, events, state)
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    restarted, roster = _supervisor(tmp_path, events, state)  # applied, its replicas still starting
    assert restarted.topology.clusters == 2 and len(world.started) == 2  # found by name, not started again
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    assert restarted.at_round_start(4).clusters == 3 and set(roster.live) >= {"c2r0", "c2r1"}
    assert len([e for e in events if e["event"] == "site_request"]) == 1
    assert len([e for e in events if e["event"] == "site_up"]) == 1


def test_a_supervisor_that_died_before_starting_the_replicas_starts_them_once(world, tmp_path):
    request = write_request(tmp_path, "add-site", replicas=1)
    mark_done(tmp_path, request, Decision(APPLIED, "starting", 2), 3)  # the outcome on disk, no actor yet
    events: list[dict] = []
    sites, _ = _supervisor(tmp_path, events, _state())
    assert [s[0] for s in world.started] == ["hsgd:run1:c2r0"]
    [decided] = [e for e in events if e["event"] == "site_request"]  # its predecessor never logged it
    assert decided["cluster"] == "c2"


def test_a_restarted_supervisor_decides_no_request_at_the_round_it_took_over_only_at_the_next(world, tmp_path):
    """A request written mid-round, then the supervisor SIGKILLed: its successor's first round start is the
    round its predecessor started (a site to drain may have finished its inner steps there; the realistic
    test's bug), so every request waits for the next round's start."""
    events: list[dict] = []
    state = _state()
    state.supervisor_starts = 2  # a restart within the run
    sites, _ = _supervisor(tmp_path, events, state)
    write_request(tmp_path, "add-site", replicas=1)
    sites.at_round_start(1)  # the round taken over
    assert not [e for e in events if e["event"] == "site_request"] and not world.started
    sites.at_round_start(2)
    [decided] = [e for e in events if e["event"] == "site_request"]
    assert (decided["kind"], decided["outcome"], decided["round"]) == ("add-site", APPLIED, 2)
    assert [s[0] for s in world.started] == ["hsgd:run1:c2r0"]


def test_a_resumed_run_decides_requests_at_its_first_round_start(world, tmp_path):
    events: list[dict] = []
    state = _state()
    state.supervisor_starts = 1  # a resumed run's first supervisor (RunState.begin starts the count again)
    sites, _ = _supervisor(tmp_path, events, state, resume_round=4)
    write_request(tmp_path, "add-site", replicas=1)
    sites.at_round_start(4)
    assert [e["round"] for e in events if e["event"] == "site_request"] == [4]


def test_one_site_starts_at_a_time(world, tmp_path):
    events: list[dict] = []
    sites, _ = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "add-site", replicas=1, now=1.0)
    write_request(tmp_path, "add-site", replicas=1, now=2.0)
    sites.at_round_start(3)
    first, second = [e for e in events if e["event"] == "site_request"]
    assert first["outcome"] == APPLIED and second["outcome"] == REFUSED
    assert second["reason"] == (
        "add-site c3: site c2 is still starting; ask again once it joined (one site starts at a time)"
    )
    world.up("hsgd:run1:c2r0")
    sites.at_round_start(4)
    write_request(tmp_path, "add-site", replicas=1, now=3.0)
    assert sites.at_round_start(5).clusters == 3  # c3 applied now, starting
    assert [s[0] for s in world.started] == ["hsgd:run1:c2r0", "hsgd:run1:c3r0"]
    assert world.started[1][4]["c3r0"] == 5


def test_a_join_whose_record_cannot_be_written_waits_for_a_later_round(world, tmp_path, monkeypatch, capsys):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "add-site", replicas=1)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    written = site_plan.mark_joined
    monkeypatch.setattr(site_plan, "mark_joined", full_disk)
    assert sites.at_round_start(4).clusters == 2 and "c2r0" not in roster.live  # not joined, the run goes on
    assert "retried next round" in capsys.readouterr().err
    monkeypatch.setattr(site_plan, "mark_joined", written)  # the disk is back
    assert (
        sites.at_round_start(5).clusters == 3
        and json.loads(next(requests_dir(tmp_path).glob("*.joined")).read_text())["round"] == 5
    )


def test_a_resumed_run_starts_an_added_site_again_under_its_own_names_and_the_same_indices(world, tmp_path):
    events: list[dict] = []
    first_state = _state()
    sites, _ = _supervisor(tmp_path, events, first_state)
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    sites.at_round_start(4)
    # train.resume=true in the same run.dir: a new run id, the driver's table from the checkpoint's manifest
    resumed_state = SimpleNamespace(run_id="run2", replica_indices=dict(first_state.replica_indices), identity={})
    resumed, roster = _supervisor(tmp_path, events, resumed_state)
    assert resumed.topology.clusters == 2 and "c2r0" not in roster.names  # its actors went with the old run
    assert [s[0] for s in world.started[2:]] == ["hsgd:run2:c2r0", "hsgd:run2:c2r1"]
    assert world.started[2][4]["c2r0"] == 4 and world.started[3][4]["c2r1"] == 5  # the same data streams
    world.up("hsgd:run2:c2r0", "hsgd:run2:c2r1")
    assert resumed.at_round_start(6).clusters == 3
    assert len([e for e in events if e["event"] == "site_request"]) == 1  # decided once, for good


def test_a_resumed_run_loads_an_added_sites_replicas_from_its_checkpoint_and_takes_the_site_in_at_the_resume_round(
    world, tmp_path
):
    events: list[dict] = []
    first_state = _state()
    sites, _ = _supervisor(tmp_path, events, first_state)
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    sites.at_round_start(4)
    saved = tmp_path / "checkpoints" / "round_000006"  # the last checkpoint: c2r0's file in it, c2r1's not
    saved.mkdir(parents=True)
    (saved / "manifest.json").write_text(json.dumps({"round": 6, "files": {"c0r0": "a", "c2r0": "sha-c2r0"}}))
    resumed_state = SimpleNamespace(run_id="run2", replica_indices=dict(first_state.replica_indices), identity={})
    resumed, roster = _supervisor(tmp_path, events, resumed_state, resume_round=6)
    new = {rid: world.actors[f"hsgd:run2:{rid}"] for rid in ("c2r0", "c2r1")}
    assert new["c2r0"].loads == [(str(saved), "sha-c2r0", None, "file")] and new["c2r1"].loads == []
    world.up("hsgd:run2:c2r0", "hsgd:run2:c2r1")
    for actor in new.values():
        actor.answer.update(round=6, step=24)  # its own state loaded (c2r1: none held, it heals when it joins)
    assert resumed.at_round_start(6).clusters == 3  # the resume round: the site takes part from it
    assert world.waits[-2:] == [30.0, 30.0], "the resumed site's first look waits (phase_timeout_s), once"
    assert roster.live["c2r0"] == (6, 24)
    world.waits.clear()
    resumed.at_round_start(7)
    assert set(world.waits) <= {0}


def _added_in_an_earlier_run(tmp_path, *, drain_c2: bool) -> None:
    """The run folder of a run (run1) where c2 (2 replicas) then c3 (1) were added and joined, and c2
    perhaps drained afterwards."""
    for cluster, replicas, applied_at in ((2, 2, 3), (3, 1, 5)):
        request = write_request(tmp_path, "add-site", replicas=replicas, now=float(cluster))
        mark_done(tmp_path, request, Decision(APPLIED, "", cluster), applied_at)
        mark_joined(tmp_path, request.id, f"c{cluster}", applied_at + 1, "run1")
    if drain_c2:
        drain = write_request(tmp_path, "drain", "c2", now=9.0)
        mark_done(tmp_path, drain, Decision(APPLIED, "", 2), 8)


def test_a_resumed_run_starts_its_added_sites_again_one_after_the_other_in_the_order_added(world, tmp_path):
    _added_in_an_earlier_run(tmp_path, drain_c2=False)
    events: list[dict] = []
    resumed, roster = _supervisor(tmp_path, events, SimpleNamespace(run_id="run2", replica_indices={}, identity={}))
    assert [s[0] for s in world.started] == ["hsgd:run2:c2r0", "hsgd:run2:c2r1"], "c3 waits for c2 (its index)"
    world.up("hsgd:run2:c2r0", "hsgd:run2:c2r1")
    assert resumed.at_round_start(9).clusters == 3  # c2 in; c3 starts now
    assert [s[0] for s in world.started][2:] == ["hsgd:run2:c3r0"] and world.started[2][4]["c3r0"] == 6
    world.up("hsgd:run2:c3r0")
    assert resumed.at_round_start(10).sizes == (2, 2, 2, 1)
    assert [e["cluster"] for e in events if e["event"] == "site_up"] == ["c2", "c3"]


def test_a_resumed_run_keeps_a_drained_added_site_drained_and_starts_the_site_added_after_it(world, tmp_path):
    _added_in_an_earlier_run(tmp_path, drain_c2=True)
    events: list[dict] = []
    resumed, roster = _supervisor(tmp_path, events, SimpleNamespace(run_id="run2", replica_indices={}, identity={}))
    assert resumed.topology.clusters == 3 and resumed.drained == {2: 8}  # c2 keeps its index, drained
    assert {"c2r0", "c2r1"} <= roster.gone and "c2r0" not in roster.live
    assert [s[0] for s in world.started] == ["hsgd:run2:c3r0"]  # never c2's
    world.up("hsgd:run2:c3r0")
    assert resumed.at_round_start(9).sizes == (2, 2, 2, 1)
    assert resumed.topology_record()["drained"] == {"c2": 8}


def test_run_json_lists_a_joined_sites_replicas_and_the_drivers_last_write_keeps_them(world, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "run1", "replicas": ["c0r0", "c0r1", "c1r0", "c1r1"]}))
    sites, _ = _supervisor(tmp_path, [], _state())
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    assert json.loads((tmp_path / "run.json").read_text())["replicas"] == ["c0r0", "c0r1", "c1r0", "c1r1"]
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    sites.at_round_start(4)  # joined: listed, the file's other keys kept
    info = json.loads((tmp_path / "run.json").read_text())
    assert info == {"run_id": "run1", "replicas": ["c0r0", "c0r1", "c1r0", "c1r1", "c2r0", "c2r1"]}
    # the driver's own copy (the ids it started) gets them at its last write; another run's joins do not count
    assert site_changes.with_joined_replicas(str(tmp_path), "run1", ["c0r0"]) == ["c0r0", "c2r0", "c2r1"]
    assert site_changes.with_joined_replicas(str(tmp_path), "run2", ["c0r0"]) == ["c0r0"]


# -- a new replica that dies for good before it is up ------------------------------------------------------
def test_a_replica_dead_for_good_before_it_is_up_is_started_again_under_its_name_and_the_site_joins_whole(
    world, tmp_path
):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0")
    world.die("hsgd:run1:c2r1")
    assert sites.at_round_start(4).clusters == 2  # not up: started again, never waited for
    assert [s[0] for s in world.started] == ["hsgd:run1:c2r0", "hsgd:run1:c2r1", "hsgd:run1:c2r1"]
    assert world.started[2][4]["c2r1"] == 5 and world.started[2][1]["lifetime"] == "detached"  # its own index
    world.up("hsgd:run1:c2r1")  # the new actor under that name
    assert sites.at_round_start(5).clusters == 3 and {"c2r0", "c2r1"} <= set(roster.live) and not roster.gone
    [up] = [e for e in events if e["event"] == "site_up"]
    assert up["replicas"] == ["c2r0", "c2r1"] and not [e for e in events if e["event"] == "site_abandoned"]


def test_once_the_re_creations_are_spent_the_site_joins_with_the_replicas_up_when_they_keep_its_floor(
    world, tmp_path, capsys
):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0")
    for r in range(4, 7):  # faults.max_restarts=3 re-creations for the site, each dead for good again
        world.die("hsgd:run1:c2r1")
        assert sites.at_round_start(r).clusters == 2, f"round {r}: joined while c2r1 may still come"
    assert [s[0] for s in world.started].count("hsgd:run1:c2r1") == 4  # the first, then 3 re-creations
    world.die("hsgd:run1:c2r1")
    topology = sites.at_round_start(7)  # lost; c2r0 alone keeps the floor (min_replicas_per_cluster=1)
    assert topology.clusters == 3 and topology.sizes == (2, 2, 2)
    assert "c2r0" in roster.live and "c2r1" not in roster.live and roster.gone == {"c2r1"}
    assert roster.names["c2r1"] == "hsgd:run1:c2r1"  # a successor finds (and misses) it by name
    assert roster.given_up == ["hsgd:run1:c2r1"], "its deaths before the join would count as the run's faults"
    [up] = [e for e in events if e["event"] == "site_up"]
    assert up["replicas"] == ["c2r0"] and up["round"] == 7
    err = capsys.readouterr().err
    assert "re-creation 3 of 3" in err and "without c2r1 (died for good)" in err
    assert len(world.started) == 5 and not world.killed  # nothing stopped: it joined


def test_a_site_below_its_floor_is_abandoned_stopped_once_and_a_later_add_site_goes_on(world, tmp_path, capsys):
    events: list[dict] = []
    state = _state()
    sites, roster = _supervisor(tmp_path, events, state)
    first = write_request(tmp_path, "add-site", replicas=1, now=1.0)
    sites.at_round_start(3)
    for r in range(4, 7):
        world.die("hsgd:run1:c2r0")
        sites.at_round_start(r)
    refused = write_request(tmp_path, "add-site", replicas=1, now=2.0)  # asked while c2 still starts
    world.die("hsgd:run1:c2r0")
    assert sites.at_round_start(7).clusters == 2  # abandoned: the run goes on as it was
    [gave_up] = [e for e in events if e["event"] == "site_abandoned"]
    assert (gave_up["cluster"], gave_up["round"]) == ("c2", 7), gave_up
    assert gave_up["reason"] == "0 of 1 replica(s) up, below its floor of 1: c2r0 died for good after 3 re-creation(s)"
    assert "\n" not in gave_up["reason"] and "site c2 abandoned at round 7's start" in capsys.readouterr().err
    assert world.killed == ["hsgd:run1:c2r0"] and world.groups_removed == ["hsgd:run1:site-c2"]
    assert set(abandoned(tmp_path)) == {first.id} and not joined(tmp_path)
    assert "c2r0" not in roster.live and "c2r0" not in roster.names  # never in the run
    assert [e["outcome"] for e in events if e["event"] == "site_request"] == [APPLIED, REFUSED]
    assert next(e for e in events if e.get("id") == refused.id)["reason"].endswith("(one site starts at a time)")

    again = write_request(tmp_path, "add-site", replicas=1, now=3.0)  # no longer "still starting"
    sites.at_round_start(8)
    assert outcomes(tmp_path)[again.id]["outcome"] == APPLIED
    assert outcomes(tmp_path)[again.id]["cluster"] == "c2"  # the abandoned index: it never was in the topology
    assert world.started[-1][0] == "hsgd:run1:c2r0" and world.started[-1][4]["c2r0"] == 4
    starts = len(world.started)
    restarted, _ = _supervisor(tmp_path, events, state)  # finds the new site's replica, never the abandoned one
    assert len(world.started) == starts
    world.up("hsgd:run1:c2r0")
    assert restarted.at_round_start(9).clusters == 3
    assert restarted.topology_record()["history"] == [
        {"round": 3, "kind": "add-site", "cluster": "c2", "joined": None, "abandoned": 7},
        {"round": 8, "kind": "add-site", "cluster": "c2", "joined": 9},
    ]


def test_a_site_whose_first_commit_is_the_runs_last_round_is_logged_committed_at_the_runs_end(world, tmp_path):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "add-site", replicas=2)
    sites.at_round_start(3)
    world.up("hsgd:run1:c2r0", "hsgd:run1:c2r1")
    sites.at_round_start(5)  # joins at the last round's start (train.rounds=6)
    roster.live.update({rid: (6, 24) for rid in roster.live})  # round 5 committed by all: the run ends
    record = sites.at_run_end()
    [committed] = [e for e in events if e["event"] == "site_committed"]
    assert (committed["cluster"], committed["round"], committed["replicas"]) == ("c2", 5, ["c2r0", "c2r1"])
    assert record == sites.topology_record() and record["sizes"] == [2, 2, 2]
    sites.at_run_end()  # once
    assert len([e for e in events if e["event"] == "site_committed"]) == 1


# -- placed as a cluster is (actors/placement.py site_options), Ray's group calls faked ------------------------
def _placement_cfg(strategy: str = "STRICT_PACK", k: int = 1):
    return OmegaConf.create(
        {
            "topology": {
                "clusters": 2,
                "replicas_per_cluster": 2,
                "sites": [],
                "cluster_labels": [],
                "cpus_per_replica": 1.0,
                "gpus_per_replica": k,
                "placement_strategy": strategy,
                "spares_per_cluster": 0,
            }
        }
    )


@pytest.fixture
def groups(monkeypatch):
    made: list[dict] = []

    def missing(name):
        raise ValueError(name)

    monkeypatch.setattr(placement, "get_placement_group", missing)
    monkeypatch.setattr(
        placement,
        "placement_group",
        lambda bundles, **kw: made.append({"bundles": bundles, **kw}) or SimpleNamespace(id=len(made)),
    )
    monkeypatch.setattr(
        placement,
        "PlacementGroupSchedulingStrategy",
        lambda placement_group, placement_group_bundle_index: (placement_group.id, placement_group_bundle_index),
    )
    return made


def test_a_new_site_gets_a_detached_group_of_its_own_one_bundle_per_replica(groups):
    options = placement.site_options(_placement_cfg(), 0.0, 2, None, "hsgd:run1:site-c2")
    [group] = groups
    assert group == {
        "bundles": [{"CPU": 1.0}, {"CPU": 1.0}],
        "name": "hsgd:run1:site-c2",
        "lifetime": "detached",
        "strategy": "STRICT_PACK",
    }
    assert [o["scheduling_strategy"] for o in options] == [(1, 0), (1, 1)] and options[0]["num_cpus"] == 1.0


def test_a_labelled_site_is_placed_by_its_label_and_one_with_no_strategy_anywhere(groups):
    labelled = placement.site_options(_placement_cfg(), 0.0, 2, "rack-b", "g")
    assert [o["label_selector"] for o in labelled] == [{"hsgd-cluster": "rack-b"}] * 2
    anywhere = placement.site_options(_placement_cfg("NONE"), 0.0, 1, None, "g")
    assert anywhere == [{"num_cpus": 1.0, "num_gpus": 0}] and not groups


def test_a_labelled_site_of_k_rank_replicas_keeps_each_replica_in_one_bundle_on_its_label(groups):
    options = placement.site_options(_placement_cfg(k=2), 0.0, 2, "rack-b", "g")
    [group] = groups
    assert group["strategy"] == "PACK" and group["bundles"] == [{"CPU": 2.0}] * 2
    assert group["bundle_label_selector"] == [{"hsgd-cluster": "rack-b"}] * 2 and options[1]["num_cpus"] == 1.0


# -- issue 45 finding 5: a site's room and its join deadline ---------------------------------------------------
def test_the_placement_strategy_a_new_site_is_checked_with_is_the_one_its_group_gets():
    assert placement.site_strategy(_placement_cfg(), None) == "STRICT_PACK"
    assert placement.site_strategy(_placement_cfg("SPREAD"), None) == "SPREAD"
    assert placement.site_strategy(_placement_cfg(), "rack-b") == "NONE"  # a label selector per replica
    assert placement.site_strategy(_placement_cfg("NONE"), None) == "NONE"
    assert placement.site_strategy(_placement_cfg(k=2), "rack-b") == "PACK"  # k ranks: a PACK group on the label
    assert placement.site_strategy(_placement_cfg("NONE", k=2), None) == "PACK"


def test_a_site_not_up_within_the_join_deadline_is_abandoned_its_group_released_and_a_later_add_site_goes_on(
    world, tmp_path, capsys
):
    from hsgd.core.site_rules import join_overdue

    assert not join_overdue(100.0, 699.0, 600.0) and join_overdue(100.0, 700.0, 600.0)
    now = [1000.0]
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state(), clock=lambda: now[0])
    write_request(tmp_path, "add-site", replicas=2, now=1.0)
    sites.at_round_start(3)  # started; its group is never placed: no answer, no death
    world.up("hsgd:run1:c2r0")
    now[0] += 599.0
    assert sites.at_round_start(4).clusters == 2 and not [e for e in events if e["event"] == "site_abandoned"]
    now[0] += 1.0  # supervisor.join_timeout_s=600 since it was applied
    assert sites.at_round_start(5).clusters == 2
    [gave_up] = [e for e in events if e["event"] == "site_abandoned"]
    assert (gave_up["cluster"], gave_up["round"]) == ("c2", 5) and "\n" not in gave_up["reason"]
    assert "supervisor.join_timeout_s=600" in gave_up["reason"] and "1 of 2" in gave_up["reason"]
    assert sorted(world.killed) == ["hsgd:run1:c2r0", "hsgd:run1:c2r1"]
    assert world.groups_removed == ["hsgd:run1:site-c2"]
    assert "c2r0" not in roster.live and "site c2 abandoned at round 5's start" in capsys.readouterr().err
    again = write_request(tmp_path, "add-site", replicas=1, now=2.0)  # no longer refused as "still starting"
    sites.at_round_start(6)
    assert outcomes(tmp_path)[again.id]["outcome"] == APPLIED and outcomes(tmp_path)[again.id]["cluster"] == "c2"


def test_the_join_deadline_is_a_checked_config_key():
    from hsgd.config import ConfigError, HsgdConfig, validate
    from tests.fakes.configs import default_cfg

    assert HsgdConfig().supervisor.join_timeout_s == 600.0
    for bad in (0, -1.0, 1e8):  # > 0 seconds, below what a sleep overflows at
        with pytest.raises(ConfigError, match=r"^supervisor\.join_timeout_s: "):
            validate(default_cfg(**{"supervisor.join_timeout_s": bad}))


# -- issue 45 finding 9: a drain gives its site's room back ----------------------------------------------------
def test_a_drain_releases_the_sites_placement_group_after_its_replicas_are_stopped(world, tmp_path):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, _state())
    write_request(tmp_path, "drain", "c1")
    sites.at_round_start(3)
    assert roster.drained_clusters == {1}
    assert world.groups_removed == ["hsgd:run1:site-c1"]  # the driver's group of c1, named for the run
    # a resumed run keeps c1 drained: its driver placed c1 again, released at the first round's start
    # (not in the constructor: the driver's start-up calls to c1's replicas may still be in flight)
    world.groups_removed.clear()
    resumed, _ = _supervisor(tmp_path, events, SimpleNamespace(run_id="run2", replica_indices={}, identity={}))
    assert world.groups_removed == []
    resumed.at_round_start(4)
    assert world.groups_removed == ["hsgd:run2:site-c1"]


def test_the_drivers_cluster_groups_are_named_for_the_run_so_a_drain_finds_its_own():
    specs = placement.group_specs(_placement_cfg(), 0.0, run_id="run1")
    assert [s["name"] for s in specs] == [placement.site_group_name("run1", c) for c in range(2)]
    assert placement.site_group_name("run1", 1) == site_changes.site_group_name("run1", 1) == "hsgd:run1:site-c1"


# -- issue 45 finding 10: a resume with fewer clusters than an added site needs ----------------------------------
def _clusters(n: int):
    return OmegaConf.merge(CFG, {"topology": {"clusters": n}})


def _resumed(n: int) -> SimpleNamespace:
    return SimpleNamespace(run_id="run2", replica_indices={}, identity={})


def test_a_resume_too_small_for_an_added_site_says_so_once_before_any_actor_and_a_later_add_site_is_refused(
    world, tmp_path, capsys
):
    _added_in_an_earlier_run(tmp_path, drain_c2=False)  # run1: c0, c1 configured; c2 (2), c3 (1) added
    # the resume configures one cluster: c2 and c3 start only right after c1, which this run lacks
    line = site_plan.resume_notice(str(tmp_path), clusters=1)
    assert line is not None and "\n" not in line and "c2" in line and "c3" in line and "topology" in line
    events: list[dict] = []
    resumed, roster = _supervisor(tmp_path, events, _resumed(1), cfg=_clusters(1))
    assert resumed.topology.clusters == 1 and world.started == []  # nothing started, nothing said again
    later = write_request(tmp_path, "add-site", replicas=1, now=10.0)
    resumed.at_round_start(9)
    assert outcomes(tmp_path)[later.id]["outcome"] == REFUSED, "applied, though it can never start"
    assert world.started == [] and resumed.topology.clusters == 1
    assert "not started" not in capsys.readouterr().err  # the driver's line was the one line
    # a resume that configures the sites before them starts them: no line
    assert site_plan.resume_notice(str(tmp_path), clusters=2) is None


def test_a_resume_of_another_size_with_a_drained_added_site_builds_its_topology(world, tmp_path):
    _added_in_an_earlier_run(tmp_path, drain_c2=True)  # c2 added then drained, c3 added
    # one cluster: c2 and c3 cannot start (c3's line only: c2 is drained, it never trains again)
    line = site_plan.resume_notice(str(tmp_path), clusters=1)
    assert line is not None and "c3" in line and "c2" not in line
    resumed, _ = _supervisor(tmp_path, [], _resumed(1), cfg=_clusters(1))
    assert resumed.topology.clusters == 1 and world.started == []
    # three clusters: the config's c2 is the drained one's index, kept drained; c3 starts after it
    resumed, roster = _supervisor(tmp_path, [], _resumed(3), cfg=_clusters(3))
    assert resumed.topology.clusters == 3 and roster.drained_clusters == {2}
    assert [s[0] for s in world.started] == ["hsgd:run2:c3r0"]


def test_a_resumed_site_abandoned_before_the_next_strands_those_after_it_and_no_add_site_is_applied_unstarted(
    world, tmp_path, capsys
):
    _added_in_an_earlier_run(tmp_path, drain_c2=False)
    now = [0.0]
    resumed, _ = _supervisor(tmp_path, [], _resumed(2), clock=lambda: now[0])
    assert [s[0] for s in world.started] == ["hsgd:run2:c2r0", "hsgd:run2:c2r1"]
    now[0] = 600.0  # c2 never comes up: abandoned; c3 cannot take index 3 after c1
    assert resumed.at_round_start(9).clusters == 2
    assert "site(s) c3 not started: the next cluster is c2" in capsys.readouterr().err
    later = write_request(tmp_path, "add-site", replicas=1, now=10.0)
    resumed.at_round_start(10)
    assert outcomes(tmp_path)[later.id]["outcome"] == REFUSED and "c3" in outcomes(tmp_path)[later.id]["reason"]
    assert [s[0] for s in world.started] == ["hsgd:run2:c2r0", "hsgd:run2:c2r1"]
