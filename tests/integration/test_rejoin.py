"""Mid-round rejoin and hot spares (issue 10), in rounds of 30 s of inner work: a killed replica
trains again inside the round it died in; with a spare, its cluster is whole again before a
process restart could have finished, and a new spare appears."""

from __future__ import annotations

import pytest

from tests.fakes.deadlines import HANG_S
from tests.integration.invariants import check_run
from tests.integration.runs import events, poll, train

# 100 steps x 0.3 s (simulated accelerator step time) = 30 s of inner work per round
REALISTIC = [
    "sync.outer_every=100",
    "train.min_step_s=0.3",
    "train.rounds=1",
    "checkpoint.every=0",
    "train.eval_batches=1",
    "supervisor.rejoin=fast",
]
KILL = "faults.schedule=[{kind:kill,target:c0r1,round:0,phase:inner,step:5}]"


def _replacement(evs):
    """The spare_ready of the actor a promoted spare replaced (its restart), or None yet."""
    promoted = _first(evs, "spare_promoted")
    return promoted and _first(evs, "spare_ready", spare=promoted["replaced"])


def _first(evs, name, **fields):
    return next((e for e in evs if e["event"] == name and all(e.get(k) == v for k, v in fields.items())), None)


@pytest.mark.realistic
def test_killed_replica_trains_again_in_the_round_it_died_in(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, REALISTIC + [KILL])
    assert s["status"] == "completed" and s["rounds_committed"] == 1, s.get("reason")
    check_run(run_dir, rounds=1, steps_per_round=100, victims={"c0r1"})
    evs = events(run_dir)
    down = _first(evs, "replica_down", rid="c0r1")
    commit = _first(evs, "commit", round=0)
    assert down and commit and down["t"] < commit["t"]
    back = [
        e
        for e in evs
        if e["event"] == "phase_end"
        and e["phase"] == "inner"
        and e.get("round") == 0
        and "c0r1" in e.get("ok", [])
        and e["t"] > down["t"]
    ]
    assert back, "c0r1 never ran inner steps again in round 0"
    assert "c0r1" in commit["replicas"], "the restarted replica missed the commit of the round it died in"
    yielded = _first(evs, "yield_requested", cluster=0)
    assert yielded and yielded["t"] < commit["t"], "c0's members were not asked to yield for the newcomer"
    # nobody waited at a round boundary: the other cluster's single inner phase ran to its end
    c1 = [e for e in evs if e["event"] == "phase_begin" and e["phase"] == "inner" and e.get("cluster") == 1]
    assert len(c1) == 1, "cluster c1 was disturbed by c0's failure"


@pytest.mark.realistic
def test_hot_spare_takes_over_before_a_restart_could_and_is_replaced(background_drills, tmp_path):
    # rounds of 30 s go on until the killed actor's restart is the cluster's new spare (however long
    # that restart takes on busy cores), then the run stops at the end of the round in flight
    drill = background_drills(
        REALISTIC + [KILL, "topology.spares_per_cluster=1", "train.rounds=1000"], tmp_path / "run"
    )
    poll("a new spare after the old one was used", HANG_S, lambda: _replacement(events(drill.run_dir)))
    s = drill.stop(timeout_s=HANG_S)  # (the round in flight ends first: 30 s of steps, more on busy cores)
    assert s["status"] == "stopped" and s["rounds_committed"] >= 1, s.get("reason")
    run_dir = drill.run_dir
    check_run(run_dir, rounds=s["rounds_committed"], steps_per_round=100, victims={"c0r1"}, expect_status="stopped")
    evs = events(run_dir)
    fired = _first(evs, "fault_armed")
    down = _first(evs, "replica_down", rid="c0r1")
    promoted = _first(evs, "spare_promoted", rid="c0r1")
    assert down and promoted, "no spare took over c0r1"
    whole = next(
        e
        for e in evs
        if e["event"] == "phase_begin"
        and e["phase"] == "inner"
        and e.get("cluster") == 0
        and "c0r1" in e["replicas"]
        and e["t"] > down["t"]
    )
    # the killed actor's own restart, now the cluster's new spare
    replacement = _replacement(evs)
    assert replacement["spare"] == promoted["replaced"]
    assert whole["t"] < replacement["t"], (
        f"the cluster was whole again {whole['t'] - down['t']:.1f}s after the failure, not before the "
        f"killed process was back ({replacement['t'] - down['t']:.1f}s)"
    )
    assert fired
