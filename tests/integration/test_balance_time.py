"""Rounds closed by the clock, end to end (issue 48, `sync.balance=time`): a site whose processes are
paused from outside (SIGSTOP) past the close plus `sync.grace_s` is late — the round commits without
it, nobody is killed, no fault is counted — and it takes part again after it is resumed (SIGCONT);
a replica SIGKILLed while its site yields is restarted and healed as today; a supervisor SIGKILLed
between the close and the commit leaves its successor the recorded close, and the round commits
once. Every run goes through the shared invariant checker."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.fakes.deadlines import HANG_S
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, metrics, poll, replica_progress

SPR = 20
STEP_S = 0.2  # 20 x 0.2 s = 4 s of inner work per round in every site; the close at 5 s


def _timed(sites: str, rounds: int, *extra: str) -> list[str]:
    return [
        sites,
        "sync.balance=time",
        "sync.round_s=5",
        "sync.grace_s=4",  # (a yield under busy cores may take seconds)
        f"sync.outer_every={SPR}",
        f"train.rounds={rounds}",
        "train.eval_batches=1",
        "checkpoint.every=0",
        *extra,
    ]


def _first(run_dir: Path, name: str, **fields):
    return next(
        (e for e in events(run_dir) if e["event"] == name and all(e.get(k) == v for k, v in fields.items())), None
    )


def _inner_begun(run_dir: Path, cluster: int, round_index: int, after_s: float) -> bool:
    begun = _first(run_dir, "phase_begin", phase="inner", cluster=cluster, round=round_index)
    return begun is not None and time.time() - begun["t"] >= after_s


def _commit_with(run_dir: Path, rid: str, after: float):
    """The first commit after `after` whose replicas include rid."""
    return next(
        (e for e in events(run_dir) if e["event"] == "commit" and rid in e["replicas"] and e["t"] > after), None
    )


def _pids(run_dir: Path, rids: list[str]) -> dict[str, int]:
    answers = {rid: replica_progress(run_dir, rid) for rid in rids}
    return {rid: a["pid"] for rid, a in answers.items() if a} if all(answers.values()) else {}


# -- 1. a paused site is late: the round goes on without it, nobody is killed, it comes back -----------
PAUSE_S = 14.0  # from ~1 s into the inner phase: past the close (5 s) plus the grace (4 s)
PAUSED_SITES = "topology.sites=[{replicas:1,min_step_s:0.2},{replicas:1,min_step_s:0.2},{replicas:2,min_step_s:0.2}]"
PAUSE_ROUND = 2


@pytest.mark.long  # one drill with a 12-s pause, until the site trained again (~1.5 minutes on 2 cores)
@pytest.mark.paced
def test_a_site_paused_past_the_close_is_late_nobody_is_killed_and_it_trains_again_once_resumed(
    background_drills, tmp_path
):
    drill = background_drills(FAST + _timed(PAUSED_SITES, 1000), tmp_path)  # stopped once the site is back
    run_dir = Path(drill.run_dir)
    site = ["c2r0", "c2r1"]
    poll(
        f"round {PAUSE_ROUND}'s inner phase in c2",
        HANG_S,
        lambda: _inner_begun(run_dir, 2, PAUSE_ROUND, 1.0),
        every_s=0.05,
    )
    pids = poll("c2's pids", 30, lambda: _pids(run_dir, site))
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)  # the OS, not the injector: the whole site stops mid-step
    paused_at = time.time()
    late = poll("c2 late", HANG_S, lambda: _first(run_dir, "site_late", cluster=2))
    time.sleep(max(0.0, paused_at + PAUSE_S - time.time()))
    for pid in pids.values():
        os.kill(pid, signal.SIGCONT)
    resumed_at = time.time()
    # however long its abandoned calls take to end on busy cores: until the site commits again
    poll("c2 in a commit again", HANG_S, lambda: _commit_with(run_dir, "c2r1", resumed_at))
    summary = drill.stop(timeout_s=HANG_S)
    assert summary["status"] == "stopped", summary.get("reason")

    check_run(run_dir, rounds=summary["rounds_committed"], steps_per_round=SPR, victims=set(), expect_status="stopped")
    record = events(run_dir)
    assert late["round"] == PAUSE_ROUND and sorted(late["waiting_on"]) == site, late
    assert paused_at < late["t"] < resumed_at, "late while still paused: the round did not wait for it"
    commits = {e["round"]: set(e["replicas"]) for e in record if e["event"] == "commit"}
    assert not commits[PAUSE_ROUND] & set(site), f"round {PAUSE_ROUND} committed with the late site: {commits}"
    assert {"c0r0", "c1r0"} <= commits[PAUSE_ROUND]
    # nobody killed, no fault counted: slow is not dead
    assert summary["faults"] == [], summary["faults"]
    assert not [e for e in record if e["event"] in ("replica_down", "kill", "presumed_dead")], "a paused site was hurt"
    # it trains again: healed from the new global params, then in a commit with the others
    back = [r for r, got in commits.items() if r > PAUSE_ROUND and set(site) <= got]
    assert back, f"c2 never committed again after its resume: {commits}"
    heals = [e for e in record if e["event"] == "heal_end" and e.get("target") in site and e["t"] > late["t"]]
    assert {e["target"] for e in heals} == set(site), f"c2 was not re-synced: {heals}"
    lost = {m["round"]: m["late_steps"] for m in metrics(run_dir)}
    assert lost[PAUSE_ROUND] == 2 * late["steps"] and all(n == 0 for r, n in lost.items() if r != PAUSE_ROUND)
    closed = _first(run_dir, "round_closed", round=PAUSE_ROUND)
    assert closed is not None and closed["t"] < late["t"], "the close is recorded before the site is late"


# -- 2. a replica SIGKILLed while its site yields; the supervisor SIGKILLed after the close ----------
TWO_SITES = "topology.sites=[{replicas:2,min_step_s:0.2},{replicas:2,min_step_s:0.6}]"  # c1 3x slower: it yields
KILL_ROUND = 2


@pytest.mark.long  # one drill with an outside kill and a supervisor restart (~2-3 minutes on 2 cores)
@pytest.mark.paced
def test_a_replica_killed_while_its_site_yields_heals_and_a_supervisor_killed_after_the_close_commits_once(
    background_drills, tmp_path
):
    # rounds go on until each event came (however long a restart takes on busy cores), then the run stops
    drill = background_drills(FAST + _timed(TWO_SITES, 1000, "comm.timeout_s=5"), tmp_path)
    run_dir = Path(drill.run_dir)
    # (a) c1 is asked to yield at the close of KILL_ROUND: c1r1 dies right then, from outside
    closed = poll("round_closed", HANG_S, lambda: _first(run_dir, "round_closed", round=KILL_ROUND), every_s=0.05)
    victim = replica_progress(run_dir, "c1r1")
    os.kill(victim["pid"], signal.SIGKILL)
    back = poll("c1r1 in a commit again", HANG_S, lambda: _commit_with(run_dir, "c1r1", closed["t"]))
    # (b) the supervisor dies right after the next round closed, before its commit
    supervisor_round = back["round"] + 1
    poll("round_closed", HANG_S, lambda: _first(run_dir, "round_closed", round=supervisor_round), every_s=0.05)
    [boss] = [e for e in events(run_dir) if e["event"] == "supervisor_start"]
    os.kill(boss["pid"], signal.SIGKILL)
    poll(
        f"round {supervisor_round + 1}'s commit by the successor",
        HANG_S,
        lambda: _first(run_dir, "commit", round=supervisor_round + 1),
    )
    summary = drill.stop(timeout_s=HANG_S)
    assert summary["status"] == "stopped", summary.get("reason")

    rounds = summary["rounds_committed"]
    check_run(run_dir, rounds=rounds, steps_per_round=SPR, victims={"c1r1"}, expect_status="stopped")
    record = events(run_dir)
    assert summary["supervisor_starts"] == 2, summary["supervisor_starts"]
    assert sorted({f["rid"] for f in summary["faults"] if f["source"] == "observed"}) == ["c1r1"], summary["faults"]
    commits = [e for e in record if e["event"] == "commit"]
    assert sorted(e["round"] for e in commits) == list(range(rounds)), "a round committed twice, or lost"
    steps = {m["round"]: m["cluster_steps"] for m in metrics(run_dir)}
    assert closed["steps"]["1"] <= steps[KILL_ROUND][1] < SPR, (
        f"the slow site yielded at the close, where it was asked even with a member killed: {closed}, {steps}"
    )
    heal = [e for e in record if e["event"] == "heal_end" and e.get("target") == "c1r1" and e["t"] > closed["t"]]
    assert heal and heal[0]["t"] < back["t"], "the killed replica was healed before it trained again"
    # the successor followed the recorded close: one round_closed for the round, its steps in the record
    after = [e for e in record if e["event"] == "round_closed" and e["round"] == supervisor_round]
    assert len(after) == 1, after
    assert all(after[0]["steps"][str(c)] <= n for c, n in enumerate(steps[supervisor_round])), (after, steps)


# -- 3. the realistic regime: three unequal sites, 30-s rounds, a slowdown and a kill in one round -------
REAL_SITES = "topology.sites=[{replicas:2,min_step_s:0.5},{replicas:1,min_step_s:0.75},{replicas:2,min_step_s:1.0}]"
REAL_SPR, REAL_ROUNDS, REAL_ROUND = 60, 4, 2  # the fastest site's 60 x 0.5 s: every round closes at 31 s
REAL = [
    REAL_SITES,
    "sync.balance=time",  # sync.round_s null: the close is learned from round 0 (which runs every site's 60)
    f"sync.outer_every={REAL_SPR}",
    f"train.rounds={REAL_ROUNDS}",
    "train.eval_batches=1",
    "checkpoint.every=2",
    # c1 three times slower (0.75 s + 1.5 s a step) for the rest of round 2, about 30 s
    f"faults.schedule=[{{kind:slow,target:cluster:c1,round:{REAL_ROUND},phase:inner,step:0,seconds:1.5}}]",
]


@pytest.mark.realistic
@pytest.mark.paced  # steps padded to 0.5-1 s: the processes sleep most of the time
@pytest.mark.timeout(1200)
def test_realistic_three_unequal_sites_with_a_site_slowed_and_a_replica_sigkilled_in_one_round(
    background_drills, tmp_path
):
    drill = background_drills(FAST + REAL, tmp_path)
    run_dir = Path(drill.run_dir)
    poll(
        f"round {REAL_ROUND}'s inner phase 10 s in, in c2",
        HANG_S * 2,
        lambda: _inner_begun(run_dir, 2, REAL_ROUND, 10.0),
        every_s=0.1,
    )
    victim = poll("c2r1's pid", 30, lambda: replica_progress(run_dir, "c2r1"))
    os.kill(victim["pid"], signal.SIGKILL)  # from outside
    summary = drill.wait_done(HANG_S * 3)

    check_run(run_dir, rounds=REAL_ROUNDS, steps_per_round=REAL_SPR, victims={"c2r1"})
    record = events(run_dir)
    closes = {e["round"]: e for e in record if e["event"] == "round_closed"}
    assert sorted(closes) == list(range(1, REAL_ROUNDS)), f"rounds 1.. close (round 0 learns): {sorted(closes)}"
    assert all(e["close_s"] >= 30.0 for e in closes.values()), f"the regime: 30-s rounds ({closes})"
    steps = {m["round"]: m["cluster_steps"] for m in metrics(run_dir)}
    assert steps[0] == [REAL_SPR] * 3, "round 0 runs every site's steps"
    assert steps[REAL_ROUND][0] == REAL_SPR and 0 < steps[REAL_ROUND][1] < steps[REAL_ROUND - 1][1], (
        f"the slowed site yielded with fewer steps than before, the fastest ran its round: {steps}"
    )
    assert [f["rid"] for f in summary["faults"] if f["source"] == "observed"] == ["c2r1"], summary["faults"]
    assert not [e for e in record if e["event"] == "site_late"], "slowed or short a member, no site is late"
