"""A holder SIGKILLed from outside in the middle of a `reduce_scatter` outer exchange (issue 47,
Acceptance 4), with real Ray actors and gloo groups: three sites of unequal sizes (token weights), int4,
`sync.outer_exchange` at its default (auto: 3 sites reduce-scatter), and a slow simulated outer link so
the exchange's two collectives take seconds. The dead leader's exchange fails for every holder, the
round is retried once its site re-forms, and every invariant holds every round: bitwise-equal params and
global params after each commit. Each round's metrics name the exchange and count every site's slow-link
bytes; the summary adds them up. (Starts Ray: run it under the shared lock.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, metrics, poll, replica_progress

SPR, ROUNDS = 10, 4
RUN = [
    "topology.sites=[{replicas:2},{replicas:1},{replicas:1}]",
    f"sync.outer_every={SPR}",
    "sync.outer_compress=int4",
    f"train.rounds={ROUNDS}",
    "checkpoint.every=0",
    "train.eval_batches=1",
    # 1.5 s a collective: the reduce_scatter's all-to-all and all-gather hold the holders ~3 s
    "links.outer.gbps=10",
    "links.outer.latency_ms=1500",
    "comm.timeout_s=5",
    "comm.configure_timeout_s=10",
    "supervisor.rejoin=fast",
]
VICTIM = "c0r0"  # site c0's leader, its outer holder; c0r1 leads the retry, so 3 sites exchange again


def _reducing(run_dir, rid: str, round_index: int) -> dict | None:
    answer = replica_progress(run_dir, rid)
    return answer if answer and answer["round"] == round_index and answer["phase"] == "outer" else None


@pytest.mark.timeout(600)
def test_a_holder_sigkilled_mid_reduce_scatter_costs_a_retry_and_every_commit_keeps_the_same_bits(
    background_drills, tmp_path
):
    drill = background_drills(FAST + RUN, tmp_path)
    reducing = poll(f"{VICTIM} in round 1's outer exchange", 300, lambda: _reducing(drill.run_dir, VICTIM, 1), 0.05)
    os.kill(reducing["pid"], signal.SIGKILL)  # the OS, not the injector
    killed_at = time.time()
    summary = drill.wait_done(600)
    check_run(drill.run_dir, rounds=ROUNDS, steps_per_round=SPR, victims={VICTIM})
    evs = events(drill.run_dir)
    down = [e for e in evs if e["event"] == "replica_down" and e["rid"] == VICTIM and e["t"] >= killed_at - 1]
    assert down and down[0]["round"] == 1, f"{VICTIM} was not lost in round 1: {down}"
    outer_phases = [e for e in evs if e["event"] == "phase_begin" and e["phase"] == "outer" and e["round"] == 1]
    assert len(outer_phases) >= 2, f"round 1's broken exchange was not retried: {outer_phases}"
    rows = metrics(drill.run_dir)
    assert [m["outer_exchange"] for m in rows] == ["reduce_scatter"] * ROUNDS, [m["outer_exchange"] for m in rows]
    for m in rows:
        assert len(m["cluster_link_bytes"]) == 3 and all(b > 0 for b in m["cluster_link_bytes"]), m
    totals = [sum(m["cluster_link_bytes"][c] for m in rows) for c in range(3)]
    assert summary["link_bytes_per_cluster"] == totals, (summary["link_bytes_per_cluster"], totals)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"], "the model did not train"
