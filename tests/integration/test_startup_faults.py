"""Start-up survives deaths (issue 31, Build 3; Acceptance 4): a replica killed while it answers a
start-up call — the checkpoint reach check of a fresh run, the resume load of a resumed one — is a
replica failure: Ray restarts it, the call is retried, the run starts and completes, and the death
is counted as a fault. Before, it ended the run as a config error (exit 2)."""

from __future__ import annotations

from hsgd.record.rundir import read_jsonl
from tests.integration.invariants import check_run
from tests.integration.runs import summary, train

TINY = ["sync.outer_every=2", "checkpoint.every=1", "checkpoint.keep=2"]


def _fired(run_dir) -> list[dict]:
    return [f for f in read_jsonl(run_dir / "faults_fired.jsonl") if f.get("phase") == "startup"]


def _counted(s: dict, rid: str) -> bool:
    return any(f.get("rid") == rid and f.get("source") == "injected" for f in s["faults"])


def test_a_replica_killed_in_the_checkpoint_reach_check_is_restarted_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, [*TINY, "train.rounds=2", "faults.schedule=[{kind:kill,target:c0r1,round:0,phase:startup}]"])
    assert s["status"] == "completed" and s["rounds_committed"] == 2, s.get("reason")
    fired = _fired(run_dir)
    assert [(f["rid"], f["kind"]) for f in fired] == [("c0r1", "kill")], fired
    assert _counted(s, "c0r1") and s["faults_not_fired"] == [], (s["faults"], s["faults_not_fired"])
    assert summary(run_dir) == s
    check_run(run_dir, rounds=2, steps_per_round=2)


def test_a_replica_killed_in_the_resume_load_is_restarted_and_the_resumed_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, [*TINY, "train.rounds=1"])["status"] == "completed"
    s = train(
        run_dir,
        [
            *TINY,
            "train.rounds=2",
            "train.resume=true",
            "faults.schedule=[{kind:kill,target:c1r0,round:1,phase:startup}]",
        ],
    )
    assert s["status"] == "completed" and s["rounds_committed"] == 2, s.get("reason")
    fired = _fired(run_dir)
    assert [(f["rid"], f["kind"], f["round"]) for f in fired] == [("c1r0", "kill", 1)], fired
    assert _counted(s, "c1r0") and s["faults_not_fired"] == [], (s["faults"], s["faults_not_fired"])
    check_run(run_dir, rounds=2, steps_per_round=2)
