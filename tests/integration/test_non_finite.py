"""Non-finite numbers never commit (issue 19, acceptance 8): a replica made to produce a NaN loss
mid-round (the `nan` fault) voids its cluster's round — nobody is killed, its pseudo-gradient is
never sent, the other clusters commit without it, it comes back from the committed global params
— and the run completes with finite numbers and one `non_finite` fault in its summary."""

from __future__ import annotations

import math

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, train

CLUSTERS, ROUNDS, SPR = 3, 4, 6
BASE = [
    f"topology.clusters={CLUSTERS}",
    "topology.replicas_per_cluster=2",
    f"sync.outer_every={SPR}",
    f"train.rounds={ROUNDS}",
    "checkpoint.every=0",
    "comm.timeout_s=10",
    "supervisor.phase_timeout_s=60",
    "optim.inner.lr=0.01",
]


def test_a_nan_loss_mid_round_voids_its_cluster_and_never_commits(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, BASE + ["faults.schedule=[{kind:nan,target:c1r0,round:1,phase:inner,step:3}]"])
    s = check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)  # digests agree after every commit, no harm
    ev, ms = events(run_dir), metrics(run_dir)
    assert s["status"] == "completed", s.get("reason")

    # found once, for cluster c1 in round 1, as a non-finite loss; nobody killed or marked down
    (nf,) = [e for e in ev if e["event"] == "non_finite"]
    assert (nf["cluster"], nf["round"], nf["what"]) == (1, 1, "loss") and "c1r0" in nf["rids"], nf
    assert not [e for e in ev if e["event"] in ("replica_down", "kill", "hang_detected", "replica_error")]
    assert not [e for e in ev if e["event"] == "cluster_benched"]

    # c1's pseudo-gradient never sent: round 1's outer exchange and commit were c0 and c2 only
    c1 = {"c1r0", "c1r1"}
    outer_1 = [e for e in ev if e["event"] == "phase_begin" and e["phase"] == "outer" and e["round"] == 1]
    assert outer_1 and all(not c1 & set(e["replicas"]) for e in outer_1), outer_1
    (decision,) = [e for e in ev if e["event"] == "commit_decision" and e["round"] == 1]
    assert decision["clusters"] == [0, 2]
    assert set(ms[1]["replica_digests"]) == {"c0r0", "c0r1", "c2r0", "c2r1"}
    assert 0 < ms[1]["outer_bytes"] < ms[0]["outer_bytes"], "two leaders reduced in round 1, three in round 0"

    # round 2: c1 restarts from the committed global params and takes part again
    heals = {e["target"]: e["scope"] for e in ev if e["event"] == "heal_end" and e["target"] in c1}
    assert heals == {"c1r0": "global", "c1r1": "global"}, heals
    (decision_2,) = [e for e in ev if e["event"] == "commit_decision" and e["round"] == 2]
    assert decision_2["clusters"] == [0, 1, 2]

    # the global params stay finite: every recorded loss and eval loss is a number
    for m in ms:
        assert m["loss"] is not None and math.isfinite(m["loss"]), m
        assert all(math.isfinite(x) for x in m["replica_loss"].values()), m
    assert math.isfinite(s["final_eval_loss"]) and s["final_eval_loss"] < s["initial_eval_loss"]
    assert len(set(s["replica_param_digests"].values())) == 1 and len(s["replica_param_digests"]) == 2 * CLUSTERS

    # one fault in the summary, injected, with cause non_finite
    (fault,) = [f for f in s["faults"] if f["cause"] == "non_finite"]
    assert (fault["source"], fault["kind"], fault["rid"], fault["detected_by"]) == (
        "injected",
        "nan",
        "c1r0",
        "non_finite",
    )
    assert len(s["faults"]) == 1, s["faults"]
