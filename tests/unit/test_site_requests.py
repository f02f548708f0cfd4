"""Site requests (issue 37, drain and add-site): the request file, its decision, applied once across a
supervisor restart, and each refusal. Pure and fast: no Ray run (the actors' SiteChanges is driven
with a recording roster and log; its ray.kill calls get no handle)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from actors.site_changes import SiteChanges
from hsgd.core.site_requests import (
    APPLIED,
    REFUSED,
    RequestError,
    SiteRequest,
    drained,
    mark_done,
    outcomes,
    pending,
    requests_dir,
    write_request,
)
from hsgd.core.site_rules import add_site_problem, decide, next_cluster
from hsgd.core.topology import Topology
from jobs import status as status_job
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster
from tests.fakes.run_folders import hold_run_folder


# -- the request file ---------------------------------------------------------------------------------
def test_a_request_is_one_whole_file_with_a_unique_id_in_its_name_and_content(tmp_path):
    first = write_request(tmp_path, "drain", "c2", now=1000.0)
    second = write_request(tmp_path, "drain", "c2", now=1000.0)
    assert first.id != second.id
    files = sorted(p.name for p in requests_dir(tmp_path).iterdir())
    assert files == sorted([f"{first.id}.json", f"{second.id}.json"])  # no temp file left behind
    content = json.loads((requests_dir(tmp_path) / f"{first.id}.json").read_text())
    assert content == {"id": first.id, "kind": "drain", "cluster": "c2", "t": 1000.0}


@pytest.mark.parametrize(
    "kind, cluster, named",
    [("add", "c1", "kind"), ("drain", "2", "cluster"), ("drain", "c-1", "cluster"), ("drain", "", "cluster")],
)
def test_a_request_that_cannot_be_valid_is_not_written(tmp_path, kind, cluster, named):
    with pytest.raises(RequestError, match=named):
        write_request(tmp_path, kind, cluster)
    assert not requests_dir(tmp_path).exists() or not any(requests_dir(tmp_path).iterdir())


def test_pending_is_oldest_first_without_decided_ones_and_empty_without_a_folder(tmp_path):
    assert pending(tmp_path) == [] and outcomes(tmp_path) == {}
    late = write_request(tmp_path, "drain", "c1", now=2000.0)
    early = write_request(tmp_path, "drain", "c2", now=1000.0)
    (requests_dir(tmp_path) / ".x.json.tmp-1234").write_text("{half")  # a writer mid-rename: never read
    assert [r.id for r in pending(tmp_path)] == [early.id, late.id]
    mark_done(tmp_path, early, decide(early, clusters=3, drained_clusters={}, min_clusters=1), 4)
    assert [r.id for r in pending(tmp_path)] == [late.id]
    assert drained(outcomes(tmp_path)) == {2: 4}


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "unreadable"),
        ("[1]", "not a JSON object"),
        ('{"id": "r1", "kind": "join", "cluster": "c1", "t": 1}', "kind"),
        ('{"id": "r1", "kind": "drain", "cluster": 3, "t": 1}', "cluster"),
        ('{"id": "other", "kind": "drain", "cluster": "c1", "t": 1}', "file name"),
    ],
)
def test_a_malformed_request_file_is_refused_with_its_reason(tmp_path, text, problem):
    requests_dir(tmp_path).mkdir()
    (requests_dir(tmp_path) / "r1.json").write_text(text)
    [request] = pending(tmp_path)
    decision = decide(request, clusters=3, drained_clusters={}, min_clusters=1)
    assert decision.outcome == REFUSED and problem in decision.reason


# -- decisions ------------------------------------------------------------------------------------------
def _drain(cluster: str) -> SiteRequest:
    return SiteRequest(id="x", kind="drain", cluster=cluster, t=0.0)


@pytest.mark.parametrize(
    "cluster, drained_clusters, clusters, min_clusters, reason",
    [
        ("c3", {}, 3, 1, "no such cluster; valid: c0..c2"),
        ("c1", {1: 2}, 3, 1, "already drained"),
        ("c0", {1: 2}, 2, 1, "last live site"),
        ("c0", {}, 1, 1, "last live site"),
        ("c2", {}, 3, 3, "would leave 2 site(s), below supervisor.min_clusters=3"),
    ],
)
def test_each_refusal_gives_one_line(cluster, drained_clusters, clusters, min_clusters, reason):
    decision = decide(_drain(cluster), clusters=clusters, drained_clusters=drained_clusters, min_clusters=min_clusters)
    assert decision.outcome == REFUSED and reason in decision.reason and "\n" not in decision.reason


def test_a_drain_counts_the_sites_that_are_live_not_those_configured():
    # c0 is down (no live replica): draining c1 would leave no live site, even though c0 is not drained
    decision = decide(_drain("c1"), clusters=2, drained_clusters={}, min_clusters=1, live_clusters={1})
    assert decision.outcome == REFUSED and "last live site" in decision.reason
    decision = decide(_drain("c2"), clusters=3, drained_clusters={}, min_clusters=2, live_clusters={0, 2})
    assert decision.outcome == REFUSED and "would leave 1 site(s)" in decision.reason


def test_a_drain_that_leaves_enough_sites_is_applied():
    decision = decide(_drain("c2"), clusters=3, drained_clusters={}, min_clusters=2)
    assert (decision.outcome, decision.cluster) == (APPLIED, 2)


# -- carried out by the supervisor, once ------------------------------------------------------------------


def _supervisor(tmp_path, events: list[dict], min_clusters: int = 1):
    topology = Topology(3, 2)
    roster = FakeRoster(topology, spares={"2": ["spare-c2-0"]})  # no actors: nothing for ray.kill
    cfg = SimpleNamespace(
        supervisor=SimpleNamespace(min_clusters=min_clusters, min_replicas_per_cluster=1, join_timeout_s=600.0),
        run=SimpleNamespace(io_grace_s=4.0),
        topology=SimpleNamespace(placement_strategy="STRICT_PACK", gpus_per_replica=1, sites=[]),
    )
    return SiteChanges(cfg, str(tmp_path), topology, roster, EventLog(events)), roster


def test_a_drain_stops_the_site_once_and_a_restarted_supervisor_never_applies_it_again(tmp_path, capsys):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)
    request = write_request(tmp_path, "drain", "c2")
    sites.at_round_start(3)
    assert roster.drained_clusters == {2} and roster.aside == ["c2r0", "c2r1"]
    assert set(roster.live) == {"c0r0", "c0r1", "c1r0", "c1r1"}
    assert roster.spares.handles == {"spare-c2-0": None} and not roster.spares.ready
    [event] = [e for e in events if e["event"] == "site_request"]
    assert (event["id"], event["outcome"], event["cluster"], event["round"]) == (request.id, APPLIED, "c2", 3)
    assert f"site request {request.id}: applied at round 3" in capsys.readouterr().err
    assert sites.topology_record()["drained"] == {"c2": 3}
    sites.at_round_start(4)  # decided: never again
    # a restart after the effect: the new supervisor stops c2 again (a no-op), decides nothing, logs nothing
    restarted, roster2 = _supervisor(tmp_path, events)
    restarted.at_round_start(5)
    assert roster2.drained_clusters == {2} and roster2.aside == ["c2r0", "c2r1"]
    assert len([e for e in events if e["event"] == "site_request"]) == 1
    assert restarted.topology_record()["drained"] == {"c2": 3}


def test_a_restart_between_the_outcome_and_its_event_logs_the_event_once(tmp_path):
    request = write_request(tmp_path, "drain", "c1")
    mark_done(tmp_path, request, decide(request, clusters=3, drained_clusters={}, min_clusters=1), 2)
    events: list[dict] = []  # the predecessor died before logging it
    _supervisor(tmp_path, events)
    _supervisor(tmp_path, events)
    assert [(e["id"], e["round"]) for e in events if e["event"] == "site_request"] == [(request.id, 2)]


def test_a_restart_before_the_decision_decides_it_once(tmp_path):
    request = write_request(tmp_path, "drain", "c0")
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)  # a supervisor that dies before a round start reads it
    assert roster.drained_clusters == set() and not events
    restarted, roster2 = _supervisor(tmp_path, events)
    restarted.at_round_start(6)
    assert roster2.drained_clusters == {0}
    assert [(e["id"], e["outcome"]) for e in events] == [(request.id, APPLIED)]


def test_refusals_leave_every_site_running_and_the_run_goes_on(tmp_path, capsys):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events, min_clusters=2)
    write_request(tmp_path, "drain", "c7", now=1.0)
    write_request(tmp_path, "drain", "c1", now=2.0)  # applied: leaves 2
    write_request(tmp_path, "drain", "c1", now=3.0)  # already drained
    write_request(tmp_path, "drain", "c0", now=4.0)  # would leave 1 < min_clusters=2
    sites.at_round_start(1)
    decided = [(e["cluster"], e["outcome"]) for e in events]
    assert decided == [("c7", REFUSED), ("c1", APPLIED), ("c1", REFUSED), ("c0", REFUSED)]
    reasons = [e["reason"] for e in events]
    assert "no such cluster" in reasons[0] and "already drained" in reasons[2] and "min_clusters=2" in reasons[3]
    assert roster.drained_clusters == {1} and len(capsys.readouterr().err.strip().splitlines()) == 4
    assert pending(tmp_path) == []


def test_no_requests_folder_changes_nothing(tmp_path):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)
    sites.at_round_start(0)
    assert not events and roster.drained_clusters == set() and not requests_dir(tmp_path).exists()
    assert sites.topology_record() == Topology(3, 2).describe()


# -- the command line ---------------------------------------------------------------------------------------
def test_jobs_status_drain_site_writes_one_request_and_refuses_bad_input(tmp_path, capsys):
    lock = hold_run_folder(tmp_path)  # a running run's folder (issue 45 finding 3: a request goes nowhere else)
    assert status_job.main([str(tmp_path), "drain-site", "c2"]) == 0
    [request] = pending(tmp_path)
    assert (request.kind, request.cluster) == ("drain", "c2") and request.id in capsys.readouterr().out
    assert status_job.main([str(tmp_path), "drain-site", "two"]) == 2
    assert "cluster 'two' is not a cluster name" in capsys.readouterr().err
    assert status_job.main([str(tmp_path / "missing"), "drain-site", "c1"]) == 2
    assert len(pending(tmp_path)) == 1
    lock.release()


# -- the roster: a drained site's deaths are none -----------------------------------------------------------
def test_the_deaths_of_a_drained_sites_replicas_and_spares_are_never_logged_or_returned(monkeypatch, tmp_path):
    import actors.roster as roster_mod
    from hsgd.record.run_state import RunState
    from tests.fakes.actor_table import Table

    monkeypatch.setattr(roster_mod, "lookup", lambda actor_name: object())
    table = Table()
    for short in ("c0r0", "c1r0", "spare-c0-0", "spare-c1-0"):
        table.set(short, "ALIVE", 0)
    roster = roster_mod.Roster(
        Topology(2, 1), "run-1", RunState(), EventLog(), call_timeout_s=1.0, spares_per_cluster=1, save=lambda: None
    )
    roster.watch._table = table
    for rid in ("c0r0", "c1r0"):
        roster.admit(rid, {"round": 0, "step": 0, "pid": 100, "incarnation": 0})
    cfg = SimpleNamespace(
        supervisor=SimpleNamespace(min_clusters=1, min_replicas_per_cluster=1), run=SimpleNamespace(io_grace_s=4.0)
    )
    sites = SiteChanges(cfg, str(tmp_path), Topology(2, 1), roster, EventLog())
    write_request(tmp_path, "drain", "c1")
    monkeypatch.setattr("actors.site_changes.ray.kill", lambda handle, no_restart: None)
    sites.at_round_start(2)
    for short in ("c1r0", "spare-c1-0", "c0r0"):
        table.set(short, "DEAD", 0)  # the drained site stopped; c0r0 dies for real
    assert roster.deaths(roster.live, 2, "inner") == ["c0r0"]
    assert [d["rid"] for d in roster.log.named("replica_down")] == ["c0r0"] and not roster.log.named("spare_lost")
    assert "c1r0" not in roster.missing() and roster.promote_spare("c1r0") is None


# -- add-site (issue 37, join slice): the request and its refusals (the join itself: test_site_join.py) ------
def test_an_add_site_request_is_one_file_with_its_fields_and_no_cluster(tmp_path):
    request = write_request(tmp_path, "add-site", replicas=2, label="rack-a", name="berlin", now=1000.0)
    content = json.loads((requests_dir(tmp_path) / f"{request.id}.json").read_text())
    assert content == {
        "id": request.id,
        "kind": "add-site",
        "cluster": "",
        "t": 1000.0,
        "replicas": 2,
        "label": "rack-a",
        "name": "berlin",
    }
    [read] = pending(tmp_path)
    assert (read.kind, read.replicas, read.label, read.name, read.problem) == ("add-site", 2, "rack-a", "berlin", None)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"replicas": 0}, "replicas=0"),
        ({"replicas": "2"}, "replicas='2'"),
        ({"replicas": True}, "replicas=True"),
        ({"replicas": None}, "replicas=None"),
        ({"replicas": 2, "label": "rack a"}, "label='rack a'"),
        ({"replicas": 2, "name": ""}, "name=''"),
        ({"replicas": 2, "cluster": "c3"}, "names no cluster"),
    ],
)
def test_an_add_site_that_cannot_be_valid_is_not_written(tmp_path, fields, named):
    fields = dict(fields)
    cluster = fields.pop("cluster", "")
    with pytest.raises(RequestError, match=re.escape(named)) as err:
        write_request(tmp_path, "add-site", cluster, **fields)
    assert "\n" not in str(err.value) and "valid" in str(err.value)
    assert not requests_dir(tmp_path).exists() or not any(requests_dir(tmp_path).iterdir())


@pytest.mark.parametrize(
    "body, problem",
    [
        ({"replicas": -1}, "replicas=-1"),
        ({"replicas": 2, "cluster": "c1"}, "names no cluster"),
        ({"replicas": 2, "label": 7}, "label=7"),
    ],
)
def test_a_malformed_add_site_file_is_refused_with_its_reason(tmp_path, body, problem):
    requests_dir(tmp_path).mkdir()
    (requests_dir(tmp_path) / "r1.json").write_text(
        json.dumps({"id": "r1", "kind": "add-site", "cluster": "", "t": 1, **body})
    )
    [request] = pending(tmp_path)
    assert request.problem is not None and problem in request.problem


def test_a_new_site_gets_the_next_free_index_never_a_drained_sites():
    assert next_cluster(3, {}) == 3
    drained_c2 = {"a": {"kind": "drain", "cluster": "c2", "outcome": APPLIED, "round": 1}}
    assert next_cluster(3, drained_c2) == 3  # c2 left: its index stays its own
    added = {
        "b": {"kind": "add-site", "cluster": "c3", "outcome": APPLIED, "round": 2},
        "c": {"kind": "add-site", "cluster": "c9", "outcome": REFUSED, "round": 2},
    }
    assert next_cluster(3, {**drained_c2, **added}) == 4


_NEED = {"CPU": 2.0}
_NODES = [
    {"NodeID": "n1", "Alive": True, "Labels": {"hsgd-cluster": "rack-a"}},
    {"NodeID": "n2", "Alive": True, "Labels": {}},
    {"NodeID": "n3", "Alive": False, "Labels": {"hsgd-cluster": "rack-dead"}},
]


def _add(replicas: int, label: str | None = None) -> SiteRequest:
    return SiteRequest(id="x", kind="add-site", cluster="", t=0.0, replicas=replicas, label=label)


@pytest.mark.parametrize(
    "request_, free, reason",
    [
        (_add(1, "rack-z"), {"n1": {"CPU": 8}}, "label 'rack-z' has no live node (hsgd-cluster); live labels: rack-a"),
        (_add(1, "rack-dead"), {"n3": {"CPU": 8}}, "label 'rack-dead' has no live node"),
        (
            _add(2, "rack-a"),
            {"n1": {"CPU": 3.0}, "n2": {"CPU": 8.0}},
            "no room: label 'rack-a''s nodes have free resources for 1 replica(s) of CPU=2 each",
        ),
        (
            _add(5),
            {"n1": {"CPU": 4.0}, "n2": {"CPU": 5.9}, "n3": {"CPU": 99}},
            "no room: the live nodes have free resources for 4 replica(s)",
        ),
    ],
)
def test_each_add_site_refusal_gives_one_line(request_, free, reason):
    problem = add_site_problem(request_, nodes=_NODES, free=free, need=_NEED, new_cluster=3, strategy="PACK")
    assert problem is not None and problem.startswith("add-site c3 (") and reason in problem and "\n" not in problem


def test_an_add_site_that_fits_has_no_problem():
    assert (
        add_site_problem(
            _add(2, "rack-a"), nodes=_NODES, free={"n1": {"CPU": 4.0}}, need=_NEED, new_cluster=3, strategy="NONE"
        )
        is None
    )
    assert (
        add_site_problem(
            _add(4),
            nodes=_NODES,
            free={"n1": {"CPU": 4.0}, "n2": {"CPU": 4.5}},
            need=_NEED,
            new_cluster=3,
            strategy="PACK",
        )
        is None
    )


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"replicas": 1, "label": "rack-z"}, " (1 replica(s)): label 'rack-z'"),
        ({"replicas": 9}, " (9 replica(s)): no room"),
    ],
)
def test_the_supervisor_refuses_an_add_site_that_does_not_fit_and_changes_nothing(
    monkeypatch, tmp_path, capsys, fields, reason
):
    import actors.site_changes as site_changes

    monkeypatch.setattr(site_changes, "cluster_resources", lambda cfg: (_NODES, {"n1": {"CPU": 4}}, _NEED))
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)
    request = write_request(tmp_path, "add-site", **fields)
    sites.at_round_start(3)
    [event] = [e for e in events if e["event"] == "site_request"]
    assert (event["id"], event["kind"], event["outcome"], event["round"]) == (request.id, "add-site", REFUSED, 3)
    assert event["reason"].startswith(f"add-site c3{reason}")
    assert f"site request {request.id}: refused at round 3: add-site c3" in capsys.readouterr().err
    assert roster.drained_clusters == set() and not roster.aside and len(roster.live) == 6
    assert pending(tmp_path) == [] and sites.topology_record() == Topology(3, 2).describe()


def test_an_add_site_is_refused_when_rays_tables_cannot_be_read(monkeypatch, tmp_path):
    import actors.site_changes as site_changes

    def unreadable(cfg):
        raise ConnectionError("GCS unreachable\nsecond line")

    monkeypatch.setattr(site_changes, "cluster_resources", unreadable)
    events: list[dict] = []
    sites, _ = _supervisor(tmp_path, events)
    write_request(tmp_path, "add-site", replicas=1)
    sites.at_round_start(1)
    [event] = events
    assert event["outcome"] == REFUSED
    assert event["reason"] == "add-site c3: cannot read the Ray cluster's nodes: ConnectionError: GCS unreachable"


def test_the_summary_topology_history_lists_every_applied_change_in_order(tmp_path):
    events: list[dict] = []
    sites, _ = _supervisor(tmp_path, events)
    write_request(tmp_path, "drain", "c2", now=1.0)
    sites.at_round_start(2)
    write_request(tmp_path, "drain", "c7", now=2.0)  # refused: not history
    write_request(tmp_path, "drain", "c1", now=3.0)
    sites.at_round_start(5)
    record = sites.topology_record()
    assert record["drained"] == {"c1": 5, "c2": 2}
    assert record["history"] == [
        {"round": 2, "kind": "drain", "cluster": "c2"},
        {"round": 5, "kind": "drain", "cluster": "c1"},
    ]


def test_jobs_status_add_site_writes_one_request_and_refuses_bad_arguments_with_one_line(tmp_path, capsys):
    lock = hold_run_folder(tmp_path)  # a running run's folder (issue 45 finding 3: a request goes nowhere else)
    assert status_job.main([str(tmp_path), "add-site", "replicas=2", "label=rack-a", "name=berlin"]) == 0
    [request] = pending(tmp_path)
    assert (request.kind, request.replicas, request.label, request.name) == ("add-site", 2, "rack-a", "berlin")
    assert request.id in capsys.readouterr().out
    for args, says in (
        (["replicas=two"], "replicas='two' is not a replica count"),
        ([], "replicas=N missing"),
        (["replicas=2", "rack=a"], "argument 'rack=a' unknown"),
        (["replicas=0"], "replicas=0"),
        (["replicas=1", "replicas=2"], "replicas given twice"),
        (["c3"], "argument 'c3' unknown"),
    ):
        assert status_job.main([str(tmp_path), "add-site", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, (args, err)
    assert status_job.main([str(tmp_path / "missing"), "add-site", "replicas=1"]) == 2
    assert len(pending(tmp_path)) == 1
    lock.release()


def test_drill_add_site_writes_the_same_request(tmp_path):
    from actors.drill import Drill, DrillError

    drill = Drill(run_dir=str(tmp_path))
    request_id = drill.add_site(3, label="rack-b")
    [request] = pending(drill.run_dir)
    assert (request.id, request.kind, request.replicas, request.label, request.name) == (
        request_id,
        "add-site",
        3,
        "rack-b",
        None,
    )
    with pytest.raises(DrillError, match="replicas=0"):
        drill.add_site(0)


def test_a_run_folder_that_cannot_be_written_leaves_the_request_pending_and_the_run_going(
    tmp_path, monkeypatch, capsys
):
    from hsgd.core import site_plan

    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)
    request = write_request(tmp_path, "drain", "c2")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(site_plan, "mark_done", full_disk)
    sites.at_round_start(3)  # no exception: the run goes on
    assert roster.drained_clusters == set() and not [e for e in events if e["event"] == "site_request"]
    assert "site requests not read at round 3" in capsys.readouterr().err
    monkeypatch.undo()
    sites.at_round_start(4)  # the disk is back: decided once, now
    assert roster.drained_clusters == {2}
    [event] = [e for e in events if e["event"] == "site_request"]
    assert (event["id"], event["round"]) == (request.id, 4)


# -- issue 45: the request kinds are one enum; the files keep their strings ---------------------------------
def test_the_kinds_are_one_enum_and_the_files_keep_their_strings(tmp_path):
    from pathlib import Path

    from hsgd.core.site_requests import RequestKind

    drain = write_request(tmp_path, RequestKind.DRAIN, "c1", now=1.0)
    add = write_request(tmp_path, "add-site", replicas=1, now=2.0)  # a string still asks (jobs.status)
    on_disk = {r.id: json.loads((requests_dir(tmp_path) / f"{r.id}.json").read_text())["kind"] for r in (drain, add)}
    assert on_disk == {drain.id: "drain", add.id: "add-site"}
    assert [r.kind for r in pending(tmp_path)] == [RequestKind.DRAIN, RequestKind.ADD_SITE]
    record = mark_done(tmp_path, drain, decide(drain, clusters=3, drained_clusters={}, min_clusters=1), 2)
    assert json.loads((requests_dir(tmp_path) / f"{drain.id}.done").read_text())["kind"] == record["kind"] == "drain"
    root = Path(__file__).resolve().parents[2]
    spelled = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("hsgd", "actors")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if '"add-site"' in line or '"drain"' in line
    ]
    assert len(spelled) == 2 and all(s.startswith("hsgd/core/site_requests.py") for s in spelled), spelled


# -- issue 45 finding 1: a drain never takes the last holder of the committed round ------------------------
def test_a_drain_that_would_leave_no_live_site_holding_the_last_committed_round_at_its_floor_is_refused():
    from hsgd.core.site_rules import round_holders

    # finding 1: c0r0 died in round 4 and came back empty (round 0); c1 alone committed round 4 (holds 5)
    topology = Topology(2, 1)
    live = {"c0r0": (0, 0), "c1r0": (5, 0)}
    holders = round_holders(topology, live, drained_clusters={}, default_floor=1)
    assert holders == {1}
    decision = decide(_drain("c1"), clusters=2, drained_clusters={}, min_clusters=1, holders=holders)
    assert decision.outcome == REFUSED and decision.cluster == 1 and "\n" not in decision.reason
    assert "committed round" in decision.reason and "ask again" in decision.reason
    # draining the site that does not hold it is fine: the holder goes on
    assert decide(_drain("c0"), clusters=2, drained_clusters={}, min_clusters=1, holders=holders).outcome == APPLIED
    # a site holding the round but below its floor holds nothing that trains on
    three = Topology.of_sites([2, 2, 1], min_replicas=[2, None, None])
    live = {"c0r0": (5, 0), "c1r0": (3, 0), "c1r1": (3, 0), "c2r0": (5, 0)}  # c0r1 down: c0 below its floor 2
    holders = round_holders(three, live, drained_clusters={}, default_floor=1)
    assert holders == {2}
    assert decide(_drain("c2"), clusters=3, drained_clusters={}, min_clusters=1, holders=holders).outcome == REFUSED
    # a drained site holds nothing; holders=None (not known): the old rule alone
    assert round_holders(three, live, drained_clusters={2: 4}, default_floor=1) == set()
    assert decide(_drain("c2"), clusters=3, drained_clusters={}, min_clusters=1).outcome == APPLIED


def test_the_supervisor_refuses_a_drain_of_the_only_site_holding_the_last_round_and_stops_nothing(tmp_path, capsys):
    events: list[dict] = []
    sites, roster = _supervisor(tmp_path, events)
    roster.live.update({"c0r0": (0, 0), "c0r1": (0, 0), "c1r0": (5, 0), "c1r1": (5, 0), "c2r0": (0, 0)})
    del roster.live["c2r1"]
    write_request(tmp_path, "drain", "c1")
    sites.at_round_start(5)
    [event] = [e for e in events if e["event"] == "site_request"]
    assert event["outcome"] == REFUSED and "committed round 5" in event["reason"], event
    assert roster.drained_clusters == set() and roster.aside == []


# -- issue 45 finding 5: room is checked the way the site's placement group places -------------------------
_TWO_NODES = [{"NodeID": "n1", "Alive": True, "Labels": {}}, {"NodeID": "n2", "Alive": True, "Labels": {}}]
_SPLIT = {"n1": {"CPU": 4.0}, "n2": {"CPU": 4.0}}  # room for 2 + 2 replicas of CPU=2, none for 3 on one node


@pytest.mark.parametrize(
    "strategy, replicas, fits",
    [
        ("STRICT_PACK", 3, False),  # one node must hold the whole site: split room is no room
        ("STRICT_PACK", 2, True),
        ("PACK", 4, True),  # PACK and SPREAD may place bundles on several nodes: the sum
        ("SPREAD", 4, True),
        ("NONE", 4, True),  # each replica placed on its own (a label selector or anywhere)
        ("PACK", 5, False),
        ("STRICT_SPREAD", 2, True),  # one bundle per node: the nodes with room for one
        ("STRICT_SPREAD", 3, False),
    ],
)
def test_an_add_site_has_room_only_where_its_placement_strategy_can_place_it(strategy, replicas, fits):
    problem = add_site_problem(
        _add(replicas), nodes=_TWO_NODES, free=_SPLIT, need=_NEED, new_cluster=3, strategy=strategy
    )
    assert (problem is None) == fits, problem
    if not fits:
        assert "no room" in problem and strategy in problem and "\n" not in problem
