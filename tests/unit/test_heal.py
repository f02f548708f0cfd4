"""hsgd.core.round.schedule: "max committed wins" — who copies state from whom, deterministically.

Semantics applied below (module docstring + ReplicaTrainer.load_state_dict): `full` makes the
target equal to its source's (round, step); `global` gives it the source's round and restarts that
round, so step = round * steps_per_round (step counts committed inner steps in total).
"""

import random

import pytest

from hsgd.core.membership import live_plan
from hsgd.core.round import heals_at_rest
from hsgd.core.round.schedule import HealAssignment
from hsgd.core.topology import Topology, parse_replica_id

SPR = 10  # steps per round


def _plan(clusters, rpc, alive=None, min_replicas_per_cluster=1):
    topo = Topology(clusters, rpc)
    return live_plan(topo, set(alive if alive is not None else topo.replica_ids()), {}, 1, min_replicas_per_cluster)


def assign_heals(progress, plan):
    """The heals of the plan's members that reported, as the supervisor computes them
    (hsgd.core.round.schedule.assign_cluster_heals per cluster, through heals_at_rest)."""
    ids = [parse_replica_id(rid) for rid in plan.live] or [(0, 0)]
    topo = Topology(max(c for c, _ in ids) + 1, max(r for _, r in ids) + 1)
    live = {rid: progress[rid] for rid in plan.live if rid in progress}
    return [h for _, heals in sorted(heals_at_rest(topo, live).items()) for h in heals]


def _apply(progress, heals, steps_per_round=SPR):
    after = dict(progress)
    for h in heals:
        src_round, src_step = progress[h.source]
        after[h.target] = (src_round, src_step) if h.scope == "full" else (src_round, src_round * steps_per_round)
    return after


def test_nothing_to_heal_when_everyone_is_level():
    plan = _plan(2, 2)
    assert assign_heals({rid: (3, 30) for rid in plan.live}, plan) == []


def test_nothing_to_heal_without_reports():
    assert assign_heals({}, _plan(2, 2)) == []


def test_laggard_heals_full_from_the_furthest_step_of_its_cluster():
    plan = _plan(2, 3)
    progress = {"c0r0": (1, 13), "c0r1": (1, 17), "c0r2": (1, 15), "c1r0": (1, 14), "c1r1": (1, 14), "c1r2": (1, 14)}
    heals = assign_heals(progress, plan)
    assert sorted(heals, key=lambda h: h.target) == [
        HealAssignment("c0r0", "c0r1", "full"),
        HealAssignment("c0r2", "c0r1", "full"),
    ], "a replica behind its cluster's furthest step must heal (full) from it: no completed step thrown away"


def test_tie_on_furthest_step_picks_lowest_index_numerically():
    plan = _plan(1, 11)
    progress = {rid: (0, 3) for rid in plan.live}
    progress["c0r10"] = (0, 5)
    progress["c0r2"] = (0, 5)
    sources = {h.source for h in assign_heals(progress, plan)}
    assert sources == {"c0r2"}, "ties break by replica index as a number (c0r2 < c0r10), not as text"


def test_replica_behind_a_round_heals_full_from_its_own_cluster_when_possible():
    plan = _plan(2, 2)
    progress = {"c0r0": (2, 20), "c0r1": (2, 20), "c1r0": (1, 20), "c1r1": (2, 22)}
    assert assign_heals(progress, plan) == [HealAssignment("c1r0", "c1r1", "full")], (
        "a replica that missed a commit heals from its own cluster (keeps the cluster's inner progress)"
    )


def test_cluster_behind_a_round_heals_global_from_lowest_id_at_top_round():
    plan = _plan(3, 2)
    progress = {
        "c0r0": (2, 21),
        "c0r1": (2, 25),  # c0r1 is further in step, but c0r0 has the lowest id
        "c1r0": (1, 14),
        "c1r1": (1, 12),
        "c2r0": (2, 29),
        "c2r1": (2, 29),
    }
    heals = assign_heals(progress, plan)
    assert HealAssignment("c1r0", "c0r0", "global") in heals and HealAssignment("c1r1", "c0r0", "global") in heals
    assert HealAssignment("c0r0", "c0r1", "full") in heals
    assert len(heals) == 3


def test_global_donor_is_lowest_id_numerically():
    plan = _plan(11, 1)
    progress = {rid: (1, 10) for rid in plan.live}
    progress["c10r0"] = (2, 20)
    progress["c2r0"] = (2, 20)
    sources = {h.source for h in assign_heals(progress, plan) if h.scope == "global"}
    assert sources == {"c2r0"}, "c2r0 < c10r0 as ids; text order would pick c10r0"


def test_only_reported_plan_members_are_considered():
    plan = _plan(2, 2, alive=["c0r0", "c0r1", "c1r0", "c1r1"])
    progress = {"c0r0": (1, 10), "c1r0": (1, 15), "c1r1": (1, 12), "c9r9": (7, 70)}  # c0r1 did not report
    heals = assign_heals(progress, plan)
    assert heals == [HealAssignment("c1r1", "c1r0", "full")]


def test_standby_replicas_are_neither_healed_nor_sources():
    plan = _plan(2, 2, alive=("c0r0", "c0r1", "c1r0"), min_replicas_per_cluster=2)
    assert "c1r0" not in plan.live
    heals = assign_heals({"c0r0": (1, 10), "c0r1": (1, 10), "c1r0": (5, 50)}, plan)
    assert heals == [], "a standby replica is outside the quorum: it neither heals nor serves as source"


@pytest.mark.parametrize("seed", range(5))
def test_assignments_do_not_depend_on_dict_order(seed):
    rng = random.Random(seed)
    plan = _plan(3, 3)
    progress = {rid: (rng.randrange(2), 0) for rid in plan.live}
    progress = {rid: (r, r * SPR + rng.randrange(SPR + 1)) for rid, (r, _) in progress.items()}
    expected = assign_heals(progress, plan)
    for _ in range(5):
        items = list(progress.items())
        rng.shuffle(items)
        assert assign_heals(dict(items), plan) == expected, "heal choice must not depend on report order"


def _random_case(rng):
    clusters, rpc = rng.randrange(1, 5), rng.randrange(1, 5)
    ids = Topology(clusters, rpc).replica_ids()
    alive = rng.sample(ids, k=rng.randrange(1, len(ids) + 1))
    plan = _plan(clusters, rpc, alive=alive)
    top = rng.randrange(0, 4)
    progress = {}
    for rid in plan.live:
        rnd = max(0, top - rng.choice((0, 0, 1, 2)))
        progress[rid] = (rnd, rnd * SPR + rng.randrange(SPR + 1))
    items = list(progress.items())
    rng.shuffle(items)
    return plan, dict(items)


@pytest.mark.parametrize("seed", range(40))
def test_after_healing_every_cluster_agrees_and_nobody_goes_back(seed):
    rng = random.Random(seed)
    for _ in range(25):
        plan, progress = _random_case(rng)
        heals = assign_heals(progress, plan)
        targets = [h.target for h in heals]
        assert len(targets) == len(set(targets)), f"a replica was assigned two heals: {heals}"
        for h in heals:
            assert h.scope in ("full", "global")
            assert h.source != h.target and h.source in progress and h.target in progress
            same = parse_replica_id(h.source)[0] == parse_replica_id(h.target)[0]
            assert same == (h.scope == "full"), f"`full` heals stay in the cluster, `global` cross it: {h}"
        after = _apply(progress, heals)
        top_round = max(r for r, _ in progress.values())
        for cluster, members in plan.members.items():
            states = {after[rid] for rid in members}
            assert len(states) == 1, f"cluster c{cluster} disagrees after healing: {states} ({progress}, {heals})"
            ((rnd, step),) = states
            assert rnd == top_round, f"cluster c{cluster} left behind the committed round {top_round}"
            at_top = [progress[rid][1] for rid in members if progress[rid][0] == top_round]
            expected_step = max(at_top) if at_top else top_round * SPR
            assert step == expected_step, f"c{cluster}: completed steps thrown away ({progress}, {heals})"
        for rid, before in progress.items():
            assert after[rid][0] >= before[0], f"{rid} went back a round: {before} -> {after[rid]}"
            assert after[rid][1] >= before[1], f"{rid} lost committed steps: {before} -> {after[rid]}"
