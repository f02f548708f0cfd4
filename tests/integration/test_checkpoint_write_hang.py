"""Issue 45 finding 6, in a real run: a checkpoint write that hangs past `supervisor.phase_timeout_s`
is a storage fault. The checkpoint is skipped (`checkpoint_failed`), nobody is killed, training goes
on from the same processes, and the later checkpoints are written.

The hang: the injector's `hang` in the checkpoint phase of c1r0 keeps that replica inside its
`save_checkpoint` call for `seconds`, answering `progress` meanwhile — what a write blocked on a
stalled mount looks like from the supervisor (no FUSE mount can be made here to stall a real one).
"""

from __future__ import annotations

from tests.integration.invariants import check_run
from tests.integration.runs import events, train

SPR = 2
ROUNDS = 5
DEADLINE_S = 15  # supervisor.phase_timeout_s: far above a round of this tiny model, far below the hang
HANG_S = 25


def test_a_checkpoint_write_hung_past_its_deadline_is_skipped_and_kills_nobody(tmp_path):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        [
            "topology.clusters=2",
            "topology.replicas_per_cluster=1",
            f"sync.outer_every={SPR}",
            f"train.rounds={ROUNDS}",
            "checkpoint.every=1",
            f"supervisor.phase_timeout_s={DEADLINE_S}",
            "comm.timeout_s=5",
            # the checkpoint taken after round 1 (that of round 2)
            f"faults.schedule=[{{kind:hang,target:c1r0,round:1,phase:checkpoint,seconds:{HANG_S}}}]",
        ],
    )
    evs = events(run_dir)
    failed = [e for e in evs if e["event"] == "checkpoint_failed"]
    assert [(e["round"], e["replicas"]) for e in failed] == [(2, ["c1r0"])], failed
    assert "phase_timeout_s" in failed[0]["error"], failed
    saved = [e["round"] for e in evs if e["event"] == "checkpoint"]
    assert saved == [1, 3, 4, 5], f"the others written as ever: {saved}"
    assert s["checkpoints_failed"] == 1
    # nobody harmed: no replica down, killed or restarted (c1r0 is no victim: storage was)
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR, victims=set())
