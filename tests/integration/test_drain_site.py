"""Draining a site while the run goes on (issue 37, drain slice; Acceptance 2): three sites of two
replicas train; a request written mid-run (the drill API, the same file as `python -m jobs.status
<run> drain-site c2`) drains c2 at the next round's start. Its replicas stop with zero faults
counted and nothing rolled back, the other sites' inner groups never re-form for it (the outer
group simply has one site fewer), the run completes, and the request is decided once."""

from __future__ import annotations

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events

ROUNDS, SPR = 8, 4
RUN = FAST + [
    "topology.clusters=3",
    "topology.replicas_per_cluster=2",
    f"train.rounds={ROUNDS}",
    f"sync.outer_every={SPR}",
    "train.min_step_s=0.05",
    "train.eval_batches=1",
    "train.eval_every=100",
    "checkpoint.every=2",
    "comm.timeout_s=4",
    "watchdog.floor_s=5",
]
FAILURES = (
    "replica_down",
    "hang_detected",
    "kill",
    "replica_error",
    "collective_failed",
    "restore",
    "quorum_wait",
    "spare_lost",
    "cluster_reform",
    "idle_replica_lost",
    "presumed_dead",
)


def test_a_site_drained_mid_run_leaves_with_no_fault_no_rollback_and_no_reform(background_drills, tmp_path):
    drill = background_drills(RUN, tmp_path)
    drill.wait_for(round=2, timeout_s=180)
    request_id = drill.drain_site("c2")
    decided = drill.wait_site_request(request_id, timeout_s=120)
    assert decided["outcome"] == "applied", decided
    drained_at = decided["round"]
    assert 2 <= drained_at < ROUNDS - 1, f"the drain must land mid-run to test anything: {decided}"
    summary = drill.wait_done(timeout_s=600)

    record = events(drill.run_dir)
    assert [e["id"] for e in record if e["event"] == "site_request"] == [request_id], "decided exactly once"
    assert not [e for e in record if e["event"] in FAILURES], "a drain is no failure"
    assert summary["faults"] == [] and summary["status"] == "completed"
    assert summary["topology"]["drained"] == {"c2": drained_at}
    # nothing rolled back: commits only grow, every round recorded once (check_run), c2 gone after its round
    check_run(drill.run_dir, rounds=ROUNDS, steps_per_round=SPR, victims=set())
    commits = {e["round"]: set(e["replicas"]) for e in record if e["event"] == "commit"}
    assert sorted(commits) == list(range(ROUNDS))
    assert all({"c2r0", "c2r1"} <= commits[r] for r in range(drained_at))
    assert all(
        not any(rid.startswith("c2") for rid in commits[r]) and len(commits[r]) == 4 for r in range(drained_at, ROUNDS)
    ), commits
    assert sorted(summary["replica_param_digests"]) == ["c0r0", "c0r1", "c1r0", "c1r1"]
    saved = [e for e in record if e["event"] == "checkpoint" and e["round"] > drained_at]
    assert saved and not any(rid.startswith("c2") for e in saved for rid in e["replicas"]), saved
    # the other sites' inner groups stand; only the outer group is formed again, over c0 and c1
    t_drain = next(e["t"] for e in record if e["event"] == "site_request")
    later = [e for e in record if e["event"] == "membership" and e["t"] > t_drain]
    assert not [e for e in later if e["level"] == "inner"], f"an inner group re-formed for the drain: {later}"
    outer = [e for e in later if e["level"] == "outer"]
    assert outer and all(set(e["leaders"]) == {"c0", "c1"} for e in outer), outer


def test_a_drain_is_applied_once_across_supervisor_kills_before_and_after_its_effect(background_drills, tmp_path):
    """Acceptance 3: the supervisor SIGKILLed with the request written and not yet decided: its
    successor applies it; killed again after the effect: the next one neither applies it again, nor
    logs it again, nor counts the drained replicas' deaths as faults."""
    drill = background_drills(RUN + ["train.rounds=10"], tmp_path)
    drill.wait_for(round=2, timeout_s=180)
    drill.inject("kill", "supervisor")
    request_id = drill.drain_site("c1")  # written while no supervisor is alive to read it
    drill.wait_down(timeout_s=60)
    decided = drill.wait_site_request(request_id, timeout_s=180)
    assert decided["outcome"] == "applied", decided
    drill.wait_for(round=decided["round"] + 1, timeout_s=180)
    drill.inject("kill", "supervisor")
    drill.wait_down(timeout_s=60)
    summary = drill.wait_done(timeout_s=600)

    record = events(drill.run_dir)
    starts = [e["t"] for e in record if e["event"] == "supervisor_start"]
    assert len(starts) == 3 and starts[1] < decided["t"] < starts[2], "decided by the first successor"
    assert [e["id"] for e in record if e["event"] == "site_request"] == [request_id], "decided exactly once"
    assert not [e for e in record if e["event"] == "replica_down"], "a drained replica's stop is no death"
    assert summary["status"] == "completed" and summary["topology"]["drained"] == {"c1": decided["round"]}
    commits = {e["round"]: set(e["replicas"]) for e in record if e["event"] == "commit"}
    assert all(not any(rid.startswith("c1") for rid in commits[r]) for r in range(decided["round"], 10)), commits
    assert sorted(summary["replica_param_digests"]) == ["c0r0", "c0r1", "c2r0", "c2r1"]
    check_run(drill.run_dir, rounds=10, steps_per_round=SPR, victims=set())  # the supervisor is no replica
