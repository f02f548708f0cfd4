"""Fault tolerance in the regime users run (issue 9): rounds of >= 30 s of inner work (a simulated
accelerator step time, `train.min_step_s`, keeps that cheap on CPU), three clusters of two
replicas, a cluster's correlated failure, a process killed from outside the injector, the supervisor
killed while replicas are mid-phase (every replica lost at once, in rounds of 1 s:
test_every_replica_lost.py). Every run goes through the shared invariant checker
(tests/integration/invariants.py); the tests add what is particular to their failure."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, inner_running, metrics, poll, replica_progress, train

pytestmark = pytest.mark.realistic

SPR = 100
EVERYONE = {f"c{c}r{i}" for c in range(3) for i in range(2)}
# 3 clusters x 2 replicas; 100 steps x 0.3 s = 30 s of inner work per round; eval and checkpoint cheap
REALISTIC = [
    "topology.clusters=3",
    "topology.replicas_per_cluster=2",
    f"sync.outer_every={SPR}",
    "train.min_step_s=0.3",
    "checkpoint.every=0",
    "train.eval_batches=1",
    "comm.timeout_s=5",
]


# -- reading and watching a run ------------------------------------------------------------------
def _inner_phases(evs, cluster, round_index):
    def pick(name):
        return [
            e
            for e in evs
            if e["event"] == name
            and e["phase"] == "inner"
            and e.get("cluster") == cluster
            and e["round"] == round_index
        ]

    return pick("phase_begin"), pick("phase_end")


def _assert_inner_phase_ran_once(evs, cluster, round_index):
    """Cluster `cluster`'s inner phase of the round was issued once, ran to its end, and counted."""
    begins, ends = _inner_phases(evs, cluster, round_index)
    assert len(begins) == 1 and len(ends) == 1, (
        f"invariant 7: cluster c{cluster}'s inner phase of round {round_index} was interrupted or re-issued: "
        f"{len(begins)} begin(s), {len(ends)} end(s): {ends}"
    )
    members = sorted(f"c{cluster}r{i}" for i in range(2))
    assert not ends[0]["failed"] and sorted(ends[0]["ok"]) == members, (
        f"cluster c{cluster}'s inner phase of round {round_index} did not end ok for {members}: {ends[0]}"
    )


@pytest.fixture
def drill_run(background_drills, tmp_path):
    """A realistic run started in the background; stopped at teardown if a test left it running."""
    return lambda overrides: background_drills(FAST + REALISTIC + overrides, tmp_path)


# -- a. one cluster's failure stays in that cluster ----------------------------------------------
def test_kill_in_one_cluster_leaves_other_clusters_untouched(tmp_path):
    run_dir = tmp_path / "run"
    train(
        run_dir, REALISTIC + ["train.rounds=2", "faults.schedule=[{kind:kill,target:c0r1,round:0,phase:inner,step:5}]"]
    )
    check_run(run_dir, rounds=2, steps_per_round=SPR, victims={"c0r1"})
    evs = events(run_dir)
    downs = [e["rid"] for e in evs if e["event"] in ("replica_down", "hang_detected", "kill")]
    assert downs == ["c0r1"], f"invariant 7: only c0r1 may go down: {downs}"
    for c in (1, 2):  # their round-0 inner phase ran once, to its end, and counted
        _assert_inner_phase_ran_once(evs, c, 0)
    commit = next(e for e in evs if e["event"] == "commit" and e["round"] == 0)
    assert set(commit["replicas"]) == EVERYONE, (
        f"round 0 must commit with every replica's steps (c0r1 rejoined inside the round): {commit['replicas']}"
    )
    reforms = [e for e in evs if e["event"] == "cluster_reform"]
    assert reforms and {e["cluster"] for e in reforms} == {0}, f"only c0 may re-form: {reforms}"


# -- d. a failure nobody injected -------------------------------------------------------------------
def test_replica_sigkilled_from_outside_is_healed_and_reported(drill_run):
    drill = drill_run(["train.rounds=2"])
    running = poll(
        "round 0's inner phase to run on every replica",
        180,
        lambda: inner_running(drill.run_dir, sorted(EVERYONE), 0, min_step=5),
    )
    pid = running["c1r0"]["pid"]
    ups = [e["pid"] for e in events(drill.run_dir) if e["event"] == "replica_up" and e["rid"] == "c1r0"]
    assert set(ups) == {pid}, f"c1r0's process: the replica says {pid}, replica_up events say {ups}"
    os.kill(pid, signal.SIGKILL)  # the OS, not the injector
    s = drill.wait_done(600)
    check_run(drill.run_dir, rounds=2, steps_per_round=SPR, victims={"c1r0"})
    observed = [f for f in s["faults"] if f["source"] == "observed"]
    assert [f["rid"] for f in observed] == ["c1r0"], f"the SIGKILL of c1r0 must be reported as observed: {s['faults']}"
    assert observed[0]["recovery_latency_s"] is not None, observed
    assert not [f for f in s["faults"] if f["source"] == "injected"], s["faults"]
    evs = events(drill.run_dir)
    for c in (0, 2):
        _assert_inner_phase_ran_once(evs, c, 0)


def _idle_at_round_end(run_dir: Path, rid: str, busy: str) -> dict | None:
    """rid's answer once it finished round 0's inner steps and waits idle, while `busy` still trains."""
    me, other = replica_progress(run_dir, rid), replica_progress(run_dir, busy)
    if (
        me
        and other
        and me["phase"] == "idle"
        and (me["round"], me["step"]) == (0, SPR)
        and other["phase"] != "idle"
        and other["round"] == 0
    ):
        return me
    return None


def test_replica_killed_from_outside_while_idle_is_noticed_before_the_outer_exchange(drill_run):
    # c0 is a straggler in round 0 (0.3 s more per step: ~60 s of inner work, the others ~30 s), so
    # c1's replicas finish and wait idle for the outer exchange; c1r1's process is SIGKILLed then.
    # Noticed only when a call fails, c1's commit broadcast would break and c1's survivor would heal
    # across clusters at round 1; noticed while idle, c1 re-forms before the exchange and applies it.
    drill = drill_run(
        ["train.rounds=2", "faults.schedule=[{kind:slow,target:cluster:c0,round:0,phase:inner,step:0,seconds:0.3}]"]
    )
    idle = poll(
        "c1r1 idle after round 0's inner steps while c0 still trains",
        240,
        lambda: _idle_at_round_end(drill.run_dir, "c1r1", busy="c0r0"),
    )
    os.kill(idle["pid"], signal.SIGKILL)  # the OS, not the injector
    s = drill.wait_done(600)
    check_run(drill.run_dir, rounds=2, steps_per_round=SPR, victims={"c1r1"})
    evs = events(drill.run_dir)
    commit = next(e for e in evs if e["event"] == "commit" and e["round"] == 0)
    assert "c1r0" in commit["replicas"], f"c1's survivor must apply round 0's commit: {commit['replicas']}"
    assert not [e for e in evs if e["event"] == "heal_begin" and e["scope"] == "global"], (
        "nobody heals across clusters: c1's survivor holds the commit"
    )
    lost = [e for e in evs if e["event"] == "idle_replica_lost"]
    assert [e["rid"] for e in lost] == ["c1r1"], f"c1r1's death while idle went unnoticed: {lost}"
    decision = next(e for e in evs if e["event"] == "commit_decision" and e["round"] == 0)
    assert lost[0]["t"] < decision["t"], "c1r1's loss must be noticed before round 0's outer exchange"
    reforms = [e for e in evs if e["event"] == "cluster_reform"]
    assert {e["cluster"] for e in reforms} == {1} and all(e["t"] < decision["t"] for e in reforms), (
        f"only c1 re-forms, before the outer exchange: {reforms}"
    )
    observed = [f for f in s["faults"] if f["source"] == "observed"]
    assert [f["rid"] for f in observed] == ["c1r1"], f"the SIGKILL of c1r1 must be reported as observed: {s['faults']}"
    for c in (0, 2):
        _assert_inner_phase_ran_once(evs, c, 0)


# -- e. the supervisor lost while replicas work ---------------------------------------------------
@pytest.mark.parametrize("when", ["scheduled_round0_inner", "from_outside_mid_inner"])
def test_supervisor_killed_mid_inner_phase(tmp_path, drill_run, when):
    before: dict[str, dict] = {}
    if when == "scheduled_round0_inner":
        run_dir = tmp_path / "run"
        s = train(
            run_dir,
            REALISTIC + ["train.rounds=2", "faults.schedule=[{kind:kill,target:supervisor,round:0,phase:inner}]"],
        )
    else:
        drill = drill_run(["train.rounds=2"])
        run_dir = drill.run_dir
        before = poll(
            "every replica 10 steps into round 0's inner phase",
            180,
            lambda: inner_running(run_dir, sorted(EVERYONE), 0, min_step=10),
        )
        drill.inject("kill", "supervisor")
        s = drill.wait_done(600)
    check_run(run_dir, rounds=2, steps_per_round=SPR, victims=set())
    assert s["supervisor_starts"] == 2, f"the supervisor was not restarted once: {s['supervisor_starts']}"
    evs = events(run_dir)
    assert not [e for e in evs if e["event"] in ("heal_begin", "restore")], "nobody lost state: nobody heals"
    commit = next(e for e in evs if e["event"] == "commit" and e["round"] == 0)
    assert set(commit["replicas"]) == EVERYONE, f"round 0 commits with every replica's steps: {commit['replicas']}"
    # the replicas kept their progress: the restarted supervisor found each where it was, or further
    second = max(i for i, e in enumerate(evs) if e["event"] == "supervisor_start")
    found = {e["rid"]: e for e in evs[second:] if e["event"] == "replica_up"}
    assert set(found) == EVERYONE, f"the restarted supervisor did not re-admit every replica: {sorted(found)}"
    for rid, answer in before.items():
        assert (found[rid]["round"], found[rid]["step"]) >= (answer["round"], answer["step"]), (
            f"{rid} lost progress across the supervisor restart: at step {answer['step']} before, "
            f"{found[rid]['step']} after"
        )
        assert found[rid]["pid"] == answer["pid"], f"{rid} is another process after the supervisor restart"


# -- sites of different speeds (issue 35): kills in two sites at once, then the supervisor ---------
BALANCED = FAST + [
    "topology.sites=[{replicas:2,min_step_s:0.3},{replicas:2,min_step_s:0.45},{replicas:2,min_step_s:0.6}]",
    "sync.balance=steps",
    f"sync.outer_every={SPR}",
    "checkpoint.every=0",
    "train.eval_batches=1",
    "comm.timeout_s=5",
    "train.rounds=2",
]
PLAN = [SPR, 67, 50]  # 100 x 0.3 s = 30 s of inner work in each site: 0.3 / 0.45 and 0.3 / 0.6 of 100 steps


def test_balanced_sites_heal_into_their_plans_through_kills_and_a_supervisor_restart(background_drills, tmp_path):
    drill = background_drills(BALANCED, tmp_path)
    running = poll(
        "round 0's inner phase to run on every replica",
        180,
        lambda: inner_running(drill.run_dir, sorted(EVERYONE), 0, min_step=5),
    )
    for rid in ("c1r0", "c2r1"):  # two sites at once, from outside the injector
        os.kill(running[rid]["pid"], signal.SIGKILL)
    poll(
        "round 1's inner phase to run on every replica",
        300,
        lambda: inner_running(drill.run_dir, sorted(EVERYONE), 1, min_step=SPR + 5),
    )
    drill.inject("kill", "supervisor")  # mid-inner: its successor must follow round 1's recorded plan
    s = drill.wait_done(600)
    check_run(drill.run_dir, rounds=2, steps_per_round=SPR, victims={"c1r0", "c2r1"})
    assert s["supervisor_starts"] == 2, s["supervisor_starts"]
    evs, ms = events(drill.run_dir), metrics(drill.run_dir)
    plans = [e for e in evs if e["event"] == "round_plan"]
    assert [(e["round"], e["steps"]) for e in plans if e["source"] == "configured"] == [(0, PLAN), (1, PLAN)], plans
    assert [(e["round"], e["steps"]) for e in plans if e["source"] == "recorded"] == [(1, PLAN)], (
        f"the restarted supervisor must follow round 1's recorded plan, never plan it again: {plans}"
    )
    assert [m["cluster_steps"] for m in ms] == [PLAN, PLAN]
    heals = {e["target"]: e["source"] for e in evs if e["event"] == "heal_end"}
    for rid in ("c1r0", "c2r1"):  # healed from its own site, so it lands on its site's plan
        assert rid in heals and heals[rid][:2] == rid[:2], f"{rid} healed from {heals.get(rid)}: {heals}"
    _assert_inner_phase_ran_once(evs, 0, 0)  # the fast site never waited for the slow sites' kills
    per_step = ms[0]["cluster_tokens"][0] // (2 * SPR)
    assert s["tokens_per_cluster"] == [2 * 2 * n * per_step for n in PLAN], s["tokens_per_cluster"]
