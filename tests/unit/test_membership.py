"""hsgd.core.topology and hsgd.core.membership: ids, the epoch/leader/quorum state machine and its plans."""

import random

import pytest

from hsgd.core.membership import Plan, leader_of, live_plan, quorum_problem
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
    assert [topo.global_index(rid) for rid in topo.replica_ids()] == list(range(12)), (
        "global indices must be dense and unique (data sharding and RNG streams depend on it)"
    )


# -- membership: live_plan and the leader rule ----------------------------------------------------------
def _plan(live, leaders, clusters=2, rpc=3, **kw) -> Plan:
    return live_plan(Topology(clusters, rpc), set(live), leaders, 1, **kw)


def test_first_plan_has_every_live_replica_in_index_order():
    plan = _plan(Topology(2, 3).replica_ids(), {})
    assert plan.members == {0: ("c0r0", "c0r1", "c0r2"), 1: ("c1r0", "c1r1", "c1r2")}
    assert plan.leaders == {0: "c0r0", 1: "c1r0"}
    assert plan.outer_clusters == (0, 1)
    assert plan.live == ("c0r0", "c0r1", "c0r2", "c1r0", "c1r1", "c1r2")


def test_leader_is_sticky_while_alive():
    assert leader_of(("c0r0", "c0r1"), "c0r1") == "c0r1", "a live leader keeps its role (no needless re-wiring)"
    assert leader_of(("c0r1", "c0r2"), "c0r0") == "c0r1"
    assert leader_of(("c0r0", "c0r1", "c0r2"), "c0r1") == "c0r1", "the old leader coming back takes nothing back"


def test_dead_leader_is_replaced_by_lowest_live_index():
    leaders = {1: "c1r0"}
    assert _plan(["c1r2", "c1r3"], leaders, rpc=4).leaders[1] == "c1r2"
    assert _plan(["c1r1", "c1r3"], leaders, rpc=4).leaders[1] == "c1r1"


@pytest.mark.parametrize("seed", range(10))
def test_plan_does_not_depend_on_the_order_replicas_came_alive(seed):
    topo_ids = Topology(3, 4).replica_ids()
    rng = random.Random(seed)
    alive = rng.sample(topo_ids, k=rng.randrange(1, len(topo_ids) + 1))
    shuffled = list(alive)
    rng.shuffle(shuffled)
    a = _plan(sorted(alive), {}, 3, 4)
    b = _plan(shuffled, {}, 3, 4)
    assert a == b, "plans must not depend on registration order"
    for cluster, members in b.members.items():
        assert list(members) == sorted(members, key=parse_replica_id), "inner ranks must follow replica index"
        assert b.leaders[cluster] == members[0]


def test_cluster_below_min_replicas_goes_out_of_outer_sync():
    live = set(Topology(3, 3).replica_ids()) - {"c1r0", "c1r2"}
    plan = _plan(live, {}, 3, 3, min_replicas_per_cluster=2)
    assert plan.outer_clusters == (0, 2), "a cluster below min_replicas_per_cluster must sit out outer sync"
    assert 1 not in plan.members and 1 not in plan.leaders
    assert "c1r1" not in plan.live


def test_quorum_problem_names_each_clusters_live_count():
    assert quorum_problem([2, 0, 1], 1, 2) is None
    problem = quorum_problem([2, 0, 1], 2, 2)
    assert problem is not None and "c0=2, c1=0, c2=1" in problem and "\n" not in problem, problem


def test_no_live_replicas_gives_an_empty_plan():
    plan = _plan([], {}, 2, 2)
    assert plan.members == {} and plan.leaders == {} and plan.outer_clusters == () and plan.live == ()


def test_plan_equality_is_by_value():
    assert Plan(epoch=1, members={0: ("c0r0",)}, leaders={0: "c0r0"}) == Plan(
        epoch=1, members={0: ("c0r0",)}, leaders={0: "c0r0"}
    )


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
    assert plan.outer_clusters == (0, 1) and "c2r1" not in plan.live and plan.epoch == 7
    assert leaders[1] == "c1r1", "the choice is remembered"
