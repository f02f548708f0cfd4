"""The outer exchange sharded across every member, compressed to int4 with error feedback, in two
fragments (issue 22, Build 6 / Acceptance 4), with real Ray actors and gloo groups: faults in the
middle of a shard's exchange roll that exchange back and retry it, a dead holder's cluster heals
from a live peer (the residual with it), and every invariant holds every round. (Starts Ray: run
it under the shared lock.)"""
from __future__ import annotations

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, train

SPR = 4  # steps per round: outer_every 8 over 2 fragments
STREAMING = ["topology.clusters=3", "topology.replicas_per_cluster=2", "sync.outer_every=8", "sync.fragments=2",
             "sync.outer_path=sharded", "sync.outer_compress=int4", "train.rounds=5", "checkpoint.every=2",
             "comm.timeout_s=5", "comm.configure_timeout_s=10"]
FAULTS = ("faults.schedule=["
          "{kind:kill,target:c0r1,round:1,phase:outer},"       # a non-leader shard holder dies in its shard's reduce
          "{kind:comm,target:c1r0,round:2,phase:outer},"       # shard 0's outer collective breaks
          "{kind:kill,target:c2r0,round:3,phase:inner,step:1},"  # a leader (holder of shard 0) dies mid-round
          "{kind:crash,target:c1r1,round:4,phase:outer_commit}]")  # a member crashes while its cluster gathers


def test_sharded_compressed_fragmented_outer_sync_survives_faults_mid_exchange(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, STREAMING + [FAULTS])
    assert s["status"] == "completed", s.get("reason")
    check_run(run_dir, rounds=5, steps_per_round=SPR, victims={"c0r1", "c1r1", "c2r0", "c1r0"})
    begins = [e for e in events(run_dir) if e["event"] == "phase_begin" and e["phase"] == "outer"]
    assert len(begins[0]["replicas"]) == 6, f"round 0's exchange was not sharded over every member: {begins[0]}"
    evs = events(run_dir)
    reduces = {}
    for e in evs:
        if e["event"] == "phase_begin" and e["phase"] == "outer":
            reduces[e["round"]] = reduces.get(e["round"], 0) + 1
    assert reduces.get(1, 0) >= 2 and reduces.get(2, 0) >= 2, \
        f"the exchanges broken in rounds 1 and 2 were not retried: outer phases per round {reduces}"
    commit = next(e for e in evs if e["event"] == "commit" and e["round"] == 0)
    assert len(commit["replicas"]) == 6, f"round 0 (no fault) committed by {commit['replicas']}"
    rows = metrics(run_dir)
    assert all(m["outer_bytes"] > 0 for m in rows), "every round sent its fragment"
    assert s["final_eval_loss"] < s["initial_eval_loss"], "the model did not train"


@pytest.mark.long  # two runs (~40 s); the default suite is at its budget
def test_compression_and_fragments_cut_the_bytes_each_round_sends(tmp_path):
    """int4 with 2 fragments sends about 1/16 of the fp32 leader path's bytes per round (half the
    params, at ~0.52 bytes each): read from the two runs' metrics."""
    base = ["topology.clusters=2", "topology.replicas_per_cluster=2", "train.rounds=2", "checkpoint.every=0"]
    plain_dir, lean_dir = tmp_path / "plain", tmp_path / "lean"
    train(plain_dir, base + ["sync.outer_every=4"])
    train(lean_dir, base + ["sync.outer_every=8", "sync.fragments=2", "sync.outer_compress=int4",
                            "sync.outer_path=sharded"])
    plain = sum(m["outer_bytes"] for m in metrics(plain_dir))
    lean = sum(m["outer_bytes"] for m in metrics(lean_dir))
    assert plain > 0 and lean > 0
    assert lean < plain / 8, f"int4 + 2 fragments sent {lean} bytes vs {plain} for fp32 on the leader path"


OVERLAP = ["topology.clusters=3", "topology.replicas_per_cluster=2", "sync.outer_every=8", "sync.fragments=2",
           "sync.outer_path=sharded", "sync.fragment_delay=2", "links.outer.gbps=1", "links.outer.latency_ms=600",
           "train.rounds=6", "checkpoint.every=3", "comm.timeout_s=5", "comm.configure_timeout_s=10"]
OVERLAP_FAULTS = ("faults.schedule=["
                  "{kind:kill,target:c1r1,round:2,phase:inner,step:3},"  # a shard holder dies with its reduce in flight
                  "{kind:kill,target:c2r0,round:4,phase:inner,step:1}]")  # a leader dies before its snapshot step


def test_the_outer_reduce_runs_behind_the_inner_steps_and_a_holder_dying_mid_reduce_rolls_only_it_back(tmp_path):
    """sync.fragment_delay (issue 22, Build 3) with a slow simulated outer link: once the outer
    groups stand, every round's reduce runs behind its last inner steps; a holder killed while its
    reduce is in flight costs a retry of that exchange only; every invariant holds every round."""
    run_dir = tmp_path / "run"
    s = train(run_dir, OVERLAP + [OVERLAP_FAULTS])
    assert s["status"] == "completed", s.get("reason")
    check_run(run_dir, rounds=6, steps_per_round=SPR, victims={"c1r1", "c2r0"})
    rows = {m["round"]: m for m in metrics(run_dir)}
    assert not rows[0]["outer_overlapped"], "round 0 forms its outer groups after the inner phase"
    for r in (1, 3):  # fault-free rounds with standing groups
        assert rows[r]["outer_overlapped"], f"round {r}'s reduce did not run behind the inner steps: {rows[r]}"
    reduces = {}
    for e in events(run_dir):
        if e["event"] == "phase_begin" and e["phase"] == "outer":
            reduces[e["round"]] = reduces.get(e["round"], 0) + 1
    assert reduces[1] == 1 and reduces[3] == 1, f"an overlapped exchange was issued twice: {reduces}"
    assert s["final_eval_loss"] < s["initial_eval_loss"], "the model did not train"
