"""Asking a running run for a new site (issue 37, add-site; Acceptance 4's refusals). Two sites of
two replicas train; requests written mid-run (the drill API, the same files as `python -m jobs.status
<run> add-site replicas=N [label=L]`) are decided at the next round's start against the live Ray
cluster: a label with no live node is refused with its one line, and a request that passes the
refusals is refused as not built yet (joining a running run is the part still to build, so no
test here can show a site joining). Either way the run goes on untouched: no fault, no inner group
re-formed, every round committed by the same four replicas, digests agreeing, the run completes."""
from __future__ import annotations

from actors.site_changes import JOIN_NOT_BUILT
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events

ROUNDS, SPR = 6, 4
RUN = FAST + ["topology.clusters=2", "topology.replicas_per_cluster=2", f"train.rounds={ROUNDS}",
              f"sync.outer_every={SPR}", "train.min_step_s=0.05", "train.eval_batches=1", "train.eval_every=100",
              "checkpoint.every=100", "comm.timeout_s=4", "watchdog.floor_s=5"]
FAILURES = ("replica_down", "hang_detected", "kill", "replica_error", "collective_failed", "restore", "quorum_wait",
            "spare_lost", "cluster_reform", "idle_replica_lost", "presumed_dead")


def test_add_site_refusals_give_one_line_each_and_the_run_completes_untouched(background_drills, tmp_path):
    drill = background_drills(RUN, tmp_path)
    drill.wait_for(round=2, timeout_s=180)
    no_node = drill.add_site(2, label="no-such-rack")
    passes = drill.add_site(2)
    decided = {rid: drill.wait_site_request(rid, timeout_s=120) for rid in (no_node, passes)}
    summary = drill.wait_done(timeout_s=600)

    labelled = decided[no_node]
    assert labelled["outcome"] == "refused" and labelled["kind"] == "add-site", labelled
    assert labelled["reason"].startswith("add-site c2 (2 replica(s)): label 'no-such-rack' has no live node"), labelled
    other = decided[passes]
    assert other["outcome"] == "refused", other
    # Ray's node tables were read (not "cannot read"): the refusal is room, or the join not being built
    assert (other["reason"] == f"add-site c2: {JOIN_NOT_BUILT}"
            or other["reason"].startswith("add-site c2 (2 replica(s)): no room")), other
    assert all("\n" not in d["reason"] for d in decided.values())
    assert 2 <= labelled["round"] < ROUNDS - 1, f"the requests must land mid-run to test anything: {labelled}"

    record = events(drill.run_dir)
    assert sorted(e["id"] for e in record if e["event"] == "site_request") == sorted(decided), "decided once"
    assert not [e for e in record if e["event"] in FAILURES], "a refused request is no failure"
    assert summary["status"] == "completed" and summary["faults"] == []
    assert "history" not in summary["topology"] and "drained" not in summary["topology"], summary["topology"]
    check_run(drill.run_dir, rounds=ROUNDS, steps_per_round=SPR, victims=set())
    commits = {e["round"]: set(e["replicas"]) for e in record if e["event"] == "commit"}
    assert sorted(commits) == list(range(ROUNDS)) and all(len(m) == 4 for m in commits.values()), commits
    assert sorted(summary["replica_param_digests"]) == ["c0r0", "c0r1", "c1r0", "c1r1"]
    assert len(set(summary["replica_param_digests"].values())) == 1, "digests agree"
    t_asked = min(d["t"] for d in decided.values())
    later = [e for e in record if e["event"] == "membership" and e["t"] > t_asked and e["level"] == "inner"]
    assert not later, f"an inner group re-formed for a refused request: {later}"
