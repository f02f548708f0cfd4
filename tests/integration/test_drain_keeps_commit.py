"""Issue 45, finding 1 and Acceptance 1, with the issue's own commands: two sites of one replica;
the injector kills c0r0 in round 4, so c1 commits round 4 alone; the moment `replica_down` is
logged, the operator asks to drain c1 — the only site whose live replica holds the last committed
round. The drain is refused (draining it would lose every committed round: before the fix the run
failed `total loss: no live replica holds committed round 5`), the refusal names why, and the run
completes with nothing committed lost."""

from __future__ import annotations

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, poll

ROUNDS, SPR = 12, 20
RUN = FAST + [
    "topology.sites=[{replicas:1},{replicas:1}]",
    "supervisor.rejoin=boundary",
    f"train.rounds={ROUNDS}",
    f"sync.outer_every={SPR}",
    "train.min_step_s=0.5",
    "checkpoint.every=1",
    "faults.schedule=[{kind:kill,target:c0r0,round:4,phase:inner,step:15}]",
]


@pytest.mark.long
@pytest.mark.paced
def test_a_drain_of_the_only_site_holding_the_last_commit_is_refused_and_the_run_completes(background_drills, tmp_path):
    drill = background_drills(RUN, tmp_path)
    poll(
        "c0r0's replica_down",
        300,
        lambda: [e for e in events(drill.run_dir) if e["event"] == "replica_down" and e.get("rid") == "c0r0"],
    )
    request_id = drill.drain_site("c1")
    decided = drill.wait_site_request(request_id, timeout_s=300)
    assert decided["outcome"] == "refused", f"a drain of the only site holding the commit was {decided}"
    assert "committed round" in decided["reason"], decided
    summary = drill.wait_done(timeout_s=900)
    assert summary["status"] == "completed", summary.get("reason")
    assert summary["topology"].get("drained") in ({}, None), summary["topology"]
    check_run(drill.run_dir, rounds=ROUNDS, steps_per_round=SPR)
    commits = [e["round"] for e in events(drill.run_dir) if e["event"] == "commit"]
    assert sorted(set(commits)) == list(range(ROUNDS)), f"committed rounds {commits}: none may be lost or redone"
