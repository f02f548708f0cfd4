"""The round machine (hsgd/core/round/) against a small fake world of replicas
(tests/fakes/round_world.py: `World`, which also checks the machine's promises as it goes).
test_round_simulation.py drives the same world at 10,000 replicas with random failures.
"""

from __future__ import annotations

import pytest

from hsgd.core.round import (
    AbortJoin,
    Answer,
    ErrorKind,
    Heal,
    Join,
    Lost,
    Outcome,
    Overlap,
    Phase,
    PhaseEnded,
    Progress,
    RoundMachine,
    RunInner,
    Up,
)
from hsgd.core.topology import Topology
from tests.fakes.round_world import (
    CFAILED,
    DIED,
    DONE,
    SPR,
    TICK_S,
    Issued,
    World,
    decisions,
    make_settings,
    outcome_of,
)

# -- fault-free -------------------------------------------------------------------------------------------


def test_fault_free_round_issues_each_phase_once_and_commits():
    w = World(3, 3)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    kinds = [i.action.kind for i in w.issued]
    assert kinds.count("run_inner") == 3 and kinds.count("outer_reduce") == 1 and kinds.count("outer_commit") == 1
    assert len(w.forming("inner")) == 3 and len(w.forming("outer")) == 1, "each group is formed by its first call"
    assert "heal" not in kinds and not w.kills
    assert all(rep.pos == (1, SPR) for rep in w.reps.values())
    assert m.committed_by == set(w.reps)
    # next round: groups and leaders stay, nothing is configured again
    w.issued.clear()
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert sorted(i.action.kind for i in w.issued) == ["outer_commit", "outer_reduce"] + ["run_inner"] * 3
    assert not w.forming("inner") and not w.forming("outer")
    assert all(rep.pos == (2, 2 * SPR) for rep in w.reps.values())


# -- overlap (sync.fragment_delay): holders reduce behind the round's last inner steps ----------------------
def _overlaps(w: World, gen: int) -> dict[str, tuple]:
    return {rid: o for i in w.calls("run_inner", gen=gen) for rid, o in run_inner_overlap_of(i).items()}


def test_with_a_fragment_delay_the_holders_of_the_standing_outer_groups_reduce_behind_the_inner_steps():
    w = World(3, 2, settings=make_settings(fragment_delay=3))
    assert outcome_of(w, w.round()) == "committed"
    assert _overlaps(w, 1) == {}, "round 0 has no standing outer groups: nothing to reduce behind the steps"
    epoch, groups = w.outer_configured
    assert outcome_of(w, w.round()) == "committed"
    assert _overlaps(w, 2) == {rid: Overlap(epoch, 0, 1) for rid in groups[0]}  # the leaders, one shard
    assert all(i.gen == 1 for i in w.forming("outer")), "round 1 reused the standing groups"


def test_on_the_sharded_path_every_shard_holder_reduces_its_shard_behind_the_steps_while_the_plan_stands():
    from hsgd.core.outer_plan import shard_holders

    topo = Topology(3, 2)
    members = [tuple(topo.cluster_members(c)) for c in range(3)]
    groups = shard_holders(members, [m[0] for m in members], 2)
    progress = {rid: (4, 40) for m in members for rid in m}
    settings = make_settings(fragment_delay=3, outer_path="sharded")

    def overlaps(outer_configured, live=progress, leaders=None):
        leaders = {c: m[0] for c, m in enumerate(members)} if leaders is None else leaders
        m = RoundMachine(
            topo,
            settings,
            4,
            progress=live,
            leaders=leaders,
            epoch=9,
            committed_round=4,
            outer_configured=outer_configured,
        )
        return {
            rid: o
            for e in m.start(0.0)
            if isinstance(e, Phase) and e.kind == "run_inner"
            for rid, c in e.calls.items()
            if (o := c.overlap) is not None
        }

    assert overlaps((7, groups)) == {rid: Overlap(7, j, 2) for j, holders in enumerate(groups) for rid in holders}
    # c2 lost a member: one shard now, the standing groups are not the plan: nothing is reduced behind the steps
    assert overlaps((7, groups), {rid: p for rid, p in progress.items() if rid != "c2r1"}) == {}
    assert overlaps(None) == {}
    # a cluster whose every replica died last round has no leader yet (its first live member will
    # lead, as before): the plan is read all the same, and c0 below min_replicas sits out of it
    assert overlaps((7, groups), leaders={0: "c0r0", 1: "c1r0"}) == {
        rid: Overlap(7, j, 2) for j, holders in enumerate(groups) for rid in holders
    }
    few = make_settings(fragment_delay=3, outer_path="sharded", min_replicas_per_cluster=2)
    m = RoundMachine(
        topo,
        few,
        4,
        progress={rid: p for rid, p in progress.items() if rid != "c0r1"},
        leaders={1: "c1r0", 2: "c2r0"},
        epoch=9,
        committed_round=4,
        outer_configured=(7, groups),
    )
    assert not any(
        c.overlap for e in m.start(0.0) if isinstance(e, Phase) and e.kind == "run_inner" for c in e.calls.values()
    ), "c0 sits out: the standing 3-cluster groups are not the plan"


def test_after_a_holder_dies_no_call_reduces_behind_the_steps_in_a_group_that_is_gone():
    w = World(2, 2, settings=make_settings(fragment_delay=3))
    assert outcome_of(w, w.round()) == "committed"
    leader = w.leaders[1]
    w.fault(leader, "run_inner", "die", round=1, step=2)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    later = [i for i in w.calls("run_inner", gen=2) if i.action.reason != "round start"]
    assert later and all(run_inner_overlap_of(i) == {} for i in later), "a re-formed cluster named the dead group"
    assert [i.gen for i in w.forming("outer")][-1] == 2, "the exchange formed new holder groups"
    assert outcome_of(w, w.round()) == "committed"  # the next round hides its reduce again, in the new groups
    assert set(_overlaps(w, 3)) == {w.leaders[0], w.leaders[1]}


def run_inner_overlap_of(issued: Issued) -> dict:
    return {rid: o for rid, c in issued.action.calls.items() if (o := c.overlap) is not None}


def test_without_a_fragment_delay_no_call_carries_an_overlap():
    w = World(2, 2)
    w.round()
    w.round()
    assert _overlaps(w, 2) == {}


def test_inner_none_averages_each_cluster_before_outer():
    w = World(2, 2, settings=make_settings(inner="none"))
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert len(w.calls("cluster_average")) == 2


# -- failure scoping --------------------------------------------------------------------------------------


def test_death_in_one_cluster_reforms_only_that_cluster():
    w = World(3, 3)
    w.fault("c1r1", "run_inner", "die", round=0, step=4)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    for c in (0, 2):
        assert len(w.calls("run_inner", c)) == 1, "another cluster's inner phase was issued again"
        assert len(w.forming("inner", c)) == 1
    assert not w.kills, "nobody hung, nobody is killed"
    reform = w.forming("inner", 1)[-1].action
    assert list(reform.calls) == ["c1r0", "c1r2"], "c1 re-forms without the dead one"
    second = w.calls("run_inner", 1)[-1]
    assert second.before == {"c1r0": (0, 4), "c1r2": (0, 4)}, "survivors resume at their last committed step"
    assert m.dead == {"c1r1": "died"}
    assert all(w.reps[rid].pos == (1, SPR) for rid in m.progress)


def test_survivors_at_different_steps_heal_to_the_furthest():
    w = World(2, 3)
    w.fault("c0r1", "run_inner", "collective", round=0, step=6, applied=("c0r2",))
    m = w.round()
    assert outcome_of(w, m) == "committed"
    heal = w.calls("heal", 0)[-1].action
    assert heal.calls == {"c0r0": Heal("c0r2", "full"), "c0r1": Heal("c0r2", "full")}, "max committed step wins"
    assert w.calls("run_inner", 0)[-1].before == {rid: (0, 7) for rid in w.members(0)}
    assert len(w.calls("run_inner", 1)) == 1


def test_silent_but_advancing_replica_is_never_killed():
    w = World(2, 2)
    w.slow["c0r0"] = 25.0  # 25 s a step (< the 30 s step deadline): c0's inner phase takes 250 s
    w.fault("c1r1", "run_inner", "die", round=0, step=2)  # a failure elsewhere shortens nothing in c0
    w.fault("c1r0", "run_inner", "die", round=0, step=2)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert not w.kills
    assert len(w.calls("run_inner", 0)) == 1
    assert m.clusters[1].stage == "out"
    assert w.reps["c0r0"].pos == (1, SPR) and w.now > 250


def test_replica_advancing_after_a_peer_failed_is_not_killed():
    """localsgd-like: a member keeps stepping (no collective due) after its peer's collective
    failed; while it advances it is slow, never hung."""
    topo = Topology(1, 2)
    m = RoundMachine(
        topo,
        make_settings(),
        0,
        progress={"c0r0": (0, 0), "c0r1": (0, 0)},
        leaders={},
        epoch=0,
        committed_round=0,
        configured={0: (0, ("c0r0", "c0r1"))},
    )
    (run,) = m.start(0.0)
    assert run.kind == "run_inner"
    assert decisions(m.observe(Answer(run.id, "c0r1", CFAILED, 0, 3), 1.0)) == []
    for t in range(2, 200):
        m.observe(Progress("c0r0", 3 + t // 5), float(t))  # a step every 5 s, well past the 10 s grace in total
        assert decisions(m.tick(float(t) + 0.5)) == [], f"killed while advancing at t={t}"
    actions = decisions(m.tick(260.0))  # then silent and not advancing: killed once its group's grace is over
    assert [a.kind for a in actions][:1] == ["kill"] and actions[0].rid == "c0r0"


def test_a_member_dying_in_its_group_s_rendezvous_releases_the_others_at_once():
    """The first run of a round forms c0's group; c0r1 dies in the join. The machine learns of
    the death and aborts that rendezvous (AbortJoin), so its peers leave it at once rather than at
    the configure timeout (12 s here); nobody healthy is killed; c0 re-forms without c0r1."""
    s = make_settings(group_grace_s=5.0, configure_s=20.0)
    w = World(2, 3, settings=s, configure_timeout_s=12.0)
    w.fault("c0r1", "configure_inner", "die", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert not w.kills, "members waiting in their group's rendezvous were taken for hung"
    assert m.dead == {"c0r1": "died"}
    first, again = w.forming("inner", 0)
    assert first.action.deadline_s == s.configure_s and list(again.action.calls) == ["c0r0", "c0r2"]
    ((at, abort),) = w.aborts
    assert abort.prefix == first.action.prefix == "epoch1/inner/c0" and abort.dead == ("c0r1",) and abort.cluster == 0
    assert again.at < 1.0 < 12.0, "c0 re-forms as soon as its survivors were released, not at the configure timeout"
    assert len(w.calls("run_inner", 1)) == 1, "c1 is untouched"


def test_a_member_hanging_in_its_group_s_rendezvous_is_not_a_known_death_and_aborts_nothing():
    """Silence is not death: with c0r1 hung in the join, nobody is known dead, so no rendezvous is
    aborted; its peers leave at the configure timeout and c0r1 is killed only past its limit."""
    s = make_settings(group_grace_s=5.0, configure_s=20.0)
    w = World(2, 3, settings=s, configure_timeout_s=12.0)
    w.fault("c0r1", "configure_inner", "hang", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert w.aborts == [], "a silent member is not known dead"
    assert [rid for _, rid in w.kills] == ["c0r1"]
    first, again = w.forming("inner", 0)
    assert again.at >= 12.0 and "c0r1" not in again.action.calls


def test_silent_not_advancing_replica_is_killed_after_group_grace_once_a_peer_failed():
    s = make_settings()
    w = World(2, 3, settings=s, timeout_s=5.0)
    w.fault("c0r1", "run_inner", "hang", round=0, step=3)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert [rid for _, rid in w.kills] == ["c0r1"], "only the hung one is killed"
    ((killed_at, _),) = w.kills
    hang_at = w.calls("run_inner", 0)[0].at + 3 * w.step_s
    peers_failed_at = hang_at + w.timeout_s + 0.01
    grace_ends = peers_failed_at + s.group_grace_s  # (the world's simulated clock)
    assert grace_ends < killed_at <= grace_ends + TICK_S
    assert killed_at < hang_at + s.step_deadline_s, "a failed peer shortens the wait to the group's grace"
    assert m.dead == {"c0r1": "hung"}
    assert len(w.calls("run_inner", 1)) == 1


def test_silent_replica_with_no_failed_peer_is_killed_at_the_step_deadline():
    s = make_settings()
    w = World(2, 1, settings=s)
    w.fault("c0r0", "run_inner", "hang", round=0, step=2)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    ((killed_at, rid),) = w.kills
    assert rid == "c0r0"
    hang_at = w.calls("run_inner", 0)[0].at + 2 * w.step_s  # its last step; seen at the next poll
    deadline = hang_at + s.step_deadline_s  # (the world's simulated clock)
    assert deadline < killed_at <= deadline + 2 * TICK_S
    assert m.clusters[0].stage == "out" and w.reps["c1r0"].pos == (1, SPR)


def test_leader_death_in_outer_retries_only_outer_exchange():
    w = World(3, 3)
    w.round()
    w.issued.clear()
    w.fault("c1r0", "outer_reduce", "die", round=1)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    for c in (0, 2):
        assert len(w.calls("run_inner", c)) == 1, f"c{c}'s inner work was redone"
        assert not w.forming("inner", c) and not w.calls("heal", c)
    runs = w.calls("run_inner", 1)
    assert len(runs) == 2
    assert runs[1].before == {"c1r1": (1, 2 * SPR), "c1r2": (1, 2 * SPR)}, (
        "the re-formed cluster's inner call is a no-op"
    )
    assert list(w.forming("inner", 1)[-1].action.calls) == ["c1r1", "c1r2"]
    assert m.leaders[1] == "c1r1"
    reduces = w.calls("outer_reduce")
    assert len(reduces) == 2 and sorted(reduces[1].action.calls) == ["c0r0", "c1r1", "c2r0"]
    assert all(w.reps[rid].pos == (2, 2 * SPR) for rid in m.progress)


def test_outer_collective_failure_retries_the_exchange_without_reforming_clusters():
    w = World(3, 2)
    w.fault("c2r0", "outer_reduce", "collective", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert len(w.calls("outer_reduce")) == 2 and len(w.forming("outer")) == 2
    assert len(w.calls("run_inner")) == 3 and len(w.forming("inner")) == 3
    assert not m.dead


def test_leaders_lost_in_outer_with_a_cluster_going_out_reform_before_the_exchange():
    """Two leaders die in the outer reduce; c0 falls below min_replicas_per_cluster. The retry
    must re-form c1 (new leader) before it configures the leaders' group again."""
    w = World(3, 3, settings=make_settings(min_replicas_per_cluster=2))
    w.fault("c0r1", "run_inner", "die", round=0, step=3)
    w.fault("c0r0", "outer_reduce", "die", round=0)
    w.fault("c1r0", "outer_reduce", "die", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.clusters[0].stage == "out"
    assert list(w.forming("inner", 1)[-1].action.calls) == ["c1r1", "c1r2"]
    assert sorted(w.calls("outer_reduce")[-1].action.calls) == ["c1r1", "c2r0"]
    assert w.reps["c1r1"].pos == (1, SPR) and w.reps["c0r2"].pos == (0, SPR)


def test_commit_counts_if_any_replica_applied_it():
    w = World(2, 3)
    w.fault("c1r2", "outer_commit", "die", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.committed_by == {"c0r0", "c0r1", "c0r2"}
    assert w.reps["c1r0"].pos == (0, SPR), "c1's broadcast broke: it did not apply"
    assert len(w.calls("outer_reduce")) == 1, "a decided commit is never redone"
    # next round: c1's members heal from a committed replica of another cluster, then run the round
    m = w.round()
    assert outcome_of(w, m) == "committed"
    heal = w.calls("heal", 1)[-1].action
    assert heal.calls == {"c1r0": Heal("c0r0", "global"), "c1r1": Heal("c0r0", "global")}
    assert all(w.reps[rid].pos == (2, 2 * SPR) for rid in m.progress)


def test_commit_applied_by_one_replica_only_counts():
    w = World(1, 3)
    w.fault("c0r1", "outer_commit", "collective", round=0, applied=("c0r0",))
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.committed_by == {"c0r0"}
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert w.calls("heal", 0)[-1].action.calls == {"c0r1": Heal("c0r0", "full"), "c0r2": Heal("c0r0", "full")}


def test_commit_nobody_applied_is_retried_over_reformed_groups():
    w = World(2, 2)
    w.fault("c0r1", "outer_commit", "collective", round=0)
    w.fault("c1r1", "outer_commit", "collective", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert len(w.calls("outer_commit")) == 2
    assert len(w.forming("inner")) == 4, "the broken inner groups are formed again"
    assert all(rep.pos == (1, SPR) for rep in w.reps.values())


def test_commit_failure_in_one_cluster_does_not_shorten_anothers_deadline():
    s = make_settings(commit_s=40.0)
    w = World(2, 2, settings=s)
    w.commit_s[0] = 15.0  # c0's broadcast is slow but healthy: longer than the 10 s grace
    w.fault("c1r1", "outer_commit", "die", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert not w.kills
    assert m.committed_by == {"c0r0", "c0r1"}


def test_total_loss_asks_for_restore():
    w = World(2, 2, start=(0, 0))
    w.committed_round = 3  # every live replica is a fresh process; round 3 was committed before
    m = w.round()
    assert m.outcome == "restore" and "total loss" in m.reason and not w.issued


def test_a_round_nobody_holds_fails_at_once_instead_of_stalling():
    w = World(2, 2, start=(2, 200))
    w.committed_round = 2
    m = w.round(3)  # the caller asks for a round no live replica has reached
    assert m.outcome == "failed" and "round 3 asked" in m.reason and not w.issued


def test_clusters_behind_at_round_start_take_the_global_state_of_the_lowest_id_donor():
    w = World(3, 2, start=(1, 100))
    for rid in ("c0r0", "c0r1", "c2r0"):  # c0: nobody holds the round; c2r0 lags inside c2
        w.reps[rid].round, w.reps[rid].step = 0, 0
    m = w.machine()
    heals = {a.cluster: a.calls for a in m.start(0.0) if a.kind == "heal"}
    assert heals[0] == {"c0r0": Heal("c1r0", "global"), "c0r1": Heal("c1r0", "global")}
    assert heals[2] == {"c2r0": Heal("c2r1", "full")}


def test_every_replica_dying_mid_round_ends_below_quorum_then_restore():
    w = World(2, 2)
    assert w.round().outcome == "committed"
    for rid in w.reps:
        w.fault(rid, "run_inner", "die", round=1, step=5)
    m = w.round()
    assert outcome_of(w, m) == "below_quorum"
    w.restart_dead()
    m = w.round()
    assert m.outcome == "restore"


def test_below_quorum():
    w = World(2, 2, settings=make_settings(min_clusters=2))
    w.fault("c1r0", "run_inner", "die", round=0, step=3)
    w.fault("c1r1", "run_inner", "die", round=0, step=3)
    m = w.round()
    assert outcome_of(w, m) == "below_quorum"
    assert "min_clusters=2" in m.reason
    # and at the start of a round: c1 has 1 live replica, below min_replicas_per_cluster
    w2 = World(2, 2, settings=make_settings(min_clusters=2, min_replicas_per_cluster=2))
    w2.reps["c1r1"].alive = False
    m2 = w2.round()
    assert m2.outcome == "below_quorum" and not w2.issued


def test_a_round_ending_early_hands_on_no_group_a_call_in_flight_may_still_break():
    """Below quorum mid-round: c0 and c1 are still in their inner phase, and nobody reads their
    answers any more; c0's collective then fails. The next round must re-form c0 (and c1, which it
    cannot tell apart) rather than run on a group it believed stood."""
    w = World(3, 2, settings=make_settings(min_clusters=3))
    assert w.round().outcome == "committed"
    w.fault("c2r0", "run_inner", "die", round=1, step=3)
    w.fault("c2r1", "run_inner", "die", round=1, step=3)
    w.fault("c0r1", "run_inner", "collective", round=1, step=8)
    m = w.round()
    assert outcome_of(w, m) == "below_quorum"
    assert 0 not in m.configured_groups() and 1 not in m.configured_groups()
    w.drain()  # the supervisor waits for the calls in flight (c0's collective fails meanwhile)
    assert w.reps["c0r0"].inner is None
    w.restart_dead()
    w.issued.clear()
    m = w.round()
    assert outcome_of(w, m) == "committed"  # no run_inner on a broken group (a violation otherwise)
    assert {i.action.cluster for i in w.forming("inner")} == {0, 1, 2}


def test_a_leader_restarted_mid_round_and_leading_again_gets_a_fresh_leaders_group():
    """c1's leader dies while c1's first run of the round forms its group, is restarted and
    announces itself before that run ends: it is admitted and leads c1 again. The leaders are the same ids as the outer
    group's, but its process (and the group with it) is new: the outer group is configured again."""
    w = World(2, 2)
    assert w.round().outcome == "committed"
    outer_before = w.outer_configured
    del w.configured[1]  # c1 forms its group at round 1's start
    w.fault("c1r0", "configure_inner", "die", round=1)

    def restarted(world):
        world.restart("c1r0")
        world.carry_out(world.m.observe(Up("c1r0", 0, 0), world.now))

    # back after its death (0.2 s into the join) and before its peer leaves the aborted rendezvous (0.25 s)
    w.at(w.now + 0.21, restarted)
    w.issued.clear()
    m = w.round()
    assert outcome_of(w, m) == "committed"  # an outer_reduce over the stale group is a violation
    assert m.leaders[1] == "c1r0" and outer_before[1] == (("c0r0", "c1r0"),)
    assert len(w.forming("outer")) == 1 and m.outer_configured[0] > outer_before[0]


def test_a_replica_up_while_its_cluster_s_inner_phase_has_failed_waits_for_the_re_form():
    """c0r1 died in run_inner and is already back while c0r2 still runs: no yield (its phase failed,
    it re-forms anyway; the dead member is asked nothing); the newcomer is healed in at the re-form."""
    topo = Topology(1, 3)
    m = RoundMachine(
        topo,
        make_settings(),
        0,
        progress={rid: (0, 0) for rid in topo.replica_ids()},
        leaders={},
        epoch=0,
        committed_round=0,
    )
    run = next(a for a in m.start(0.0) if a.kind == "run_inner")
    (abort,) = m.observe(
        Answer(run.id, "c0r1", DIED), 1.0
    )  # (the first run forms the group: its rendezvous is released)
    assert isinstance(abort, AbortJoin) and abort.dead == ("c0r1",)
    assert m.observe(Up("c0r1", 0, 0), 2.0) == []  # (it asked the dead one's step before: KeyError)
    assert m.observe(Answer(run.id, "c0r0", CFAILED, 0, 3), 2.1) == []
    (heal,) = decisions(m.observe(Answer(run.id, "c0r2", CFAILED, 0, 3), 2.2))
    assert heal.kind == "heal" and heal.calls == {"c0r1": Heal("c0r0", "full")}


def test_behind_answer_is_healed_never_counted_done():
    w = World(2, 3, start=(1, SPR))
    w.committed_round = 1
    w.reps["c0r2"].round, w.reps["c0r2"].step = 0, SPR  # missed the commit the supervisor believes it holds
    m = w.round(1, progress={rid: (1, SPR) for rid in w.reps})
    assert outcome_of(w, m) == "committed"
    first = w.calls("run_inner", 0)[0]
    assert first.before["c0r2"] == (0, SPR)
    heal = w.calls("heal", 0)[-1].action
    assert heal.calls == {"c0r2": Heal("c0r0", "full")}
    assert w.calls("heal", 0)[-1].at > first.at
    assert w.reps["c0r2"].pos == (2, 2 * SPR) and "c0r2" in m.committed_by
    assert len(w.calls("run_inner", 1)) == 1


def test_whole_cluster_lost_sits_out_round():
    w = World(3, 2)
    w.fault("c2r0", "run_inner", "die", round=0, step=5)
    w.fault("c2r1", "run_inner", "die", round=0, step=5)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.clusters[2].stage == "out"
    assert sorted(w.calls("outer_reduce")[-1].action.calls) == ["c0r0", "c1r0"]
    assert len(w.calls("run_inner", 0)) == 1 and len(w.calls("run_inner", 1)) == 1
    w.restart_dead()
    w.issued.clear()
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert w.calls("heal", 2)[0].action.calls == {"c2r0": Heal("c0r0", "global"), "c2r1": Heal("c0r0", "global")}
    assert all(rep.pos == (2, 2 * SPR) for rep in w.reps.values())


def test_single_cluster_left_configures_a_leaders_group_of_one():
    w = World(2, 2)
    assert w.round().outcome == "committed"
    w.fault("c1r0", "run_inner", "die", round=1, step=1)
    w.fault("c1r1", "run_inner", "die", round=1, step=1)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert list(w.calls("outer_reduce")[-1].action.calls) == ["c0r0"]


def test_heal_source_death_reported_via_on_lost_reforms_without_it():
    w = World(1, 3, start=(0, 0))
    w.reps["c0r0"].step = 4  # c0r1 and c0r2 heal from c0r0 at the round's start

    def source_dies(world, action):
        world.crash(["c0r0"])

    w.on("heal", source_dies)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.dead == {"c0r0": "died"}
    assert list(w.forming("inner")[-1].action.calls) == ["c0r1", "c0r2"]


def test_leader_lost_after_its_reduce_answered_commits_without_its_cluster():
    topo = Topology(2, 2)
    ids = topo.replica_ids()
    m = RoundMachine(
        topo,
        make_settings(),
        0,
        progress={rid: (0, SPR) for rid in ids},
        leaders={},
        epoch=0,
        committed_round=0,
        configured={0: (0, ("c0r0", "c0r1")), 1: (0, ("c1r0", "c1r1"))},
        outer_configured=(0, (("c0r0", "c1r0"),)),
    )
    runs = m.start(0.0)
    queue = list(runs)
    reduce = None
    while queue:
        a = queue.pop(0)
        if a.kind == "outer_reduce":
            reduce = a
            break
        for rid in a.calls:
            queue += decisions(m.observe(Answer(a.id, rid, DONE, 0, SPR), 1.0))
    assert reduce is not None and sorted(reduce.calls) == ["c0r0", "c1r0"]
    assert m.observe(Answer(reduce.id, "c1r0", DONE, 0, SPR), 2.0) == []
    assert m.observe(Lost("c1r0"), 2.5) == []
    (commit,) = decisions(m.observe(Answer(reduce.id, "c0r0", DONE, 0, SPR), 3.0))
    assert commit.kind == "outer_commit" and sorted(commit.calls) == ["c0r0", "c0r1"]
    for rid in commit.calls:
        m.observe(Answer(commit.id, rid, DONE, 1, SPR), 4.0)
    assert m.outcome == "committed"


def test_no_call_to_a_busy_replica():
    """A mix of failures at once; the world flags any call made to a replica with one in flight
    (and every other broken promise) as it happens."""
    w = World(4, 3)
    w.fault("c0r1", "run_inner", "hang", round=0, step=2)
    w.fault("c1r0", "run_inner", "die", round=0, step=7)
    w.fault("c2r2", "run_inner", "collective", round=0, step=1, applied=("c2r0",))
    w.fault("c3r0", "outer_reduce", "die", round=0)
    w.fault("c2r1", "heal", "hang", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert not w.faults, f"scenario did not play out: {w.faults}"
    assert sorted(rid for _, rid in w.kills) == ["c0r1", "c2r1"]
    assert len(w.issued) > 10  # (the world checked each of these calls as it was made)


@pytest.mark.parametrize(
    "reported",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.xfail(
                strict=True,
                reason=(
                    "the contract's other half: a supervisor that maps a heal source's death to collective_failed "
                    "on the target without calling machine.on_lost(source) (actors/supervisor.py, when this was "
                    "written) makes the machine heal from the dead source again until max_reforms"
                ),
            ),
        ),
    ],
)
def test_heal_source_death_does_not_fail_the_run(reported):
    w = World(1, 3, start=(0, 0), report_heal_source_deaths=reported)
    w.reps["c0r0"].step = 4
    w.on("heal", lambda world, action: world.crash(["c0r0"]))
    m = w.round(limit_s=100_000)
    assert outcome_of(w, m) == "committed"


def test_hung_heal_source_is_killed_not_its_targets():
    w = World(1, 3, start=(0, 0))
    w.reps["c0r0"].step = 4
    w.fault("c0r0", "heal_source", "hang", round=0)
    m = w.round(limit_s=100_000)
    assert outcome_of(w, m) == "committed"
    assert [rid for _, rid in w.kills] == ["c0r0"]


@pytest.mark.parametrize(
    "persisted",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.xfail(
                strict=True,
                reason=(
                    "the contract's other half: a supervisor that saves the epoch only at a round's end "
                    "(actors/supervisor.py, when this was written) restarts with epochs its predecessor already "
                    "issued, and leaders reuse a buffer reduced under the same (round, epoch) over another set of "
                    "clusters: clusters apply different steps"
                ),
            ),
        ),
    ],
)
def test_restarted_supervisor_never_reuses_an_epoch_of_its_predecessor(persisted):
    w = World(4, 2)
    assert w.round().outcome == "committed"
    durable_epoch = w.epoch  # what the supervisor saved at the end of round 0
    w.crash(["c3r0", "c3r1"])
    w.halt_before = {"outer_commit"}  # supervisor A reduces over {c0, c1, c2}, then dies before the commit
    a = w.machine(configured={}, outer_configured=None)
    w.drive(a)
    assert w.halted and w.reps["c0r0"].buffer[2] == (0, 1, 2)
    w.halt_before = set()
    w.drain()
    w.restart_dead()  # c3 comes back (fresh) ...
    w.crash(["c2r0", "c2r1"])  # ... and c2 is lost
    # supervisor B: nothing configured; its epoch is the durable one, or the last one A issued
    w.leaders, w.configured, w.outer_configured = {}, {}, None
    w.epoch = a.epoch if persisted else durable_epoch
    m = w.round()
    assert outcome_of(w, m) == "committed"


def test_stale_answers_are_ignored():
    w = World(1, 2)
    m = w.machine()
    m.start(0.0)
    assert m.observe(Answer(999, "c0r0", DONE, 0, SPR), 1.0) == []
    assert m.observe(Answer(0, "c9r9", DONE, 0, SPR), 1.0) == []


@pytest.mark.parametrize("outer", ["average", "diloco", "none"])
def test_outer_modes_commit(outer):
    w = World(2, 2, settings=make_settings(outer=outer))
    assert outcome_of(w, w.round()) == "committed"


def _machine_in_inner(n=3):
    from hsgd.core.round import RoundMachine, RoundSettings
    from hsgd.core.topology import Topology

    m = RoundMachine(
        Topology(1, n),
        RoundSettings(steps_per_round=10),
        0,
        progress={f"c0r{i}": (0, 0) for i in range(n)},
        leaders={},
        epoch=0,
        committed_round=0,
    )
    (inner,) = m.start(0.0)
    assert inner.kind == "run_inner" and inner.calls["c0r0"] == RunInner(Join("epoch1/inner/c0", 0, n)), (
        "the first run forms the group"
    )
    return m, inner


@pytest.mark.parametrize(
    "kind,reaped",
    [
        (ErrorKind.PEER_GONE, True),
        (ErrorKind.TIMEOUT, False),  # a timeout says nothing about who is gone
    ],
)
def test_a_peer_whose_connection_closed_is_presumed_dead_without_waiting_for_ray(kind, reaped):
    m, inner = _machine_in_inner()
    for rid in ("c0r0", "c0r1"):
        # the detail is the backend's text, which the machine never reads: only the kind decides
        assert (
            m.observe(Answer(inner.id, rid, Outcome.COLLECTIVE_FAILED, 0, 3, kind, "Connection closed by peer"), 1.0)
            == []
        )
    actions = decisions(m.tick(1.0 + m.settings.presumed_dead_s + 0.01))
    if reaped:
        assert [a.kind for a in actions] == ["reap", "run_inner"], actions
        assert m.dead == {"c0r2": "died"} and set(actions[1].calls) == {"c0r0", "c0r1"}
    else:
        assert actions == [] and not m.dead, "a timed-out peer may be hung or slow: only its limit decides"


def _fifo_round(batch: int) -> tuple[RoundMachine, list]:
    """One round at 6 x 3 with a death mid-inner (c1r1), a collective failing in c2, a leader dying
    in the outer reduce (c4's) and a commit broadcast breaking in c5, answers handed over first in,
    first out, `batch` at a time (1: through on_result)."""
    from collections import deque

    topo = Topology(6, 3)
    m = RoundMachine(
        topo,
        make_settings(),
        0,
        progress={rid: (0, 0) for rid in topo.replica_ids()},
        leaders={},
        epoch=0,
        committed_round=0,
    )
    where = {rid: (0, 0) for rid in topo.replica_ids()}
    faults = {
        ("run_inner", "c1r1"): DIED,
        ("run_inner", "c2r0"): CFAILED,
        ("outer_reduce", "c4r0"): DIED,
        ("outer_commit", "c5r2"): CFAILED,
    }
    queue: deque = deque()
    log: list = []

    def issue(actions):
        for a in actions:
            if isinstance(a, PhaseEnded):  # (its time is when the batch was handed over)
                log.append(("ended", a.phase.id, tuple(sorted(a.answers.items()))))
                continue
            if not isinstance(a, Phase):
                log.append(a)
                continue
            log.append((a.id, a.kind, a.cluster, a.epoch, tuple(sorted(a.calls.items()))))
            for rid in a.calls:
                outcome = faults.pop((a.kind, rid), DONE)
                if a.kind == "run_inner":
                    where[rid] = (0, SPR) if outcome == DONE else (0, SPR // 2)
                elif a.kind == "outer_commit" and outcome == DONE:
                    where[rid] = (1, SPR)
                elif a.kind == "heal":
                    where[rid] = where[a.calls[rid].source]
                r, s = where[rid] if outcome != DIED else (-1, -1)
                queue.append(Answer(a.id, rid, outcome, r, s))

    issue(m.start(0.0))
    now = 0.0
    while not m.done and queue:
        chunk = [queue.popleft() for _ in range(min(batch, len(queue)))]
        now += 1.0
        issue(m.observe_all(chunk, now) if batch > 1 else m.observe(chunk[0], now))
    return m, log


@pytest.mark.parametrize("batch", [2, 7, 1000])
def test_answers_in_batches_decide_exactly_as_one_by_one(batch):
    one, one_log = _fifo_round(1)
    many, many_log = _fifo_round(batch)
    assert one.outcome == "committed" and one.dead == {"c1r1": "died", "c4r0": "died"}
    assert many_log == one_log
    assert (many.outcome, many.progress, many.epoch, many.leaders, many.committed_by) == (
        one.outcome,
        one.progress,
        one.epoch,
        one.leaders,
        one.committed_by,
    )


def test_heals_at_rest_bring_every_cluster_to_the_furthest_round():
    from hsgd.core.round import heals_at_rest

    topo = Topology(3, 2)
    live = {"c0r0": (5, 50), "c0r1": (4, 40), "c1r0": (4, 40), "c1r1": (4, 40), "c2r0": (5, 50), "c2r1": (5, 50)}
    heals = heals_at_rest(topo, live)
    assert sorted(heals) == [0, 1], "c2 is at the top already"
    assert [(h.target, h.source, h.scope) for h in heals[0]] == [("c0r1", "c0r0", "full")]
    assert {(h.target, h.scope) for h in heals[1]} == {("c1r0", "global"), ("c1r1", "global")}
    assert {h.source for h in heals[1]} == {"c0r0"}, "the lowest-id donor of another cluster"


def test_a_replica_lost_while_waiting_to_be_taken_in_mid_round_is_not_taken_in():
    """c0r2 comes back while its cluster heals (it waits to be taken in when the heal ends) and dies
    again before that: the cluster goes on without it rather than forming a group it never joins."""
    topo = Topology(1, 3)
    m = RoundMachine(
        topo, make_settings(), 0, progress={"c0r0": (0, 5), "c0r1": (0, 2)}, leaders={}, epoch=0, committed_round=0
    )
    (heal,) = m.start(0.0)
    assert heal.kind == "heal" and heal.calls == {"c0r1": Heal("c0r0", "full")}
    assert m.observe(Up("c0r2", 0, 0), 1.0) == [] and m.joining == {0: {"c0r2": (0, 0)}}
    assert m.observe(Lost("c0r2"), 1.5) == []
    (run,) = decisions(m.observe(Answer(heal.id, "c0r1", DONE, 0, 5), 2.0))
    assert run.kind == "run_inner" and sorted(run.calls) == ["c0r0", "c0r1"], run.calls


# -- typed calls and answers --------------------------------------------------------------------------------
def test_each_call_kind_owns_its_record_name_seconds_key_and_fault_phases():
    from hsgd.core.round import CallKind

    assert {k.value: (k.record, k.seconds_key, k.fault_phases) for k in CallKind} == {
        "heal": ("heal", "heal_configure", ("heal",)),
        "run_inner": ("inner", "inner", ("inner", "inner_sync")),
        "cluster_average": ("inner_sync", "inner_sync", ("inner_sync",)),
        "outer_reduce": ("outer", "outer", ("outer",)),
        "outer_commit": ("outer_commit", "outer_commit", ("outer_commit",)),
    }
    assert CallKind("run_inner") is CallKind.RUN_INNER and f"{CallKind.HEAL}" == "heal"
    assert [k for k in CallKind if k.voids] == [CallKind.RUN_INNER, CallKind.CLUSTER_AVERAGE, CallKind.OUTER_REDUCE]


def test_a_phase_forms_its_group_when_its_calls_carry_a_join():
    from hsgd.core.round import CallKind, OuterReduce

    forming = Phase(0, CallKind.OUTER_REDUCE, 0, None, 3, {"c0r0": OuterReduce(Join("epoch3/outer", 0, 2))})
    standing = Phase(1, CallKind.RUN_INNER, 0, 0, 3, {"c0r0": RunInner(None, Overlap(2, 0, 1))})
    assert forming.forms_group and forming.prefix == "epoch3/outer"
    assert not standing.forms_group and standing.prefix is None


def test_a_phase_answer_crosses_ray_as_a_flat_dict_and_reads_back_the_same():
    from hsgd.core.round import PhaseAnswer

    answer = PhaseAnswer(
        "c0r1", Outcome.COLLECTIVE_FAILED, 2, 17, "peer closed", ErrorKind.PEER_GONE, result={"join_s": 0.5}
    )
    wire = answer.wire()
    assert wire["outcome"] == "collective_failed" and wire["error_kind"] == "peer_gone" and wire["join_s"] == 0.5
    assert "ok" not in wire and PhaseAnswer.read(wire) == answer
    assert PhaseAnswer.read({**wire, "error_kind": "newer_kind"}).error_kind is ErrorKind.NONE


def test_whose_failure_a_call_without_an_answer_is():
    from hsgd.core.round import raised, unanswered_heal

    assert raised(actor_gone=True, source_failed=True) == Outcome.COLLECTIVE_FAILED, "a heal source's, not the target's"
    assert raised(actor_gone=True, source_failed=False) == Outcome.DIED
    assert raised(actor_gone=False, source_failed=False) == Outcome.ERROR
    assert unanswered_heal(False, in_time=False) == Outcome.COLLECTIVE_FAILED and unanswered_heal(False) == Outcome.DIED
    assert unanswered_heal(True) == Outcome.COLLECTIVE_FAILED


def test_cluster_stages_derive_who_sits_out_and_who_is_ready():
    from hsgd.core.round import ClusterStage, OuterStage

    m = World(3, 1).machine()
    assert m.not_ready and m.out == set() and m.outer_stage is OuterStage.WAIT
    m.clusters[0].stage, m.clusters[1].stage, m.clusters[2].stage = (
        ClusterStage.OUT,
        ClusterStage.READY,
        ClusterStage.INNER,
    )
    assert m.out == {0} and m.participating() == [1, 2] and m.not_ready and m.view_phase == "inner"
    m.clusters[2].stage = ClusterStage.READY
    assert not m.not_ready and m.view_phase == "ready"
