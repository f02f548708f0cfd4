"""Issue 45, Acceptance 4: the capabilities together, in the regime users run. Three sites of 3, 2
and 1 replicas whose steps take 0.3, 0.45 and 0.6 s, `sync.balance=steps` (each plans about 30 s of
inner work a round: 100, 67 and 50 steps; the added site takes the run-wide 0.3 s), a checkpoint
every round. While it trains: an add-site
of one replica; one replica of the 3-replica site SIGKILLed three times from outside (the OS, not
the injector: on one node it is quarantined and kept out, its site goes on with 2); once the new
site trains, the supervisor SIGKILLed mid-inner; then a drain of the 1-replica site. The run
completes; the shared invariant checker holds (every round committed and recorded once, digests
agree after every commit, only the victim harmed, no checkpoint rewritten, every plan followed);
each request is decided once; nothing committed is lost."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, inner_running, poll

pytestmark = [pytest.mark.realistic, pytest.mark.paced]

SPR, ROUNDS = 100, 9
FIRST = ["c0r0", "c0r1", "c0r2", "c1r0", "c1r1", "c2r0"]
VICTIM = "c0r2"
RUN = FAST + [
    "topology.sites=[{replicas:3,min_step_s:0.3},{replicas:2,min_step_s:0.45},{replicas:1,min_step_s:0.6}]",
    "topology.cpus_per_replica=0.5",
    "sync.balance=steps",
    "train.min_step_s=0.3",  # the added site's pacing (a site without its own takes the run-wide one)
    f"sync.outer_every={SPR}",
    f"train.rounds={ROUNDS}",
    "train.eval_batches=1",
    "checkpoint.every=1",
    "checkpoint.keep=20",
    "comm.timeout_s=10",
]


def _ups(run_dir, rid: str) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "replica_up" and e["rid"] == rid]


def _sigkill_and_wait_back(run_dir, rid: str, *, back: bool = True) -> None:
    """SIGKILL rid's current process (its last replica_up's pid) and, unless it is expected to stay
    out, wait until it is up again as another process."""
    ups = _ups(run_dir, rid)
    os.kill(ups[-1]["pid"], signal.SIGKILL)
    if back:
        poll(f"{rid} up again after SIGKILL {len(ups)}", 240, lambda: len(_ups(run_dir, rid)) > len(ups))


@pytest.mark.timeout(1200)
def test_sites_balance_quarantine_restarts_and_requests_compose_in_30_s_rounds(background_drills, tmp_path):
    drill = background_drills(RUN, tmp_path)
    run_dir = drill.run_dir
    poll("round 0's inner phase on every replica", 240, lambda: inner_running(run_dir, FIRST, 0, min_step=5))

    join_id = drill.add_site(1)
    _sigkill_and_wait_back(run_dir, VICTIM)
    _sigkill_and_wait_back(run_dir, VICTIM)
    _sigkill_and_wait_back(run_dir, VICTIM, back=False)
    quarantined = poll(
        f"{VICTIM} quarantined",
        240,
        lambda: next((e for e in events(run_dir) if e["event"] == "replica_quarantined"), None),
    )
    assert quarantined["rid"] == VICTIM and quarantined["moved_to"] is None, quarantined

    joined = drill.wait_site_request(join_id, timeout_s=240)
    assert joined["outcome"] == "applied" and joined["cluster"] == "c3", joined
    up = poll("c3 up", 300, lambda: next((e for e in events(run_dir) if e["event"] == "site_up"), None))
    live = ["c0r0", "c0r1", "c1r0", "c1r1", "c2r0", "c3r0"]
    poll(
        f"round {up['round']}'s inner phase with c3",
        240,
        lambda: inner_running(run_dir, live, up["round"], min_step=5),
    )
    [boss] = [e for e in events(run_dir) if e["event"] == "supervisor_start"]
    os.kill(boss["pid"], signal.SIGKILL)
    poll(
        "the supervisor's successor",
        180,
        lambda: [e for e in events(run_dir) if e["event"] == "supervisor_start" and e["pid"] != boss["pid"]],
    )
    drain_id = drill.drain_site("c2")
    drained = drill.wait_site_request(drain_id, timeout_s=240)
    assert drained["outcome"] == "applied", drained
    summary = drill.wait_done(timeout_s=900)

    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR, victims={VICTIM})
    record = events(run_dir)
    assert summary["status"] == "completed", summary.get("reason")
    assert [e["id"] for e in record if e["event"] == "site_request"] == [join_id, drain_id], "each decided once"
    commits = {e["round"]: set(e["replicas"]) for e in record if e["event"] == "commit"}
    assert sorted(commits) == list(range(ROUNDS)), f"a committed round lost or redone: {sorted(commits)}"
    assert not [e for e in record if e["event"] == "restore"], "nothing is rolled back"
    after = [set(e["replicas"]) for e in record if e["event"] == "commit" and e["t"] > quarantined["t"]]
    assert after and all(VICTIM not in got and {"c0r0", "c0r1"} <= got for got in after), (
        f"c0 goes on with 2 once {VICTIM} is kept out: {after}"
    )
    assert summary["topology"]["drained"] == {"c2": drained["round"]}
    assert all("c3r0" in commits[r] for r in range(ROUNDS) if r > up["round"]), f"c3 trains once joined: {commits}"
    plans = [e for e in record if e["event"] == "round_plan"]
    assert plans and all(len(e["steps"]) >= 3 for e in plans), plans
    # the regime: every round plans about 30 s of inner work (an unpaced site would set 1-step rounds)
    planned_s = [max(n * s for n, s in zip(e["steps"], e["step_s"], strict=True) if s) for e in plans]
    assert min(planned_s) >= 29.0, f"rounds of less than 30 s of inner work were planned: {planned_s}"
    assert summary["replicas_quarantined"] == 1
