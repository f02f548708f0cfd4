"""The shared invariant checker (tests/integration/invariants.py) on synthetic run directories: a
healthy record passes; each kind of broken record fails with a message naming the invariant and
the replica or round. No Ray, no processes: the run directories are written here."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.integration.invariants import check_run

SPR = 10
REPLICAS = ["c0r0", "c0r1", "c1r0", "c1r1"]
PIDS = {rid: 1000 + i for i, rid in enumerate(REPLICAS)}


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _write_checkpoint(run_dir: Path, state_round: int, t: float) -> None:
    d = run_dir / "checkpoints" / f"round_{state_round:06d}"
    d.mkdir(parents=True)
    files = {}
    for rid in REPLICAS:
        data = f"{rid} state at round {state_round}".encode()
        (d / f"{rid}.pt").write_bytes(data)
        files[rid] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(
        json.dumps({"round": state_round, "step": state_round * SPR, "files": files, "t": t})
    )


def healthy_run(run_dir: Path, rounds: int = 2) -> Path:
    """A 2x2 run of `rounds` rounds, checkpoint every round, c0r1 killed at round 0 step 5 and
    restarted (a new pid) - everything as the supervisor records it."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        "topology:\n  clusters: 2\n  replicas_per_cluster: 2\nfaults:\n  schedule:\n"
        "  - {kind: kill, target: c0r1, round: 0, phase: inner, step: 5}\n"
    )
    t0 = time.time() - 50
    fired_t = t0 + 2
    _write_jsonl(
        run_dir / "faults_fired.jsonl",
        [{"t": fired_t, "rid": "c0r1", "kind": "kill", "phase": "inner", "round": 0, "step": 5, "pid": PIDS["c0r1"]}],
    )
    events = [{"t": t0, "event": "supervisor_start", "starts": 1, "pid": 1}]
    events += [
        {"t": t0, "event": "replica_up", "rid": rid, "round": 0, "step": 0, "pid": pid} for rid, pid in PIDS.items()
    ]
    events += [
        {
            "t": fired_t + 0.1,
            "event": "replica_down",
            "rid": "c0r1",
            "cluster": 0,
            "cause": "died",
            "phase": "inner",
            "round": 0,
        },
        {"t": fired_t + 3, "event": "replica_up", "rid": "c0r1", "round": 0, "step": 0, "pid": 2001},
    ]
    metrics = []
    digest = "d" * 64
    for r in range(rounds):
        t = t0 + 10 * (r + 1)
        events.append({"t": t, "event": "commit", "round": r, "epoch": 3, "replicas": REPLICAS})
        metrics.append(
            {
                "round": r,
                "inner_step": (r + 1) * SPR,
                "replica_digests": {rid: digest for rid in REPLICAS},
                "global_digests": {rid: "g" * 64 for rid in REPLICAS},
                "t": t,
            }
        )
        _write_checkpoint(run_dir, r + 1, t=time.time())
        events.append(
            {
                "t": time.time() + 0.01,
                "event": "checkpoint",
                "round": r + 1,
                "path": str(run_dir / "checkpoints" / f"round_{r + 1:06d}"),
            }
        )
    events.append({"t": time.time() + 0.02, "event": "run_end", "status": "completed"})
    _write_jsonl(run_dir / "events.jsonl", events)
    _write_jsonl(run_dir / "metrics.jsonl", metrics)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "status": "completed",
                "reason": None,
                "rounds_committed": rounds,
                "inner_steps_committed": rounds * SPR,
                "replica_param_digests": {rid: digest for rid in REPLICAS},
                "global_param_digest": "g" * 64,
                "faults": [],
                "faults_not_fired": [],
            }
        )
    )
    return run_dir


def _edit_jsonl(path: Path, edit) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    _write_jsonl(path, edit(records))


def _fails(run_dir, *words, **kwargs):
    with pytest.raises(AssertionError) as err:
        check_run(run_dir, rounds=kwargs.pop("rounds", 2), steps_per_round=SPR, **kwargs)
    message = str(err.value)
    for word in words:
        assert word in message, f"{word!r} not in the checker's message: {message}"
    return message


def test_a_healthy_run_passes_with_victims_given_or_read_from_faults_fired(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    assert check_run(run_dir, rounds=2, steps_per_round=SPR, victims={"c0r1"})["status"] == "completed"
    check_run(run_dir, rounds=2, steps_per_round=SPR)  # victims from faults_fired.jsonl: c0r1


def test_a_round_recorded_twice_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(run_dir / "metrics.jsonl", lambda ms: ms + [dict(ms[0])])
    _fails(run_dir, "invariant 2", "round(s) [0] recorded more than once")


def test_a_round_missing_from_the_record_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(run_dir / "metrics.jsonl", lambda ms: ms[1:])
    _fails(run_dir, "invariant 2", "lacks round(s) [0]")


def test_a_healthy_replica_declared_hung_and_killed_fails_naming_it(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    t = time.time() - 45
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: (
            es
            + [
                {"t": t, "event": "hang_detected", "rid": "c1r0", "phase": "inner", "round": 0},
                {"t": t, "event": "kill", "rid": "c1r0", "reason": "hung in inner"},
            ]
        ),
    )
    message = _fails(run_dir, "invariant 7", "c1r0", "hang_detected", victims={"c0r1"})
    assert "c0r1" not in message.split("harmed:")[1], "the victim itself is no harm"


def test_a_healthy_replica_restarted_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: es + [{"t": time.time(), "event": "replica_up", "rid": "c1r1", "round": 1, "step": 0, "pid": 4242}],
    )
    _fails(run_dir, "invariant 7", "c1r1", "restarted (2 processes")


def test_a_resumed_job_starts_new_processes_without_harming_anyone(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    t = time.time()
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: (
            es
            + [{"t": t, "event": "supervisor_start", "starts": 1, "pid": 2}]
            + [
                {"t": t, "event": "replica_up", "rid": rid, "round": 2, "step": 2 * SPR, "pid": 5000 + i}
                for i, rid in enumerate(REPLICAS)
            ]
        ),
    )
    check_run(run_dir, rounds=2, steps_per_round=SPR, victims={"c0r1"})


def test_a_rewritten_checkpoint_file_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    (run_dir / "checkpoints" / "round_000001" / "c1r0.pt").write_bytes(b"fresh weights")
    _fails(run_dir, "round_000001/c1r0.pt was rewritten", "sha256")


def test_a_checkpoint_rewritten_whole_after_it_was_final_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    d = run_dir / "checkpoints" / "round_000002"
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    _write_checkpoint(run_dir, 2, t=time.time() + 30)  # consistent in itself, but written after its event
    later = time.time() + 30
    os.utime(d / "c0r0.pt", (later, later))
    _fails(run_dir, "round_000002", "rewritten")


def test_a_checkpoint_written_twice_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(
        run_dir / "events.jsonl", lambda es: es + [{"t": time.time(), "event": "checkpoint", "round": 2, "path": "x"}]
    )
    _fails(run_dir, "checkpoint of round(s) [2] written more than once")


def test_a_checkpoint_under_another_rounds_name_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    os.rename(run_dir / "checkpoints" / "round_000002", run_dir / "checkpoints" / "round_000003")
    _fails(run_dir, "round_000003 holds the manifest of round 2")


def test_a_round_committed_twice_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: es + [{"t": time.time(), "event": "commit", "round": 1, "epoch": 4, "replicas": REPLICAS}],
    )
    _fails(run_dir, "commit of round 1 after round 1", "committed twice")


def test_a_restore_may_take_commits_back_to_its_checkpoint(tmp_path):
    run_dir = healthy_run(tmp_path / "run", rounds=3)
    # total loss in round 3 after rounds 0..2: restore round_000002 (round 2 is trained again) —
    # allowed by the commit order; but round 2 recorded twice is still caught
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: (
            es
            + [
                {"t": time.time(), "event": "restore", "round": 2, "path": "round_000002", "reason": "total loss"},
                {"t": time.time(), "event": "commit", "round": 2, "epoch": 9, "replicas": REPLICAS},
            ]
        ),
    )
    check_run(run_dir, rounds=3, steps_per_round=SPR)
    _edit_jsonl(
        run_dir / "events.jsonl",
        lambda es: es + [{"t": time.time(), "event": "commit", "round": 2, "epoch": 9, "replicas": REPLICAS}],
    )
    _fails(run_dir, "commit of round 2 after round 2", rounds=3)


def test_a_round_recorded_without_a_commit_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(
        run_dir / "events.jsonl", lambda es: [e for e in es if not (e["event"] == "commit" and e["round"] == 1)]
    )
    _fails(run_dir, "round(s) [1] recorded in metrics.jsonl with no commit event")


def test_a_round_recorded_late_by_a_restarted_supervisor_counts_once(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    # the old supervisor announced the commit of round 1, then died before recording it
    _edit_jsonl(
        run_dir / "events.jsonl", lambda es: es + [{"t": time.time(), "event": "round_recorded_late", "round": 1}]
    )
    _edit_jsonl(
        run_dir / "metrics.jsonl",
        lambda ms: ms[:1] + [{"round": 1, "inner_step": 2 * SPR, "replica_digests": {}, "recovered": True}],
    )
    check_run(run_dir, rounds=2, steps_per_round=SPR)


def test_replica_digests_that_differ_fail_naming_the_replica(tmp_path):
    run_dir = healthy_run(tmp_path / "run")

    def diverge(ms):
        ms[1]["replica_digests"]["c1r1"] = "e" * 64
        return ms

    _edit_jsonl(run_dir / "metrics.jsonl", diverge)
    _fails(run_dir, "invariant 1", "round 1", "['c1r1'] hold eeeeeeeeeeee")


def test_a_scheduled_fault_that_never_fired_fails(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    with open(run_dir / "config.yaml", "a") as f:
        f.write("  - {kind: kill, target: 'cluster:c1', round: 1, phase: checkpoint}\n")
    _fails(run_dir, "never fired", "faults.schedule[1] kill cluster:c1 at round 1 checkpoint")


def test_a_fault_that_fired_at_another_step_does_not_count(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    _edit_jsonl(run_dir / "faults_fired.jsonl", lambda fs: [{**fs[0], "step": 0}])
    _fails(run_dir, "never fired", "kill c0r1 at round 0 inner step 5")


def test_the_summary_must_say_what_the_record_says(tmp_path):
    run_dir = healthy_run(tmp_path / "run")
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "inner_steps_committed": 3 * SPR}))
    _fails(run_dir, "invariant 2", "30 inner steps committed, expected 2 / 20")
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "failed", "reason": "boom"}))
    _fails(run_dir, "summary status 'failed', expected 'completed': boom")


# -- sync.balance: a round's plan is decided once --------------------------------------------------
def _plan(r, steps, source="configured"):
    return {"t": 0.0, "event": "round_plan", "round": r, "steps": steps, "step_s": [0.1, 0.2], "source": source}


def test_plans_followed_accepts_a_plan_read_back_by_a_successor():
    from tests.integration.invariants import plans_followed

    events = [
        {"event": "supervisor_start", "starts": 1},
        _plan(0, [10, 5]),
        {"event": "supervisor_start", "starts": 2},
        _plan(0, [10, 5], "recorded"),
    ]
    plans_followed(events, [{"round": 0, "cluster_steps": [10, 5]}])


@pytest.mark.parametrize(
    "events,metrics,message",
    [
        ([_plan(0, [10, 5]), _plan(0, [10, 4], "recorded")], [], "plan changed from [10, 5] to [10, 4]"),
        ([_plan(0, [10, 5]), _plan(0, [10, 5], "learned")], [], "round 0 was planned twice"),
        ([_plan(0, [10, 5])], [{"round": 0, "cluster_steps": [10, 10]}], "round 0 ran [10, 10], not its plan [10, 5]"),
        ([], [{"round": 1, "cluster_steps": [10, 5]}], "unequal cluster steps [10, 5] but no round_plan"),
    ],
)
def test_plans_followed_refuses_a_plan_changed_or_not_followed(events, metrics, message):
    from tests.integration.invariants import plans_followed

    with pytest.raises(AssertionError, match=re.escape(message)):
        plans_followed([{"event": "supervisor_start", "starts": 1}] + events, metrics)
