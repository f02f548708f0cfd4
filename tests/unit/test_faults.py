"""hsgd.core.faults: the public fault grammar, its one-line errors, and reproducible random schedules."""

import pytest

from hsgd.core.faults import (
    FAULT_KINDS,
    FaultSpec,
    FaultSpecError,
    parse_fault,
    parse_schedule,
    random_schedule,
)
from hsgd.core.phases import FAULT, Phase
from hsgd.core.topology import parse_replica_id, replica_id
from tests.fakes.event_log import EventLog

FAULT_PHASES = Phase.having(FAULT)

TOPO = {"clusters": 2, "replicas_per_cluster": 2}


def _fails(raw, field, *, index=0, **topo):
    with pytest.raises(FaultSpecError) as info:
        parse_fault(raw, index=index, **(topo or TOPO))
    err = info.value
    assert err.field == field, f"rule broke: error should name {field!r}, named {err.field!r}: {err}"
    assert "\n" not in str(err) and str(err).startswith(field + ":"), (
        f"error must be one line naming the field: {err!r}"
    )
    return err


def test_public_form_parses_to_a_spec():
    spec = parse_fault({"kind": "kill", "target": "c0r1", "round": 2, "phase": "inner", "step": 3}, **TOPO)
    assert spec == FaultSpec(kind="kill", target="c0r1", round=2, phase="inner", step=3, seconds=None)
    assert spec.target_kind == "replica" and spec.target_cluster == 0
    assert spec.describe() == "kill c0r1 at round 2 inner step 3"


def test_phase_and_step_default_to_inner_step_zero():
    spec = parse_fault({"kind": "crash", "target": "c1r0", "round": 0}, **TOPO)
    assert (spec.phase, spec.step) == ("inner", 0)


@pytest.mark.parametrize(
    "target,target_kind,cluster",
    [
        ("c1r0", "replica", 1),
        ("leader:c1", "leader", 1),
        ("cluster:c0", "cluster", 0),
        ("supervisor", "supervisor", None),
    ],
)
def test_every_target_form_is_accepted(target, target_kind, cluster):
    spec = parse_fault({"kind": "kill", "target": target, "round": 1}, **TOPO)
    assert (spec.target, spec.target_kind, spec.target_cluster) == (target, target_kind, cluster)


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_every_kind_and_phase_is_accepted_for_a_replica(kind, phase):
    assert parse_fault({"kind": kind, "target": "c0r0", "round": 0, "phase": phase}, **TOPO).kind == kind


def test_a_death_can_be_placed_in_a_groups_rendezvous_with_phase_join():
    """`join` fires in a replica as it starts forming a group, before it arrives in the rendezvous;
    a config with it validates, and the supervisor, which forms no group, refuses it."""
    from hsgd.config import ConfigError, HsgdConfig, validate

    spec = parse_fault({"kind": "kill", "target": "c1r1", "round": 0, "phase": "join"}, **TOPO)
    assert (spec.phase, spec.describe()) == ("join", "kill c1r1 at round 0 join")
    cfg = HsgdConfig()
    cfg.faults.schedule = [{"kind": "kill", "target": "c1r1", "round": 0, "phase": "join"}]
    validate(cfg)
    cfg.faults.schedule = [{"kind": "kill", "target": "supervisor", "round": 0, "phase": "join"}]
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.field == "faults.schedule[0].phase"


def test_seconds_accepted_for_hang_and_slow():
    assert parse_fault({"kind": "hang", "target": "c0r0", "round": 0, "seconds": 2}, **TOPO).seconds == 2.0
    assert parse_fault({"kind": "slow", "target": "c0r0", "round": 0, "seconds": 0.25}, **TOPO).seconds == 0.25


def test_unknown_kind_is_rejected_listing_kinds():
    err = _fails({"kind": "explode", "target": "c0r0", "round": 1}, "faults.schedule[0].kind")
    assert "|".join(FAULT_KINDS) in str(err)


def test_unknown_phase_is_rejected_listing_phases():
    err = _fails({"kind": "kill", "target": "c0r0", "round": 1, "phase": "backward"}, "faults.schedule[0].phase")
    assert "|".join(FAULT_PHASES) in str(err)


@pytest.mark.parametrize(
    "target", ["c0", "r1", "replica:c0", "leader:1", "leader:c", "cluster:cx", "boss", "", "c0r1r2"]
)
def test_unknown_target_is_rejected(target):
    err = _fails({"kind": "kill", "target": target, "round": 1}, "faults.schedule[0].target")
    assert "supervisor" in str(err), f"error should list the valid target forms: {err}"


@pytest.mark.parametrize("target", ["c2r0", "c0r2", "leader:c2", "cluster:c5"])
def test_target_outside_the_topology_is_rejected(target):
    _fails({"kind": "kill", "target": target, "round": 1}, "faults.schedule[0].target")


def test_topology_bounds_follow_the_given_topology():
    parse_fault({"kind": "kill", "target": "c2r3", "round": 1}, clusters=3, replicas_per_cluster=4)
    _fails(
        {"kind": "kill", "target": "c2r3", "round": 1}, "faults.schedule[0].target", clusters=3, replicas_per_cluster=3
    )


def test_unknown_key_is_rejected_naming_the_key():
    err = _fails({"kind": "kill", "target": "c0r0", "round": 1, "when": 4}, "faults.schedule[0].when")
    assert "kind" in str(err) and "target" in str(err), f"error should list valid keys: {err}"


@pytest.mark.parametrize("key", ["kind", "target", "round"])
def test_missing_required_key_is_rejected(key):
    raw = {"kind": "kill", "target": "c0r0", "round": 1}
    del raw[key]
    _fails(raw, f"faults.schedule[0].{key}")


@pytest.mark.parametrize("key,bad", [("round", -1), ("step", -2), ("round", 1.5), ("step", "3"), ("round", True)])
def test_round_and_step_must_be_non_negative_integers(key, bad):
    raw = {"kind": "kill", "target": "c0r0", "round": 1, key: bad}
    _fails(raw, f"faults.schedule[0].{key}")


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_seconds_must_be_a_positive_number(bad):
    _fails({"kind": "hang", "target": "c0r0", "round": 1, "seconds": bad}, "faults.schedule[0].seconds")


@pytest.mark.parametrize("kind", ["hang", "comm", "slow"], ids=lambda k: f"kind-{k}")
def test_supervisor_accepts_only_kill_or_crash(kind):
    err = _fails({"kind": kind, "target": "supervisor", "round": 1}, "faults.schedule[0].kind")
    assert "kill|crash" in str(err)
    for ok in ("kill", "crash"):
        assert parse_fault({"kind": ok, "target": "supervisor", "round": 1}, **TOPO).target_kind == "supervisor"


def test_non_mapping_entry_is_rejected():
    _fails("kill c0r0", "faults.schedule[0]")


def test_schedule_errors_name_the_index_of_the_bad_entry():
    good = {"kind": "kill", "target": "c0r0", "round": 1}
    with pytest.raises(FaultSpecError) as info:
        parse_schedule([good, good, {"kind": "nope", "target": "c0r0", "round": 1}], **TOPO)
    assert info.value.field == "faults.schedule[2].kind"


def test_schedule_must_be_a_list():
    with pytest.raises(FaultSpecError) as info:
        parse_schedule({"kind": "kill"}, **TOPO)
    assert info.value.field == "faults.schedule"


def test_schedule_parses_in_order():
    raw = [{"kind": "kill", "target": "c0r1", "round": 2}, {"kind": "crash", "target": "leader:c1", "round": 0}]
    assert [f.target for f in parse_schedule(raw, **TOPO)] == ["c0r1", "leader:c1"]
    assert parse_schedule([], **TOPO) == []


@pytest.mark.parametrize("target", ["c00r1", "c0r01", "c0r1\n"])
def test_a_replica_target_that_validates_is_the_canonical_id_the_supervisor_matches(target):
    try:
        spec = parse_fault({"kind": "kill", "target": target, "round": 1}, **TOPO)
    except FaultSpecError as err:
        assert err.field == "faults.schedule[0].target"
        return
    assert spec.target == replica_id(*parse_replica_id(spec.target)), (
        f"accepted target {spec.target!r} is not a canonical replica id; it can never match a live replica"
    )


# -- random mode ----------------------------------------------------------------------------------
RANDOM = dict(
    mtbf_s=5.0,
    kinds=["kill", "crash"],
    rounds=10,
    round_s_estimate=4.0,
    steps_per_round=20,
    clusters=2,
    replicas_per_cluster=3,
)


def test_random_schedule_is_a_pure_function_of_the_seed():
    first = random_schedule(seed=7, **RANDOM)
    assert first, "with mtbf 5 s over a 40 s horizon some faults are expected"
    assert random_schedule(seed=7, **RANDOM) == first, "same seed must give the same schedule"
    assert random_schedule(seed=8, **RANDOM) != first, "another seed should give another schedule"


@pytest.mark.parametrize("seed", range(20))
def test_random_schedule_stays_within_the_run_and_topology(seed):
    faults = random_schedule(seed=seed, **RANDOM)
    for f in faults:
        assert 0 <= f.round < RANDOM["rounds"], f"fault beyond the run's rounds: {f}"
        assert 0 <= f.step < RANDOM["steps_per_round"], f"fault step outside the round: {f}"
        assert f.kind in RANDOM["kinds"] and f.phase == "inner"
        cluster, index = parse_replica_id(f.target)
        assert cluster < RANDOM["clusters"] and index < RANDOM["replicas_per_cluster"]
    assert [(f.round, f.step) for f in faults] == sorted((f.round, f.step) for f in faults), (
        "faults should come in firing order"
    )


def _plan():
    from hsgd.core.membership import live_plan
    from hsgd.core.topology import Topology

    return live_plan(Topology(2, 2), {"c0r0", "c0r1", "c1r1"}, {}, 1)  # c1r0 is dead: c1 is led by c1r1


def test_due_faults_resolve_leader_and_cluster_targets_under_the_current_plan():
    from hsgd.core.faults import FaultSpec, due_faults

    specs = parse_schedule(
        [
            {"kind": "kill", "target": "leader:c1", "round": 2, "phase": "outer"},
            {"kind": "crash", "target": "cluster:c0", "round": 2, "phase": "outer"},
            {"kind": "hang", "target": "c1r0", "round": 2, "phase": "outer"},  # dead: stays pending
            {"kind": "kill", "target": "supervisor", "round": 2, "phase": "outer"},
            {"kind": "kill", "target": "c0r0", "round": 3, "phase": "outer"},
        ],
        clusters=2,
        replicas_per_cluster=2,
    )
    due = due_faults(specs, [], round_index=2, phases=("outer",), plan=_plan())
    assert [(d.index, d.targets) for d in due] == [(0, ("c1r1",)), (1, ("c0r0", "c0r1"))]
    assert due[0].spec == FaultSpec("kill", "leader:c1", 2, "outer"), "the call carries the spec itself"


def test_due_faults_never_repeat_a_fired_fault_and_respect_only():
    from hsgd.core.faults import due_faults

    specs = parse_schedule(
        [{"kind": "crash", "target": "cluster:c0", "round": 1, "phase": "heal"}], clusters=2, replicas_per_cluster=2
    )
    assert due_faults(specs, [0], round_index=1, phases=("heal",), plan=_plan()) == []
    due = due_faults(specs, [], round_index=1, phases=("heal",), plan=_plan(), only={"c0r1"})
    assert [d.targets for d in due] == [("c0r1",)]


# -- the injector: a fault counts as fired when its line is written, never when armed ----------------


def _injector(tmp_path, schedule):
    from actors.fault_injector import FaultInjector
    from hsgd.record.run_state import RunState

    injector = FaultInjector.__new__(FaultInjector)  # no config: the schedule as given
    injector.run_dir, injector.state, injector.log, injector._save = (
        str(tmp_path),
        RunState(),
        EventLog(run_dir=tmp_path),
        lambda: None,
    )
    injector.shape, injector.faults, injector.missed = TOPO, parse_schedule(schedule, **TOPO), set()
    injector.armed_at, injector.deadly_armed = {}, set()
    return injector


def _fire(injector, rid, message, round_index, step, pid=1234):
    """What the replica does at the boundary (actors/replica.py `_fire`): its line first."""
    from hsgd.record.rundir import write_fault_fired

    write_fault_fired(
        injector.log.writer, injector.run_dir, rid, message.kind, message.phase, round_index, step, pid=pid
    )


def test_a_fault_armed_into_a_call_that_ended_before_its_step_is_carried_by_the_next_call(tmp_path):
    """Soak (seed 7): two kills on c0r1 in round 0, at steps 7 and 9, rode one call; the first killed
    it, the second was dropped with the call yet counted as fired. Likewise a member whose group
    broke before its fault's step: the re-formed cluster's next call must carry it."""
    from hsgd.core.membership import live_plan
    from hsgd.core.topology import Topology

    injector = _injector(
        tmp_path,
        [
            {"kind": "kill", "target": "c0r1", "round": 0, "step": 7},
            {"kind": "kill", "target": "c0r1", "round": 0, "step": 9},
        ],
    )
    plan = live_plan(Topology(2, 2), {"c0r0", "c0r1", "c1r0", "c1r1"}, {}, 1)
    first = injector.arm(0, ("inner",), plan, only={"c0r0", "c0r1"})
    assert [m.step for m in first["c0r1"]] == [7, 9]
    _fire(injector, "c0r1", first["c0r1"][0], 0, 7)  # the kill at step 7 fires; the call dies with it
    assert injector.pending(0, ("inner",)), "the step-9 kill never fired: it is still to come"
    again = injector.arm(0, ("inner",), plan, only={"c0r0", "c0r1"})  # c0r1 rejoined before step 9
    assert [m.step for m in again["c0r1"]] == [9], "the fired kill must never be carried twice"
    _fire(injector, "c0r1", again["c0r1"][0], 0, 9)
    assert injector.arm(0, ("inner",), plan, only={"c0r0", "c0r1"}) == {}
    injector.state.committed_round = 1
    assert injector.not_fired() == [] and sorted(injector.state.fired) == [0, 1]


def test_a_fault_whose_target_is_down_through_its_moment_is_recorded_target_down(tmp_path):
    """Soak (seed 7): c0r0 killed in round 5 was still restarting all of round 6, so 'kill c0r0 at
    round 6 inner step 8' had nothing to break: once the run has passed its round it is recorded
    from outside with target_down (no pid), never listed as a fault whose moment never came."""
    from hsgd.core.membership import live_plan
    from hsgd.core.topology import Topology
    from hsgd.record.rundir import read_jsonl

    injector = _injector(
        tmp_path,
        [
            {"kind": "kill", "target": "c0r0", "round": 6, "step": 8},
            {"kind": "hang", "target": "c1r0", "round": 9, "step": 2},
            {"kind": "kill", "target": "c1r1", "round": 6, "phase": "join"},
        ],
    )
    plan = live_plan(Topology(2, 2), {"c1r0", "c1r1"}, {}, 5)  # cluster 0 down all round
    assert injector.arm(6, ("inner",), plan, only={"c1r0", "c1r1"}) == {}
    injector.state.committed_round = 7  # a run that failed in round 7: round 9's moment never came
    # and no group formed in round 6: its `join` fault's moment never came either (README)
    assert injector.not_fired() == ["hang c1r0 at round 9 inner step 2", "kill c1r1 at round 6 join"]
    lines = read_jsonl(tmp_path / "faults_fired.jsonl")
    assert [(x["rid"], x["kind"], x["round"], x["step"], x.get("pid"), x["target_down"]) for x in lines] == [
        ("c0r0", "kill", 6, 8, None, True)
    ]
    assert injector.not_fired() == ["hang c1r0 at round 9 inner step 2", "kill c1r1 at round 6 join"], "recorded once"
    assert len(read_jsonl(tmp_path / "faults_fired.jsonl")) == 1


def test_fired_as_matches_a_line_to_its_fault():
    from hsgd.core.faults import fired_as

    kill, leader = (
        parse_fault({"kind": "kill", "target": t, "round": 2, "step": 3}, **TOPO) for t in ("c0r1", "leader:c1")
    )
    line = {"rid": "c0r1", "kind": "kill", "phase": "inner", "round": 2, "step": 3, "pid": 7}
    assert (
        fired_as(kill, line)
        and not fired_as(kill, {**line, "step": 4})
        and fired_as(kill, {**line, "step": 0, "pid": None})
    )
    assert not fired_as(kill, {**line, "round": 1}) and not fired_as(kill, {**line, "rid": "c0r0"})
    assert fired_as(leader, {**line, "rid": "c1r0"}) and not fired_as(leader, line)
