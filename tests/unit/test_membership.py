"""hsgd.core.topology and hsgd.core.membership: ids, the epoch/leader/quorum state machine and its plans."""
import random

import pytest

from hsgd.core.membership import Membership, Plan, live_per_cluster, quorum_problem
from hsgd.core.topology import Topology, parse_replica_id, replica_id


# -- topology -------------------------------------------------------------------------------------
def test_replica_ids_round_trip():
    assert replica_id(1, 0) == "c1r0"
    assert parse_replica_id("c1r0") == (1, 0)
    assert parse_replica_id("c12r34") == (12, 34)


@pytest.mark.parametrize("bad", ["", "c1", "r0", "c-1r0", "C1R0", "c1r0x", "xc1r0", "leader:c1", "c1 r0"])
def test_parse_replica_id_rejects_anything_else(bad):
    with pytest.raises(ValueError, match="not a replica id"):
        parse_replica_id(bad)


def test_topology_lists_ids_cluster_major():
    topo = Topology(clusters=2, replicas_per_cluster=3)
    assert topo.num_replicas == 6
    assert topo.replica_ids() == ["c0r0", "c0r1", "c0r2", "c1r0", "c1r1", "c1r2"]
    assert topo.cluster_members(1) == ["c1r0", "c1r1", "c1r2"]
    assert topo.cluster_of("c1r2") == 1


def test_global_index_is_cluster_times_replicas_per_cluster_plus_index():
    topo = Topology(clusters=3, replicas_per_cluster=4)
    for c in range(3):
        for r in range(4):
            assert topo.global_index(replica_id(c, r)) == c * 4 + r
    assert [topo.global_index(rid) for rid in topo.replica_ids()] == list(range(12)), \
        "global indices must be dense and unique (data sharding and RNG streams depend on it)"


# -- membership -----------------------------------------------------------------------------------
def _membership(clusters=2, rpc=3, alive=None, **kw) -> Membership:
    m = Membership(Topology(clusters, rpc), **kw)
    for rid in (alive if alive is not None else m.topology.replica_ids()):
        m.mark_alive(rid)
    return m


def test_first_plan_has_every_live_replica_in_index_order():
    plan = _membership().plan()
    assert plan.epoch == 1
    assert plan.members == {0: ("c0r0", "c0r1", "c0r2"), 1: ("c1r0", "c1r1", "c1r2")}
    assert plan.leaders == {0: "c0r0", 1: "c1r0"}
    assert plan.outer_clusters == (0, 1) and plan.standby == ()
    assert plan.live == ("c0r0", "c0r1", "c0r2", "c1r0", "c1r1", "c1r2")
    assert [plan.inner_rank(r) for r in plan.members[1]] == [0, 1, 2]
    assert plan.outer_rank(1) == 1 and plan.is_leader("c1r0") and not plan.is_leader("c1r1")


def test_epoch_bumps_on_every_change_and_only_on_change():
    m = _membership()
    e1 = m.plan().epoch
    assert m.plan().epoch == e1, "epoch must not bump when nothing changed"
    assert m.mark_alive("c0r0") is False, "marking a live replica alive is not a change"
    assert m.plan().epoch == e1, "a no-op mark_alive must not bump the epoch"
    assert m.mark_dead("c0r1") is True
    e2 = m.plan().epoch
    assert e2 > e1, "a death must bump the epoch"
    assert m.mark_dead("c0r1") is False, "marking a dead replica dead is not a change"
    assert m.plan().epoch == e2
    assert m.mark_alive("c0r1") is True
    e3 = m.plan().epoch
    assert e3 > e2, "a (re)join must bump the epoch"
    m.mark_dead("c1r2")  # a change at the other cluster (inner level only) also bumps
    assert m.plan().epoch > e3


def test_epochs_continue_from_the_given_start_epoch():
    m = _membership(epoch=41)
    assert m.plan().epoch == 42, "a restarted supervisor must never reuse an older epoch"


def test_force_new_epoch_bumps_without_membership_change():
    m = _membership()
    before = m.plan()
    m.force_new_epoch()
    after = m.plan()
    assert after.epoch == before.epoch + 1
    assert (after.members, after.leaders, after.outer_clusters) == (before.members, before.leaders, before.outer_clusters)


def test_prefixes_name_level_and_epoch_and_differ_across_epochs():
    m = _membership()
    p1 = m.plan()
    m.force_new_epoch()
    p2 = m.plan()
    assert p1.inner_prefix(1) == f"epoch{p1.epoch}/inner/c1"
    assert p1.outer_prefix() == f"epoch{p1.epoch}/outer"
    prefixes = {p.inner_prefix(c) for p in (p1, p2) for c in (0, 1)} | {p1.outer_prefix(), p2.outer_prefix()}
    assert len(prefixes) == 6, "every (level, cluster, epoch) must get its own store prefix"


def test_leader_is_sticky_while_alive():
    m = _membership()
    m.plan()
    m.mark_dead("c0r0")
    assert m.plan().leaders[0] == "c0r1"
    m.mark_alive("c0r0")  # the old leader comes back: it must not take the role back
    plan = m.plan()
    assert plan.leaders[0] == "c0r1", "a live leader keeps its role (no needless re-wiring)"
    m.mark_dead("c0r2")  # a non-leader death does not move the leader either
    assert m.plan().leaders[0] == "c0r1"


def test_dead_leader_is_replaced_by_lowest_live_index():
    m = _membership(rpc=4)
    m.plan()
    m.mark_dead("c1r0")
    m.mark_dead("c1r1")
    assert m.plan().leaders[1] == "c1r2"
    m.mark_alive("c1r1")
    m.mark_dead("c1r2")
    assert m.plan().leaders[1] == "c1r1"


@pytest.mark.parametrize("seed", range(10))
def test_plan_does_not_depend_on_the_order_replicas_came_alive(seed):
    topo_ids = Topology(3, 4).replica_ids()
    rng = random.Random(seed)
    alive = rng.sample(topo_ids, k=rng.randrange(1, len(topo_ids) + 1))
    shuffled = list(alive)
    rng.shuffle(shuffled)
    a = _membership(3, 4, alive=sorted(alive)).plan()
    b = _membership(3, 4, alive=shuffled).plan()
    assert a == b, "plans must not depend on registration order"
    for cluster, members in b.members.items():
        assert list(members) == sorted(members, key=parse_replica_id), "inner ranks must follow replica index"
        assert b.leaders[cluster] == members[0]


def test_cluster_below_min_replicas_goes_to_standby_and_out_of_outer_sync():
    m = _membership(clusters=3, rpc=3, min_replicas_per_cluster=2)
    m.plan()
    m.mark_dead("c1r0")
    m.mark_dead("c1r2")
    plan = m.plan()
    assert plan.outer_clusters == (0, 2), "a cluster below min_replicas_per_cluster must sit out outer sync"
    assert 1 not in plan.members and 1 not in plan.leaders
    assert plan.standby == ("c1r1",), "its live replicas wait in standby"
    assert "c1r1" not in plan.live
    assert plan.outer_rank(2) == 1, "outer ranks are positions in outer_clusters"
    assert m.quorum_problem() is None
    m.mark_alive("c1r2")
    back = m.plan()
    assert back.outer_clusters == (0, 1, 2) and back.standby == () and back.epoch > plan.epoch


def test_quorum_problem_when_below_min_clusters():
    m = _membership(clusters=2, rpc=2, min_clusters=2)
    assert m.quorum_problem() is None
    m.mark_dead("c1r0")
    m.mark_dead("c1r1")
    problem = m.quorum_problem()
    assert problem is not None and "\n" not in problem
    assert "min_clusters=2" in problem and "c0=2" in problem and "c1=0" in problem, problem
    assert m.plan().outer_clusters == (0,)


def test_live_per_cluster_counts_each_clusters_live_replicas_for_the_quorum_rule():
    topo = Topology(clusters=3, replicas_per_cluster=2)
    assert live_per_cluster(topo, []) == [0, 0, 0]
    live = {"c0r0", "c0r1", "c2r1"}
    assert live_per_cluster(topo, live) == [2, 0, 1]
    assert live_per_cluster(topo, ["c5r0"]) == [0, 0, 0], "an id of no cluster here counts nowhere"
    assert quorum_problem(live_per_cluster(topo, live), 1, 2) is None
    problem = quorum_problem(live_per_cluster(topo, live), 2, 2)
    assert problem is not None and "c0=2, c1=0, c2=1" in problem, problem
    m = Membership(topo, min_replicas_per_cluster=2, min_clusters=2)
    for rid in live:
        m.mark_alive(rid)
    assert m.quorum_problem() == problem, "the supervisor's count and Membership's must agree"


def test_no_live_replicas_gives_an_empty_plan():
    m = Membership(Topology(2, 2))
    plan = m.plan()
    assert plan.members == {} and plan.leaders == {} and plan.outer_clusters == () and plan.live == ()
    assert m.quorum_problem() is not None


def test_plan_is_a_snapshot_not_a_view():
    m = _membership()
    plan = m.plan()
    m.mark_dead("c0r0")
    m.plan()
    assert plan.leaders[0] == "c0r0" and "c0r0" in plan.members[0], "an issued plan must not change later"


def test_plan_equality_is_by_value():
    assert Plan(epoch=1, members={0: ("c0r0",)}, leaders={0: "c0r0"}, outer_clusters=(0,)) == \
        Plan(epoch=1, members={0: ("c0r0",)}, leaders={0: "c0r0"}, outer_clusters=(0,))


# -- quorum_problem / live_plan: the rules the supervisor applies between rounds --------------------------
def test_quorum_problem_counts_clusters_at_their_minimum_and_names_every_count():
    from hsgd.core.membership import quorum_problem

    assert quorum_problem([2, 1, 0], min_replicas_per_cluster=1, min_clusters=2) is None
    reason = quorum_problem([2, 1, 0], min_replicas_per_cluster=2, min_clusters=2)
    assert reason == "only 1 cluster(s) with >= 2 live replicas (c0=2, c1=1, c2=0); min_clusters=2"


def test_live_plan_keeps_sticky_leaders_replaces_a_missing_one_and_puts_small_clusters_on_standby():
    from hsgd.core.membership import live_plan

    topo = Topology(3, 3)
    leaders = {0: "c0r2", 1: "c1r0"}
    live = {"c0r0", "c0r2", "c1r1", "c1r2", "c2r1"}
    plan = live_plan(topo, live, leaders, epoch=7, min_replicas_per_cluster=2)
    assert plan.members == {0: ("c0r0", "c0r2"), 1: ("c1r1", "c1r2")}
    assert plan.leaders == {0: "c0r2", 1: "c1r1"}, "c0 keeps its leader; c1's is gone: the lowest live index"
    assert plan.outer_clusters == (0, 1) and plan.standby == ("c2r1",) and plan.epoch == 7
    assert leaders[1] == "c1r1", "the choice is remembered"
