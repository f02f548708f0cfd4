"""sync.balance=time (issue 48): the round machine closes a round's inner phases by the clock
(hsgd/core/round/close.py). Driven directly: a machine, its effects, answers and ticks by hand."""

from __future__ import annotations

from hsgd.core.outer_plan import token_weights
from hsgd.core.round import (
    Answer,
    ClusterStage,
    Kill,
    Late,
    OuterReduce,
    Phase,
    PhaseEnded,
    Progress,
    RoundClosed,
    RoundMachine,
    Up,
    Yield,
)
from hsgd.core.round.balance import close_after_s
from hsgd.core.round.messages import Outcome
from hsgd.core.topology import Topology
from tests.fakes.round_world import decisions, make_settings

SPR, DONE, YIELDED = 20, Outcome.DONE, Outcome.YIELDED


def _machine(clusters=3, per_cluster=1, r=1, *, close_s=10.0, **overrides) -> RoundMachine:
    topo = Topology(clusters, per_cluster)
    settings = make_settings(steps_per_round=SPR, close_s=close_s, late_grace_s=5.0, **overrides)
    progress = {rid: (r, r * SPR) for rid in topo.replica_ids()}
    return RoundMachine(topo, settings, r, progress=progress, leaders={}, epoch=0, committed_round=r)


def _runs(effects) -> dict[int, Phase]:
    return {e.cluster: e for e in effects if isinstance(e, Phase) and e.kind == "run_inner"}


def _successor(progress: dict, closed_at: dict, *, late=(), close_s=10.0, **overrides) -> RoundMachine:
    """Round 1's machine of a restarted supervisor that found the round's close (and late sites) recorded."""
    settings = make_settings(steps_per_round=SPR, close_s=close_s, **overrides)
    topo = Topology(len({rid.split("r")[0] for rid in progress}), 1)
    return RoundMachine(
        topo, settings, 1, progress=progress, leaders={}, epoch=3, committed_round=1, closed_at=closed_at, late=late
    )


def _step(m: RoundMachine, rid: str, step_s: float, upto: int, r: int = 1, t0: float = 0.0) -> None:
    """rid reports in-round steps 1..upto, one every step_s seconds from t0."""
    for k in range(1, upto + 1):
        m.observe(Progress(rid, r * SPR + k), t0 + k * step_s)


def test_the_close_asks_every_cluster_still_stepping_to_yield_and_none_that_is_done():
    m = _machine()
    runs = _runs(m.start(0.0))
    _step(m, "c0r0", 0.5, 19)  # c0 at 0.5 s a step: done at 10 s
    _step(m, "c1r0", 1.0, 9)  # c1 at 1 s a step
    _step(m, "c2r0", 2.0, 4)  # c2 at 2 s a step
    assert decisions(m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 9.8)) == []
    assert m.clusters[0].stage is ClusterStage.READY
    assert decisions(m.tick(9.9)) == [], "not closed before close_s"
    _, *asks = decisions(m.tick(10.0))  # (the close's record first: below)
    assert [type(a) for a in asks] == [Yield, Yield] and m.closed
    by_cluster = {a.cluster: a for a in asks}
    assert set(by_cluster) == {1, 2}, "c0 was ready: nobody asks it"
    # two steps past the furthest, extrapolated by each cluster's own step time from its last sign
    assert by_cluster[1].at_step == 11 and by_cluster[2].at_step == 6
    assert decisions(m.tick(10.5)) == [], "the close is asked once"


def test_yielded_clusters_are_ready_with_the_steps_they_took_and_weigh_by_them():
    m = _machine()
    runs = _runs(m.start(0.0))
    _step(m, "c1r0", 1.0, 9)
    _step(m, "c2r0", 2.0, 4)
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 9.0)
    m.tick(10.0)
    assert decisions(m.observe(Answer(runs[1].id, "c1r0", YIELDED, 1, SPR + 11), 11.0)) == []
    assert m.clusters[1].stage is ClusterStage.READY and m.clusters[1].reforms == 0
    (reduce,) = decisions(m.observe(Answer(runs[2].id, "c2r0", YIELDED, 1, SPR + 6), 12.0))
    assert reduce.kind == "outer_reduce" and m.ends == {1: 11, 2: 6}
    assert {c.weights for c in reduce.calls.values() if isinstance(c, OuterReduce)} == {token_weights([20, 11, 6])}


def test_a_cluster_not_ready_by_the_close_plus_its_grace_is_late_nobody_is_killed_and_the_round_commits():
    """c2's process is paused (SIGSTOP) at step 4: it neither steps nor answers the yield."""
    m = _machine(step_deadline_s=600.0)
    runs = _runs(m.start(0.0))
    _step(m, "c1r0", 1.0, 9)
    _step(m, "c2r0", 2.0, 4)
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 9.0)
    m.tick(10.0)
    m.observe(Answer(runs[1].id, "c1r0", YIELDED, 1, SPR + 11), 11.0)
    assert decisions(m.tick(14.9)) == [], "still inside the grace"
    effects = m.tick(15.0)
    late = [e for e in effects if isinstance(e, Late)]
    assert [(e.cluster, e.abandoned, e.steps) for e in late] == [(2, ("c2r0",), 4)]
    assert not [e for e in effects if isinstance(e, Kill)], "late is slow, not dead"
    assert [e.phase.id for e in effects if isinstance(e, PhaseEnded)] == [runs[2].id]
    (reduce,) = [e for e in effects if isinstance(e, Phase)]
    assert reduce.kind == "outer_reduce" and set(reduce.calls) == {"c0r0", "c1r0"}
    assert m.clusters[2].stage is ClusterStage.OUT and m.clusters[2].configured is None
    assert m.late == {2: "not ready 5.0s after the round closed"} and m.late_members == {"c2r0"}
    assert "c2r0" in m.progress, "its replica is live: it heals at the next round's start"
    assert ("idle", "c2r0") not in m.probes(idle=True, gone=set()), "its abandoned call is watched, not probed"
    # resumed, its answer to the abandoned call is stale
    assert m.observe(Answer(runs[2].id, "c2r0", YIELDED, 1, SPR + 6), 16.0) == []
    answered = [e for rid in reduce.calls for e in m.observe(Answer(reduce.id, rid, DONE, 1, 2 * SPR), 17.0)]
    (commit,) = [e for e in answered if isinstance(e, Phase)]
    assert commit.kind == "outer_commit" and set(commit.calls) == {"c0r0", "c1r0"}
    for rid in commit.calls:
        m.observe(Answer(commit.id, rid, DONE, 2, 2 * SPR), 18.0)
    assert m.done and m.outcome == "committed" and m.committed_by == {"c0r0", "c1r0"}


def test_a_cluster_that_stopped_before_min_round_steps_is_late_with_nothing_abandoned():
    m = _machine(min_round_steps=5)
    runs = _runs(m.start(0.0))
    _step(m, "c2r0", 4.0, 2)
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 9.0)
    m.observe(Answer(runs[1].id, "c1r0", DONE, 1, 2 * SPR), 9.5)
    _, ask = decisions(m.tick(10.0))
    assert ask.cluster == 2 and ask.at_step == 4
    effects = m.observe(Answer(runs[2].id, "c2r0", YIELDED, 1, SPR + 4), 12.0)
    late = [e for e in effects if isinstance(e, Late)]
    assert [(e.cluster, e.abandoned, e.steps) for e in late] == [(2, (), 4)]
    assert m.late_members == set() and m.clusters[2].stage is ClusterStage.OUT
    assert [e.kind for e in effects if isinstance(e, Phase)] == ["outer_reduce"]


def test_a_run_that_starts_after_the_close_ends_two_steps_past_its_furthest_member():
    """c1's collective fails after the close: it re-forms and runs on, but only two steps more."""
    m = _machine(2, 2, step_deadline_s=600.0)
    runs = _runs(m.start(0.0))
    for rid in ("c1r0", "c1r1"):
        _step(m, rid, 1.0, 8)
    m.tick(10.0)  # both clusters asked to yield
    failed = Answer(runs[1].id, "c1r0", Outcome.COLLECTIVE_FAILED, 1, SPR + 9)
    m.observe(failed, 10.2)
    (again,) = [
        e
        for e in m.observe(Answer(runs[1].id, "c1r1", Outcome.COLLECTIVE_FAILED, 1, SPR + 9), 10.3)
        if isinstance(e, Phase)
    ]
    assert again.kind == "run_inner" and {c.steps for c in again.calls.values()} == {11}
    for rid in again.calls:
        m.observe(Answer(again.id, rid, DONE, 1, SPR + 11), 12.5)
    assert m.clusters[1].stage is ClusterStage.READY and m.ends[1] == 11


def test_after_the_close_a_restarted_replica_joins_at_the_next_round_not_this_one():
    m = _machine(2, 2)
    m.start(0.0)
    _step(m, "c1r0", 1.0, 9)
    _step(m, "c1r1", 1.0, 9)
    m.tick(10.0)
    assert m.closed
    assert decisions(m.observe(Up("c0r1", 0, 0), 10.5)) == [] and not m.joining


def test_without_a_close_nothing_is_asked_and_a_slow_cluster_runs_its_steps():
    m = _machine(close_s=None, step_deadline_s=600.0)
    m.start(0.0)
    _step(m, "c2r0", 2.0, 4)
    assert decisions(m.tick(9.0)) == [] and decisions(m.tick(60.0)) == []
    assert not m.closed and m.late == {}


def test_the_close_is_the_fastest_sites_steps_plus_a_lead_or_the_configured_round_s():
    assert close_after_s(None, 20, [0.5, 1.0, None], lead_s=1.0) == 11.0
    assert close_after_s(30.0, 20, [0.5, 1.0], lead_s=1.0) == 30.0, "sync.round_s wins"
    assert close_after_s(None, 20, [None, None], lead_s=1.0) is None, "nothing learned: no close this round"


def test_the_close_is_recorded_before_any_yield_is_asked():
    m = _machine()
    runs = _runs(m.start(0.0))
    _step(m, "c1r0", 1.0, 9)
    _step(m, "c2r0", 2.0, 4)
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 9.0)
    closed, *asks = decisions(m.tick(10.0))
    assert isinstance(closed, RoundClosed) and closed.round == 1
    assert dict(closed.ends) == {0: SPR, 1: 11, 2: 6}, "the ready cluster's whole round, the others' yield steps"
    assert [type(a) for a in asks] == [Yield, Yield]


def test_a_restarted_supervisor_follows_the_recorded_close_and_the_round_ends_there_once():
    """The supervisor died after the close was saved: c1 yielded at 11 (idle there now), c2's yield never
    arrived and it is still at 6, short of its recorded 8. The successor's machine starts closed."""
    progress = {"c0r0": (1, 2 * SPR), "c1r0": (1, SPR + 11), "c2r0": (1, SPR + 6)}
    m = _successor(progress, {0: SPR, 1: 11, 2: 8}, late_grace_s=5.0)
    runs = _runs(m.start(100.0))
    assert {c: {call.steps for call in run.calls.values()} for c, run in runs.items()} == {0: {20}, 1: {11}, 2: {8}}
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 100.5)
    m.observe(Answer(runs[1].id, "c1r0", DONE, 1, SPR + 11), 100.5)
    (reduce,) = decisions(m.observe(Answer(runs[2].id, "c2r0", DONE, 1, SPR + 8), 102.0))
    assert reduce.kind == "outer_reduce" and m.ends == {0: 20, 1: 11, 2: 8}
    assert not [e for e in m.tick(103.0) if isinstance(e, (Yield, RoundClosed))], "closed once, by its predecessor"


def test_a_successors_cluster_already_past_its_recorded_end_stops_where_it_is():
    progress = {"c0r0": (1, 2 * SPR), "c1r0": (1, SPR + 15)}  # the yield never reached c1: it ran on to 15
    m = _successor(progress, {0: SPR, 1: 11})
    runs = _runs(m.start(0.0))
    assert {call.steps for call in runs[1].calls.values()} == {15}


def test_a_paused_cluster_is_late_at_the_close_plus_its_grace_never_hung_before():
    """c1 stops stepping at 2 s; its step deadline (3 s) runs out long before the close (30 s) plus the grace."""
    m = _machine(2, 1, close_s=30.0, step_deadline_s=3.0, group_grace_s=1.0)
    runs = _runs(m.start(0.0))
    _step(m, "c1r0", 1.0, 2)
    m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 2 * SPR), 20.0)
    kills = [e for t in range(3, 36) for e in m.tick(float(t)) if isinstance(e, Kill)]
    assert kills == [] and m.late == {1: "not ready 5.0s after the round closed"}


def test_a_successor_leaves_a_recorded_late_cluster_out_of_the_round():
    progress = {"c0r0": (1, 2 * SPR), "c1r0": (1, SPR + 11), "c2r0": (1, SPR + 6)}  # c2 idle again meanwhile
    m = _successor(progress, {0: SPR, 1: 11}, late=[2])
    runs = _runs(m.start(0.0))
    assert sorted(runs) == [0, 1] and m.clusters[2].stage is ClusterStage.OUT and 2 in m.late
    assert m.steps_taken(2) == 0


def test_when_no_cluster_could_commit_without_the_late_ones_the_round_waits_for_them():
    """Every site still stepping at the close plus the grace (busy cores): nobody is late, the round goes on."""
    m = _machine(2, 1, step_deadline_s=600.0)
    runs = _runs(m.start(0.0))
    for rid in ("c0r0", "c1r0"):
        _step(m, rid, 1.0, 9)
    m.tick(10.0)
    assert [e for e in m.tick(15.0) if isinstance(e, Late)] == [] and m.late == {}
    m.observe(Answer(runs[0].id, "c0r0", YIELDED, 1, SPR + 12), 16.0)
    (reduce,) = decisions(m.observe(Answer(runs[1].id, "c1r0", YIELDED, 1, SPR + 12), 16.5))
    assert reduce.kind == "outer_reduce" and m.ends == {0: 12, 1: 12}
