"""Soak (issue 3, acceptance 5): random faults of every kind every few seconds over a run of a few
minutes; no hang, and every invariant holds. A `long` test (tests/run_all.sh part 3): 30 rounds,
17 scheduled faults (it was 80 rounds and ran only by hand), of which about 10 fire and the rest find
their target still down from an earlier one (`target_down` in faults_fired.jsonl, README "Fault
injection"); `python -m pytest tests/integration/test_soak.py -s` prints its figures."""

from __future__ import annotations

import json
import statistics

import pytest

from hsgd.record.rundir import read_jsonl
from tests.integration.invariants import check_run
from tests.integration.runs import events, train

ROUNDS, SPR = 30, 10


@pytest.mark.long  # a few minutes of kills, crashes, hangs and broken collectives
def test_random_faults_for_minutes_keep_every_invariant(tmp_path):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        [
            f"sync.outer_every={SPR}",
            f"train.rounds={ROUNDS}",
            "checkpoint.every=10",
            "comm.timeout_s=4",
            "watchdog.floor_s=5",
            "faults.mtbf_s=4",
            "faults.step_s=0.2",
            "faults.kinds=[kill,crash,hang,comm]",
            "faults.seed=7",
            "faults.max_restarts=100",
            # a rain of injected faults is not a bad node: quarantine (3 deaths in 600 s) would
            # keep the replicas it hits out for the rest of the run on this one-node cluster
            "faults.quarantine_after=0",
        ],
    )
    assert s["status"] == "completed", s.get("reason")
    assert s["rounds_committed"] == ROUNDS and s["inner_steps_committed"] == ROUNDS * SPR
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)  # victims: the replicas the faults hit
    assert len(set(s["replica_param_digests"].values())) == 1 and len(s["replica_param_digests"]) == 4
    faults = s["faults"]
    # a random fault whose target is still restarting at its moment (restarts take ~4 s here, the
    # mean gap between faults is 4 s) is recorded `target_down`, not fired: how many land is timing;
    # that none is lost is not (faults_not_fired is empty, check_run above)
    missed = [f for f in read_jsonl(run_dir / "faults_fired.jsonl") if f.get("target_down")]
    assert not s["faults_not_fired"] and len(faults) + len(missed) >= 10 and len(faults) >= 5, (
        f"{len(faults)} faults fired, {len(missed)} found their target down, not fired: {s['faults_not_fired']}"
    )
    recoveries = [f["recovery_latency_s"] for f in faults if f["recovery_latency_s"] is not None]
    figures = {
        "faults_survived": len(faults),
        "by_kind": {k: sum(f["kind"] == k for f in faults) for k in ("kill", "crash", "hang", "comm")},
        "step_efficiency": s["step_efficiency"],
        "training_efficiency": s["training_efficiency"],
        "median_recovery_latency_s": statistics.median(recoveries) if recoveries else None,
        "median_detection_latency_s": statistics.median(
            [f["detection_latency_s"] for f in faults if f["detection_latency_s"] is not None] or [0]
        ),
        "wall_s": s["wall_s"],
        "final_eval_loss": s["final_eval_loss"],
        "hangs_detected": sum(e["event"] == "hang_detected" for e in events(run_dir)),
    }
    print("SOAK FIGURES", json.dumps(figures))
    (run_dir / "soak_figures.json").write_text(json.dumps(figures, indent=2))
