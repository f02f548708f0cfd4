"""Every death seen once (actors/lifecycle.py ActorWatch, actors/roster.py), counted once per
process in summary.json (hsgd/record/metrics.py), and the decision after a supervisor restart
(hsgd/core/deadlines.py StallWatch). Ray's actor table is faked by rows the tests write."""

from __future__ import annotations

import pytest

from actors.lifecycle import ActorWatch, Death
from hsgd.core.deadlines import BUSY, HUNG, IDLE, STUCK, WAITING, StallWatch
from hsgd.record.metrics import fault_figures
from tests.fakes.actor_table import RUN, Table, name  # noqa: F401 — RUN: the run the names carry
from tests.fakes.event_log import EventLog


def watch_of(table: Table, replicas=("c0r0", "c0r1"), spares=None, seen=None) -> ActorWatch:
    identity = {rid: name(rid) for rid in replicas}
    return ActorWatch(identity, spares if spares is not None else {"0": []}, {} if seen is None else seen, table=table)


def deaths(ds: list[Death]) -> list[tuple]:
    return [(d.name.rsplit(":", 1)[1], d.incarnation, d.rid) for d in ds]


# -- the watch -------------------------------------------------------------------------------------
def test_each_incarnation_that_died_is_reported_once_whatever_it_was_doing():
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table)
    assert watch.poll() == [], "nobody died yet"
    table.set("c0r1", "RESTARTING", 1)  # incarnation 0 died (in a call, or idle: the count says so)
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")]
    assert watch.poll() == [], "a death is reported once"
    table.set("c0r1", "ALIVE", 1)
    assert watch.poll() == [], "coming back is no death"
    table.set("c0r1", "RESTARTING", 2)  # incarnation 1 died too: killed again, a second death
    assert deaths(watch.poll()) == [("c0r1", 1, "c0r1")]


def test_deaths_between_two_polls_are_each_reported_and_a_dead_actor_s_last_process_counts():
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table)
    watch.poll()
    table.set("c0r1", "RESTARTING", 2)  # killed, then killed again while Ray restarted it
    table.set("c0r0", "DEAD", 1)  # died twice: restarts exhausted after the second
    assert sorted(deaths(watch.poll())) == [
        ("c0r0", 0, "c0r0"),
        ("c0r0", 1, "c0r0"),
        ("c0r1", 0, "c0r1"),
        ("c0r1", 1, "c0r1"),
    ]


def test_a_death_learned_from_a_call_is_not_reported_again_by_the_table_nor_the_other_way_round():
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table)
    watch.note_up("c0r0", 0)
    watch.note_up("c0r1", 0)
    assert watch.note_death("c0r0") == (name("c0r0"), 0), "the call saw it first: it names the process that died"
    table.set("c0r0", "RESTARTING", 1)
    assert watch.poll() == [], "the table shows the same death: not again"
    assert watch.note_death("c0r0") is None
    table.set("c0r1", "RESTARTING", 1)
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")], "the table saw it first"
    assert watch.note_death("c0r1") is None, "the failed call that follows is the same death"


def test_a_call_names_the_process_that_served_the_replica_and_earlier_unseen_deaths_are_still_reported():
    table = Table()
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table, replicas=("c0r1",))
    watch.poll()
    watch.note_up("c0r1", 1)  # incarnation 0 died unseen and 1 answered before the next poll
    assert watch.note_death("c0r1") == (name("c0r1"), 1)
    table.set("c0r1", "RESTARTING", 2)
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")], "incarnation 1 was reported; 0 was not yet"


def test_a_process_restarted_between_two_questions_is_the_one_declared_dead_not_its_successor():
    table = Table()
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table, replicas=("c0r1",))
    watch.note_up("c0r1", 0)
    watch.note_up("c0r1", 1)  # an idle probe finds a new process: the old one died unseen
    assert watch.note_death("c0r1") == (name("c0r1"), 0), "the death the caller learned is the old process's"
    table.set("c0r1", "ALIVE", 1)
    assert watch.poll() == [], "and the table shows nothing more"
    assert watch.note_death("c0r1") == (name("c0r1"), 1), "the new process's own death, later, is its own"


def test_a_replica_declared_dead_that_answers_again_as_the_same_process_can_still_die():
    table = Table()
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table, replicas=("c0r1",))
    watch.note_up("c0r1", 0)
    assert watch.note_death("c0r1") == (name("c0r1"), 0)  # Ray said unavailable for a moment
    watch.note_up("c0r1", 0)  # the same process answers: it was not dead
    table.set("c0r1", "RESTARTING", 1)
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")], "its real death is not swallowed"


def test_deaths_follow_the_identity_map_through_a_promotion():
    table = Table()
    spares = {"0": [name("spare-c0-0")]}
    watch = watch_of(table, replicas=("c0r0", "c0r1"), spares=spares)
    for short in ("c0r0", "c0r1", "spare-c0-0"):
        table.set(short, "ALIVE", 0)
    watch.note_up("c0r1", 0)
    assert watch.note_death("c0r1") == (name("c0r1"), 0)  # c0r1 died in a call
    table.set("c0r1", "RESTARTING", 1)
    # the spare takes c0r1's id; c0r1's own actor becomes a spare (what Roster.promote_spare does)
    watch.identity["c0r1"] = name("spare-c0-0")
    spares["0"] = [name("c0r1")]
    watch.promoted("c0r1", name("spare-c0-0"), 0, name("c0r1"))
    watch.note_up("c0r1", 0)
    assert watch.poll() == [], "c0r1's death was reported by the call"
    table.set("spare-c0-0", "RESTARTING", 1)  # the promoted spare dies: it dies as c0r1
    table.set("c0r1", "RESTARTING", 2)  # the replaced actor's next process dies as a spare
    got = sorted(watch.poll())
    assert deaths(got) == [("c0r1", 1, None), ("spare-c0-0", 0, "c0r1")]
    assert next(d for d in got if d.rid is None).cluster == 0, "a spare's death names the pool's cluster"


def test_a_spare_that_died_before_it_was_promoted_died_as_a_spare():
    table = Table()
    spares = {"0": [name("spare-c0-0")]}
    watch = watch_of(table, replicas=("c0r1",), spares=spares)
    table.set("c0r1", "ALIVE", 0)
    table.set("spare-c0-0", "ALIVE", 0)
    watch.poll()
    table.set("spare-c0-0", "ALIVE", 1)  # it died and came back between two polls
    watch.identity["c0r1"] = name("spare-c0-0")  # and then took c0r1's id, as incarnation 1
    spares["0"] = [name("c0r1")]
    watch.promoted("c0r1", name("spare-c0-0"), 1, name("c0r1"))
    assert deaths(watch.poll()) == [("spare-c0-0", 0, None)]


def test_what_was_reported_survives_a_supervisor_restart_and_other_runs_actors_are_ignored():
    table = Table()
    table.set("c0r1", "RESTARTING", 1)
    table.rows["hsgd:other-run:c0r1"] = {"Name": "hsgd:other-run:c0r1", "State": "RESTARTING", "NumRestarts": 3}
    durable: dict = {}
    assert deaths(watch_of(table, replicas=("c0r1",), seen=durable).poll()) == [("c0r1", 0, "c0r1")]
    assert watch_of(table, replicas=("c0r1",), seen=durable).poll() == [], (
        "a new supervisor's watch reads what its predecessor reported from the durable state"
    )


def test_an_unreadable_table_reports_nothing_now_and_everything_later():
    table = Table()
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table, replicas=("c0r1",))
    table.set("c0r1", "RESTARTING", 1)
    table.fail = True
    assert watch.poll() == []
    table.fail = False
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")]


def test_a_dead_namesake_that_never_ran_is_not_a_death_of_the_actor_holding_the_name_now():
    """A supervisor SIGKILLed between registering a joining site's replica and creating it leaves a DEAD
    row under that name; its successor creates the replica again under the same name. The CI failure of
    stop 44: the watch read the old row and reported the new, healthy replica dead."""
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    table.add_dead_namesake("c0r1")
    table.set("c0r1", "ALIVE", 0)
    watch = watch_of(table)
    assert watch.poll() == [], "the replica holding the name is alive"
    table.set("c0r1", "DEAD", 0)  # the new one dies for good: that death is reported, once
    assert deaths(watch.poll()) == [("c0r1", 0, "c0r1")]
    assert watch.poll() == []


def test_an_actor_given_up_before_it_served_has_its_earlier_deaths_taken_as_known():
    """A new site's replica the run gave up before it joined (dead for good, its name then in the
    identity map only to keep it out): the deaths its table row shows are not the run's faults."""
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    table.set("c2r1", "DEAD", 10)  # 11 processes died while the site started
    watch = watch_of(table, replicas=("c0r0",))
    watch.given_up(name("c2r1"))
    watch.identity["c2r1"] = name("c2r1")
    assert watch.poll() == [], "deaths from before it was given up"
    table.set("c0r0", "RESTARTING", 1)
    assert deaths(watch.poll()) == [("c0r0", 0, "c0r0")], "the others' deaths are still reported"


def test_the_watch_tells_which_actors_its_last_table_listed():
    """issue 36, Build 2: idle replicas are asked whether they run only while the table cannot tell."""
    table = Table()
    table.set("c0r0", "ALIVE", 0)
    watch = watch_of(table)
    assert not watch.tells(name("c0r0")), "before the first poll nothing is known"
    watch.poll()
    assert watch.tells(name("c0r0")) and not watch.tells(name("c0r1")), "c0r1 is not in the table yet"
    assert not watch.tells(None)
    table.fail = True
    watch.poll()
    assert not watch.tells(name("c0r0")), "an unreadable table tells nothing: the calls come back"


# -- the roster: one replica_down per death, whoever saw it first -----------------------------------
@pytest.fixture
def roster(monkeypatch):
    import actors.roster as roster_mod
    from hsgd.core.topology import Topology
    from hsgd.record.run_state import RunState

    monkeypatch.setattr(roster_mod, "lookup", lambda actor_name: object())
    table = Table()
    for short in ("c0r0", "c0r1", "spare-c0-0"):
        table.set(short, "ALIVE", 0)
    r = roster_mod.Roster(
        Topology(1, 2), "run-1", RunState(), EventLog(), call_timeout_s=1.0, spares_per_cluster=1, save=lambda: None
    )
    r.watch._table = table
    r.table = table
    for rid in ("c0r0", "c0r1"):
        r.admit(rid, {"round": 0, "step": 0, "pid": 100, "incarnation": 0})
    return r


def test_a_death_the_table_shows_is_logged_once_with_its_incarnation_and_returned_when_live(roster):
    roster.table.set("c0r1", "RESTARTING", 1)
    assert roster.deaths(roster.live, 3, "inner") == ["c0r1"], "its live process died: the caller marks it lost"
    downs = roster.log.named("replica_down")
    assert [(d["rid"], d["incarnation"], d["phase"], d["actor"]) for d in downs] == [("c0r1", 0, "inner", name("c0r1"))]
    assert roster.died("c0r1", "died", "inner", 3) is False, "the call that failed with it is the same death"
    assert len(roster.log.named("replica_down")) == 1
    del roster.live["c0r1"]
    roster.table.set("c0r1", "RESTARTING", 2)  # killed again while Ray restarts it
    roster.deaths(roster.live, 3, "inner")
    roster.table.set("c0r1", "ALIVE", 2)
    roster.note_up("c0r1", {"round": 3, "step": 0, "pid": 102, "incarnation": 2})  # back, being healed
    roster.table.set("c0r1", "RESTARTING", 3)
    roster.deaths(roster.live, 3, "inner")
    downs = roster.log.named("replica_down")
    assert [(d["rid"], d["incarnation"], d["phase"]) for d in downs][1:] == [
        ("c0r1", 1, "restarting"),
        ("c0r1", 2, "joining"),
    ], "not live: it died restarting, then joining"


def test_only_the_death_of_the_latest_process_serving_a_replica_is_returned(roster):
    roster.table.set("c0r0", "ALIVE", 1)  # its first process died unseen; the second answered already
    roster.note_up("c0r0", {"round": 0, "step": 0, "pid": 101, "incarnation": 1})
    assert roster.deaths(roster.live, 0, "inner") == [], "an older process: nothing to tell the machine"
    assert [d["incarnation"] for d in roster.log.named("replica_down")] == [0], "but its death is logged"


def test_a_late_death_of_a_replaced_actor_does_not_take_down_the_spare_serving_its_id(roster, monkeypatch):
    import actors.roster as roster_mod

    monkeypatch.setattr(roster_mod.ray, "get", lambda ref, timeout=None: ref)
    spare = name("spare-c0-0")

    class Handle:
        class assume:
            @staticmethod
            def remote(rid):
                return {"outcome": "done", "rid": rid, "round": 0, "step": 0, "pid": 200, "incarnation": 0}

    roster.spares.handles[spare] = Handle()
    roster.spares.ready.add(spare)
    monkeypatch.setattr("actors.spares.write_identity", lambda *a, **k: None)
    del roster.live["c0r1"]  # c0r1 died in a call the watch has not seen yet ...
    roster.promote_spare("c0r1")  # ... and the spare took its id at once
    roster.note_up("c0r1", {"round": 0, "step": 0, "pid": 200, "incarnation": 0})
    roster.live["c0r1"] = (0, 0)
    roster.table.set("c0r1", "RESTARTING", 1)
    assert roster.deaths(roster.live, 0, "inner") == [], "the spare serving c0r1 is alive"
    downs = roster.log.named("replica_down")
    assert [(d["rid"], d["actor"], d["incarnation"], d["phase"]) for d in downs] == [
        ("c0r1", name("c0r1"), 0, "restarting")
    ]
    roster.table.set("spare-c0-0", "RESTARTING", 1)
    assert roster.deaths(roster.live, 0, "inner") == ["c0r1"], "the spare serving c0r1 died: c0r1 is lost"


def test_a_death_learned_from_a_call_is_logged_once_even_when_the_table_shows_it_later(roster):
    roster.down("c0r0", "died", "inner", 2, "ActorDiedError")
    roster.table.set("c0r0", "RESTARTING", 1)
    assert roster.deaths(roster.live, 2, "inner") == []
    assert [(d["rid"], d["incarnation"]) for d in roster.log.named("replica_down")] == [("c0r0", 0)]


def test_a_replica_that_raised_is_one_error_death_even_when_the_table_shows_the_kill_first(roster, monkeypatch):
    """The race CI found: the runner kills a replica whose call raised, and its next look at Ray's
    actor table (before the machine's deaths are logged) saw the kill as a plain death: `died`."""
    import actors.roster as roster_mod

    killed = []
    monkeypatch.setattr(
        roster_mod.ray,
        "kill",
        lambda handle, no_restart: killed.append(no_restart) or roster.table.set("c0r1", "RESTARTING", 1),
    )
    roster.restart_raised("c0r1", "inner", 0, "InjectedError: c0r1: injected error in inner of round 0")
    assert killed == [False], "restarted clean, not killed for good"
    assert roster.deaths(roster.live, 0, "inner") == [], "logged already; the machine learns it from the answer"
    assert roster.died("c0r1", "error", "inner", 0) is False, "the machine's own record of it is the same death"
    downs = roster.log.named("replica_down")
    assert [(d["rid"], d["cause"], d["incarnation"]) for d in downs] == [("c0r1", "error", 0)]


def test_a_warm_spare_s_death_is_a_spare_lost_and_the_pool_no_longer_counts_it_ready(roster):
    spare = name("spare-c0-0")
    roster.spares.ready.add(spare)
    roster.table.set("spare-c0-0", "RESTARTING", 1)
    assert roster.deaths(roster.live, 1, "inner") == []
    assert [(e["spare"], e["cluster"], e["incarnation"]) for e in roster.log.named("spare_lost")] == [(spare, 0, 0)]
    assert spare not in roster.spares.ready
    assert roster.log.named("replica_down") == [], "a spare serves no replica id"


# -- summary.json: one fault per death ---------------------------------------------------------------
def _down(t, rid, incarnation=None, **more):
    e = {
        "t": t,
        "event": "replica_down",
        "rid": rid,
        "cluster": 0,
        "cause": "died",
        "round": 0,
        "phase": "inner",
        **more,
    }
    return e if incarnation is None else {**e, "incarnation": incarnation}


def test_a_replica_killed_again_while_restarting_is_two_faults():
    fired = [{"t": 10.0, "rid": "c0r1", "kind": "kill", "phase": "inner", "round": 0, "step": 3}]
    events = [
        _down(10.2, "c0r1", 0),
        _down(12.0, "c0r1", 1, phase="restarting"),
        {"t": 15.0, "event": "replica_up", "rid": "c0r1", "pid": 3, "incarnation": 2},
    ]
    faults = fault_figures(fired, events)
    assert [(f["source"], f["rid"]) for f in faults] == [("injected", "c0r1"), ("observed", "c0r1")]


def test_a_replica_s_death_and_the_death_of_the_spare_that_replaced_it_are_two_faults():
    """Each actor counts its own restarts: the promoted spare's first process is incarnation 0 too."""
    events = [
        _down(1.0, "c0r1", 0, actor=name("c0r1")),
        {"t": 1.1, "event": "replica_up", "rid": "c0r1", "pid": 7, "incarnation": 0},
        _down(3.0, "c0r1", 0, actor=name("spare-c0-0")),
        _down(3.2, "c0r1", 0, actor=name("spare-c0-0")),
    ]
    assert [f["rid"] for f in fault_figures([], events)] == ["c0r1", "c0r1"]


def test_the_same_death_logged_twice_is_one_fault_and_downs_without_incarnation_keep_the_old_rule():
    assert len(fault_figures([], [_down(1.0, "c0r1", 0), _down(1.5, "c0r1", 0)])) == 1
    assert len(fault_figures([], [_down(1.0, "c0r1"), _down(1.5, "c0r1")])) == 1, (
        "no incarnation, same round/phase/cause, no replica_up between: logged again"
    )
    assert (
        len(
            fault_figures(
                [], [_down(1.0, "c0r1"), {"t": 1.2, "event": "replica_up", "rid": "c0r1", "pid": 2}, _down(1.5, "c0r1")]
            )
        )
        == 2
    )


def test_a_spare_s_death_is_an_observed_fault_named_by_its_actor():
    events = [
        {"t": 5.0, "event": "spare_lost", "cluster": 0, "spare": name("spare-c0-0"), "incarnation": 0, "round": 1},
        {"t": 5.5, "event": "spare_lost", "cluster": 0, "spare": name("spare-c0-0"), "incarnation": 0, "round": 1},
    ]
    faults = fault_figures([], events)
    assert [(f["source"], f["rid"], f["phase"], f["detected_by"]) for f in faults] == [
        ("observed", name("spare-c0-0"), "spare", "spare_lost")
    ]
    assert set(faults[0]) == set(fault_figures([], [_down(1.0, "c0r1", 0)])[0]), "every entry has the same keys"


# -- after a supervisor restart: which replicas to kill ----------------------------------------------
def _busy(phase, step=0, since=100.0):
    return {"phase": phase, "step": step, "phase_since": since}


def test_after_a_restart_an_inner_phase_is_stuck_only_when_its_step_stops():
    watch = StallWatch(10.0, {"checkpoint": 100.0})
    assert watch.verdict("c0r0", _busy("inner", 5), 0.0) == BUSY
    assert watch.verdict("c0r0", _busy("inner", 6), 9.0) == BUSY
    assert watch.verdict("c0r0", _busy("inner", 6), 19.5) == STUCK
    assert watch.verdict("c0r0", {"phase": "idle", "step": 6}, 20.0) == IDLE


def test_after_a_restart_a_checkpoint_heal_or_outer_sync_has_its_own_phase_limit_not_the_step_s():
    watch = StallWatch(10.0, {"checkpoint": 100.0, "heal": 60.0})
    assert watch.verdict("c0r0", _busy("checkpoint", 40), 0.0) == BUSY
    assert watch.verdict("c0r0", _busy("checkpoint", 40), 50.0) == BUSY, "a step that cannot move is no hang"
    assert watch.verdict("c0r0", _busy("checkpoint", 40), 100.5) == STUCK
    assert watch.verdict("c0r1", _busy("heal", since=1.0), 0.0) == BUSY
    assert watch.verdict("c0r1", _busy("heal", since=2.0), 55.0) == BUSY, "a new heal call: its clock starts again"
    assert watch.verdict("c0r1", _busy("heal", since=2.0), 110.0) == BUSY
    assert watch.verdict("c0r1", _busy("heal", since=2.0), 115.5) == STUCK
    assert watch.verdict("c1r0", _busy("outer"), 0.0) == BUSY
    assert watch.verdict("c1r0", _busy("outer"), 10.5) == STUCK, "a phase with no limit of its own: limit_s"


def test_after_a_restart_a_replica_that_never_answers_is_hung_and_one_that_answers_again_is_not():
    watch = StallWatch(10.0, silent_s=30.0)
    assert watch.verdict("c0r0", None, 0.0) == WAITING
    assert watch.verdict("c0r0", None, 29.0) == WAITING
    assert watch.verdict("c0r0", None, 30.5) == HUNG
    assert watch.verdict("c0r1", None, 0.0) == WAITING
    assert watch.verdict("c0r1", _busy("inner", 3), 20.0) == BUSY
    assert watch.verdict("c0r1", None, 40.0) == WAITING, "its silence starts again after an answer"
