"""Fault tolerance in the regime users run (issue 9): rounds of >= 30 s of inner work (a simulated
accelerator step time, `train.min_step_s`, keeps that cheap on CPU), three clusters, correlated
failures, processes killed from outside the injector, the supervisor killed while replicas are
mid-phase. Every run goes through the shared invariant checker."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from actors.drill import Drill
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, metrics, train

pytestmark = pytest.mark.realistic

# 3 clusters x 2 replicas; 100 steps x 0.3 s = 30 s of inner work per round
REALISTIC = ["topology.clusters=3", "sync.outer_every=100", "train.min_step_s=0.3", "checkpoint.every=0",
             "train.eval_batches=1", "comm.timeout_s=5"]


def _inner_phases(evs, cluster, round_index):
    begins = [e for e in evs if e["event"] == "phase_begin" and e["phase"] == "inner" and e.get("cluster") == cluster
              and e["round"] == round_index]
    ends = [e for e in evs if e["event"] == "phase_end" and e["phase"] == "inner" and e.get("cluster") == cluster
            and e["round"] == round_index]
    return begins, ends


def test_a_death_in_one_cluster_leaves_the_other_clusters_untouched(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, REALISTIC + ["train.rounds=2",
                                "faults.schedule=[{kind:kill,target:c0r1,round:0,phase:inner,step:5}]"])
    check_run(run_dir, rounds=2, steps_per_round=100, victims={"c0r1"})
    evs = events(run_dir)
    for c in (1, 2):  # their round-0 inner phase ran once, to its end, and counted
        begins, ends = _inner_phases(evs, c, 0)
        assert len(begins) == 1 and len(ends) == 1, f"cluster c{c}'s inner phase was interrupted: {begins}"
        assert not ends[0]["failed"] and sorted(ends[0]["ok"]) == [f"c{c}r0", f"c{c}r1"], ends[0]
    commit = next(e for e in evs if e["event"] == "commit" and e["round"] == 0)
    assert {"c1r0", "c1r1", "c2r0", "c2r1"} <= set(commit["replicas"]), commit
    reforms = [e for e in evs if e["event"] == "cluster_reform"]
    assert reforms and {e["cluster"] for e in reforms} == {0}, f"only c0 may re-form: {reforms}"


def _lose_everyone(run_dir, extra):
    kills = ",".join(f"{{kind:kill,target:cluster:c{c},round:2,phase:inner,step:3}}" for c in range(3))
    return train(run_dir, ["topology.clusters=3", "sync.outer_every=20", "train.min_step_s=0.05", "train.rounds=4",
                           "train.eval_batches=1", f"faults.schedule=[{kills}]"] + extra)


def test_every_replica_lost_restores_the_latest_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    _lose_everyone(run_dir, ["checkpoint.every=1", "checkpoint.keep=10"])
    everyone = {f"c{c}r{i}" for c in range(3) for i in range(2)}
    s = check_run(run_dir, rounds=4, steps_per_round=20, victims=everyone)
    evs = events(run_dir)
    restore = next(e for e in evs if e["event"] == "restore")
    assert restore["round"] == 2 and restore["path"].endswith("round_000002"), restore
    # the restored checkpoint and its predecessor were written before the loss and never again
    import json
    for name in ("round_000001", "round_000002"):
        manifest = json.loads((run_dir / "checkpoints" / name / "manifest.json").read_text())
        assert manifest["t"] < restore["t"], f"{name} was rewritten after the restore"
    # the same as resuming that checkpoint by hand
    by_hand = tmp_path / "by_hand"
    shutil.copytree(run_dir / "checkpoints" / "round_000002", by_hand / "checkpoints" / "round_000002")
    resumed = train(by_hand, ["topology.clusters=3", "sync.outer_every=20", "train.min_step_s=0.05", "train.rounds=4",
                              "train.eval_batches=1", "checkpoint.every=1", "train.resume=true"])
    assert resumed["global_param_digest"] == s["global_param_digest"], \
        "restore after a total loss must equal resuming the same checkpoint by hand"


def test_every_replica_lost_without_a_checkpoint_fails_with_a_reason(tmp_path):
    run_dir = tmp_path / "run"
    s = _lose_everyone(run_dir, ["checkpoint.every=0"])
    assert s["status"] == "failed" and "no durable checkpoint" in s["reason"] and "total loss" in s["reason"], s
    assert [m["round"] for m in metrics(run_dir)] == [0, 1], "nothing may be recorded as committed that was not"
    assert s["rounds_committed"] == 2
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())
    check_run(run_dir, rounds=2, steps_per_round=20, victims={f"c{c}r{i}" for c in range(3) for i in range(2)},
              expect_status="failed")


def _pid_of(run_dir, rid):
    ups = [e for e in events(run_dir) if e["event"] == "replica_up" and e["rid"] == rid]
    return ups[-1]["pid"]


def test_a_replica_sigkilled_from_outside_is_healed_and_reported(tmp_path):
    drill = Drill(FAST + REALISTIC + ["train.rounds=1"], run_dir=str(tmp_path)).start()
    drill.wait_for(lambda st: st.get("phase") == "inner", 120, "the inner phase")
    time.sleep(3.0)  # well inside the 30 s inner phase
    os.kill(_pid_of(drill.run_dir, "c1r0"), signal.SIGKILL)  # the OS, not the injector
    s = drill.wait_done(600)
    check_run(drill.run_dir, rounds=1, steps_per_round=100, victims={"c1r0"})
    observed = [f for f in s["faults"] if f["source"] == "observed"]
    assert [f["rid"] for f in observed] == ["c1r0"] and observed[0]["recovery_latency_s"] is not None, s["faults"]
    assert not [f for f in s["faults"] if f["source"] == "injected"]


def test_supervisor_killed_while_replicas_are_mid_phase(tmp_path):
    drill = Drill(FAST + REALISTIC + ["train.rounds=2"], run_dir=str(tmp_path)).start()
    drill.wait_for(lambda st: st.get("phase") == "inner", 120, "the inner phase")
    time.sleep(3.0)
    drill.inject("kill", "supervisor")
    s = drill.wait_done(600)
    assert s["supervisor_starts"] == 2
    check_run(drill.run_dir, rounds=2, steps_per_round=100, victims=set())
    evs = events(drill.run_dir)
    up_pids = {}
    for e in evs:
        if e["event"] == "replica_up":
            up_pids.setdefault(e["rid"], set()).add(e["pid"])
    assert all(len(p) == 1 for p in up_pids.values()), f"a replica was restarted: {up_pids}"
