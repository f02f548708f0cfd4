"""A death in a rendezvous costs its cluster seconds, not the configure timeout (issue 21,
Build 4 / Acceptance 1). c1r1 is killed by the injector at the start of forming c1's inner group,
before it arrives in the rendezvous (fault phase `join`). The supervisor learns of the death from
Ray and aborts that rendezvous: c1r0 leaves it with a `join_aborted` error, c1 re-forms without
c1r1 and later takes it back, and the run completes with digests agreeing. Read from the run's
events, never from a wall clock. (Starts Ray: run it under the shared lock.)"""

from __future__ import annotations

from tests.integration.invariants import check_run
from tests.integration.runs import events, train

ROUNDS, SPR = 3, 6
# a configure timeout far longer than the whole run: the only way out of the rendezvous in time is the abort
BASE = [
    f"sync.outer_every={SPR}",
    f"train.rounds={ROUNDS}",
    "topology.clusters=2",
    "topology.replicas_per_cluster=2",
    "comm.timeout_s=5",
    "comm.configure_timeout_s=300",
    "supervisor.phase_timeout_s=60",
    "optim.inner.lr=0.01",
]


def test_a_member_dying_in_its_group_s_rendezvous_releases_its_peers_by_an_abort(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, BASE + ["faults.schedule=[{kind:kill,target:c1r1,round:0,phase:join}]"])
    assert s["status"] == "completed", s.get("reason")
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)
    ev = events(run_dir)
    aborts = [e for e in ev if e["event"] == "join_aborted"]
    assert aborts and aborts[0]["cluster"] == 1 and aborts[0]["dead"] == ["c1r1"], aborts
    assert aborts[0]["prefix"].endswith("/inner/c1"), aborts[0]
    released = [e for e in ev if e["event"] == "collective_failed" and e["rid"] == "c1r0" and e["round"] == 0]
    assert released and released[0].get("error_kind") == "join_aborted", (
        f"c1r0 left the rendezvous by something else than the abort: {released}"
    )
    assert not [e for e in ev if e["event"] == "collective_failed" and e.get("error_kind") == "configure"], (
        "a member waited out the configure timeout"
    )
    reform = [e for e in ev if e["event"] == "cluster_reform" and e["cluster"] == 1 and e["t"] > aborts[0]["t"]]
    assert reform and reform[0]["round"] == 0, f"c1 did not re-form in round 0 after the abort: {reform}"
    assert not [e for e in ev if e["event"] == "cluster_reform" and e["cluster"] == 0], "c0 is untouched"
    downs = [e for e in ev if e["event"] == "replica_down" and e["rid"] == "c1r1"]
    assert len(downs) == 1 and s["faults"][0]["rid"] == "c1r1", (downs, s["faults"])
