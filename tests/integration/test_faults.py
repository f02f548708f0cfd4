"""Fault tolerance at both levels (issue 3): every fault kind at every phase it can hit, on a
non-leader, a leader, a whole cluster and the supervisor, with the run's invariants checked.

The cases that end in a completed run share ONE run (`shared_run`): each case keeps its faults'
kinds, targets, phases and steps and the gaps between its rounds, and the cases follow one
another with a clean round after each, so every replica a case hit is back (rejoin `boundary`)
before the next case's first fault. Each test checks its case on that run's record: the shared
invariants of the whole run, and in the case's own rounds the faults it must count and invariant 7
with the case's own victims (no replica outside them marked down, declared hung, killed or
restarted there). One run instead of five saves four start-ups (~15 s each: five processes
importing torch on 2 cores)."""

from __future__ import annotations

import json

import pytest

from hsgd.record.rundir import read_jsonl
from tests.integration.invariants import HARM_EVENTS, final_params_agree
from tests.integration.invariants import check_run as check_invariants
from tests.integration.runs import events, metrics, train

ROUNDS, SPR = 8, 6
# rejoin `boundary`: these rounds last well under a second, so a replica restarting for ~4 s would
# miss the faults scheduled on it in the next rounds unless the supervisor waits for it at the
# boundary (tests/integration/test_rejoin.py covers the default `fast` rejoin in 30 s rounds).
# watchdog.floor_s=5 (as in test_watchdog.py; healthy phases here last under a second): a hung
# replica is killed after ~9 s of silence (the group's grace, comm.timeout_s + 5), not 15 (the
# default floor).
BASE = [
    f"sync.outer_every={SPR}",
    "checkpoint.every=1",
    "comm.timeout_s=4",
    "supervisor.phase_timeout_s=40",
    "supervisor.rejoin_wait_s=30",
    "supervisor.rejoin=boundary",
    "watchdog.floor_s=5",
    "optim.inner.lr=0.01",
]

# case -> its faults as (round within the case, fault without its round); round 0 of a case is
# the round its first fault hits (round 1 of a run of its own)
CASES = {
    "non_leader": [
        (0, "kind:kill,target:c0r1,phase:inner,step:2"),
        (1, "kind:crash,target:c1r1,phase:inner_sync,step:3"),
        (2, "kind:hang,target:c0r1,phase:inner,step:1,seconds:120"),
        (3, "kind:comm,target:c1r1,phase:inner,step:2"),
        (4, "kind:crash,target:c0r1,phase:outer_commit"),
        (5, "kind:kill,target:c1r1,phase:checkpoint"),
    ],
    "supervisor": [
        (0, "kind:kill,target:supervisor,phase:inner"),
        (2, "kind:crash,target:supervisor,phase:outer"),
        (3, "kind:kill,target:supervisor,phase:outer_commit"),
        (4, "kind:crash,target:supervisor,phase:checkpoint"),
    ],
    "error": [
        (0, "kind:error,target:c0r1,phase:inner,step:2"),
        (1, "kind:error,target:leader:c1,phase:outer"),
        (2, "kind:error,target:c1r1,phase:checkpoint"),
    ],
    "two_at_once": [
        (0, "kind:crash,target:c0r1,phase:inner,step:2"),
        (0, "kind:kill,target:c1r0,phase:inner,step:2"),
        (1, "kind:crash,target:c0r0,phase:heal"),
    ],
    "whole_cluster": [
        (0, "kind:kill,target:cluster:c1,phase:inner,step:2"),
        (2, "kind:crash,target:cluster:c0,phase:outer"),
        (3, "kind:comm,target:cluster:c1,phase:inner_sync,step:1"),
        (4, "kind:hang,target:cluster:c0,phase:inner,step:3,seconds:120"),
    ],
}


def lay_out(cases: dict) -> tuple[dict, list[str], int]:
    """The cases one after the other from round 1 (round 0 teaches the watchdog the phases' pace):
    (case -> its rounds [first, end), the run's faults, the run's rounds). A case's rounds are its
    faults' rounds and one clean round after, in which its victims rejoin."""
    spans, faults, first = {}, [], 1
    for case, specs in cases.items():
        end = first + max(r for r, _ in specs) + 2
        spans[case] = (first, end)
        faults += [f"{spec},round:{first + r}" for r, spec in specs]
        first = end
    return spans, faults, first


SPANS, SHARED_FAULTS, SHARED_ROUNDS = lay_out(CASES)


def schedule(*faults: str) -> str:
    return "faults.schedule=[" + ",".join("{" + f + "}" for f in faults) + "]"


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """rounds -> the summary of a fault-free run of that many rounds (one run per length)."""
    runs: dict[int, dict] = {}

    def run(rounds: int) -> dict:
        if rounds not in runs:
            runs[rounds] = train(tmp_path_factory.mktemp("fault_free") / "run", BASE + [f"train.rounds={rounds}"])
        return runs[rounds]

    return run


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, fault_free):
    """(run dir, summary, the summary of a fault-free run as long) of the one run that holds every
    case of CASES."""
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    s = train(run_dir, BASE + [f"train.rounds={SHARED_ROUNDS}", schedule(*SHARED_FAULTS)])
    return run_dir, s, fault_free(SHARED_ROUNDS)


def check_run(run_dir, s, fault_free, min_faults, rounds=ROUNDS):
    check_invariants(run_dir, rounds=rounds, steps_per_round=SPR)  # victims: the replicas the faults hit
    assert s["status"] == "completed", s.get("reason")
    assert s["rounds_committed"] == rounds == fault_free["rounds_committed"]
    assert s["inner_steps_committed"] == fault_free["inner_steps_committed"] == rounds * SPR
    assert [m["round"] for m in metrics(run_dir)] == list(range(rounds))
    assert final_params_agree(s, run_dir), s["replica_param_digests"]
    assert set(s["replica_param_digests"]) == {"c0r0", "c0r1", "c1r0", "c1r1"}, "a replica never came back"
    ratio = s["final_eval_loss"] / fault_free["final_eval_loss"]
    assert abs(ratio - 1) < 0.05, (
        f"final eval loss {s['final_eval_loss']} vs fault-free {fault_free['final_eval_loss']}"
    )
    assert len(s["faults"]) >= min_faults, s["faults"]
    for f in s["faults"]:
        if f["kind"] != "slow":
            assert f["detection_latency_s"] is not None, f"fault never detected: {f}"
            assert f["recovery_latency_s"] is not None, f"no recovery after: {f}"
    assert 0 < s["step_efficiency"] <= 1 and 0 < s["training_efficiency"] <= s["step_efficiency"]


def _after_round(record: list[dict], r: int) -> int:
    """Index in events.jsonl just after round r was committed (its `commit`, or its
    `round_recorded_late` when a supervisor died before logging the commit)."""
    return 1 + next(
        i for i, e in enumerate(record) if e["event"] in ("commit", "round_recorded_late") and e["round"] == r
    )


def check_case(shared_run, case: str, min_faults: int) -> list[dict]:
    """The shared run's checks (check_run), then the case's in its rounds: at least `min_faults`
    faults reported there, and invariant 7 with the case's victims (the replicas faults_fired.jsonl
    names in its rounds): no other replica marked down, declared hung, killed or restarted from the
    commit of the round before the case to the commit of its last (clean) round, or to the run's end
    for the last case. Returns that part of events.jsonl."""
    run_dir, s, reference = shared_run
    check_run(run_dir, s, reference, min_faults=len(SHARED_FAULTS), rounds=SHARED_ROUNDS)
    first, end = SPANS[case]
    mine = [f for f in s["faults"] if f.get("round") is not None and first <= f["round"] < end]
    assert len(mine) >= min_faults, mine
    victims = {
        f["rid"]
        for f in read_jsonl(run_dir / "faults_fired.jsonl")
        if first <= f["round"] < end and f["rid"] != "supervisor"
    }
    record = events(run_dir)
    lo = _after_round(record, first - 1)
    hi = len(record) if end == SHARED_ROUNDS else _after_round(record, end - 1)
    pids: dict[str, set] = {}  # rid -> its processes before the case
    for e in record[:lo]:
        if e.get("rid") is not None and e.get("pid") is not None:
            pids.setdefault(e["rid"], set()).add(e["pid"])
    harmed = [
        e
        for e in record[lo:hi]
        if e.get("rid") not in victims
        and (
            e["event"] in HARM_EVENTS
            or (e.get("rid") is not None and e.get("pid") is not None and e["pid"] not in pids.get(e["rid"], set()))
        )
    ]
    assert not harmed, (
        f"invariant 7 (no healthy replica harmed) broken in rounds {first}..{end - 1} "
        f"(victims {sorted(victims)}): {harmed}"
    )
    return record[lo:hi]


def test_non_leader_faults_in_every_phase(shared_run):
    check_case(shared_run, "non_leader", min_faults=6)


@pytest.mark.long
def test_leader_faults_in_every_phase(tmp_path, fault_free):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        BASE
        + [
            f"train.rounds={ROUNDS}",
            schedule(
                "kind:kill,target:leader:c0,round:1,phase:inner,step:2",
                "kind:crash,target:leader:c1,round:2,phase:outer",
                "kind:hang,target:leader:c0,round:3,phase:outer,seconds:120",
                "kind:comm,target:leader:c1,round:4,phase:outer",
                "kind:kill,target:leader:c0,round:5,phase:outer_commit",
                "kind:crash,target:leader:c1,round:6,phase:checkpoint",
            ),
        ],
    )
    check_run(run_dir, s, fault_free(ROUNDS), min_faults=6)
    downs = [e for e in events(run_dir) if e["event"] == "replica_down"]
    assert len(downs) >= 5
    leaders = [e["leaders"] for e in events(run_dir) if e["event"] == "membership"]
    assert len({json.dumps(x, sort_keys=True) for x in leaders}) > 1, "no new leader was ever named"


def test_whole_cluster_faults(shared_run):
    record = check_case(shared_run, "whole_cluster", min_faults=7)
    heals = [e for e in record if e["event"] == "heal_end"]
    assert any(h["scope"] == "global" for h in heals), "a dead cluster must heal from another cluster"


def test_an_exception_inside_a_replica_is_that_replicas_failure_not_the_jobs(shared_run):
    record = check_case(shared_run, "error", min_faults=3)
    downs = [e for e in record if e["event"] == "replica_down"]
    assert [e["cause"] for e in downs] == ["error"] * 3, downs


def test_supervisor_faults(shared_run):
    record = check_case(shared_run, "supervisor", min_faults=4)
    assert shared_run[1]["supervisor_starts"] == 1 + len(CASES["supervisor"])  # the run's only supervisor faults
    assert sum(e["event"] == "supervisor_start" for e in record) == len(CASES["supervisor"])


def test_two_faults_at_once_and_a_fault_during_heal(shared_run):
    check_case(shared_run, "two_at_once", min_faults=3)


@pytest.mark.long
def test_same_seed_and_schedule_give_the_same_digest(tmp_path):
    faults = schedule(
        "kind:kill,target:c0r1,round:1,phase:inner,step:2",
        "kind:crash,target:leader:c1,round:2,phase:outer",
        "kind:crash,target:leader:c0,round:3,phase:outer_commit",
    )
    # rejoin `boundary`: restarted replicas join at round boundaries, which makes the replay bitwise
    overrides = [
        f"sync.outer_every={SPR}",
        "train.rounds=5",
        "checkpoint.every=0",
        "comm.timeout_s=4",
        faults,
        "supervisor.rejoin=boundary",
    ]
    first = train(tmp_path / "a", overrides)
    second = train(tmp_path / "b", overrides)
    for run in ("a", "b"):
        check_invariants(tmp_path / run, rounds=5, steps_per_round=SPR)
    assert first["status"] == second["status"] == "completed"
    assert first["global_param_digest"] == second["global_param_digest"], "invariant 5: same seed + schedule"


def test_below_quorum_fails_cleanly_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        f"sync.outer_every={SPR}",
        "train.rounds=5",
        "checkpoint.every=1",
        "comm.timeout_s=4",
        "supervisor.min_clusters=2",
        "supervisor.quorum_wait_s=5",
    ]
    s = train(
        run_dir,
        overrides + ["faults.max_restarts=0", schedule("kind:kill,target:cluster:c1,round:2,phase:inner,step:1")],
    )
    assert s["status"] == "failed"
    assert "quorum" in s["reason"] and "min_clusters=2" in s["reason"], s["reason"]
    # it gave up after one bounded wait for the lost cluster (quorum_wait_s), not round after round
    record = events(run_dir)
    waits = [e for e in record if e["event"] == "quorum_wait"]
    assert len(waits) == 1 and waits[0]["wait_s"] == 5, waits
    names = [e["event"] for e in record]
    after = names[names.index("quorum_wait") :]
    assert after.count("run_failed") == 1 and "commit" not in after and "phase_begin" not in after, after
    check_invariants(run_dir, rounds=2, steps_per_round=SPR, expect_status="failed")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts and ckpts[-1] == "round_000002" and not any(".tmp-" in c for c in ckpts), ckpts
    resumed = train(run_dir, overrides + ["train.resume=true"])
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 5
    check_invariants(run_dir, rounds=5, steps_per_round=SPR)  # both jobs' record, in one run.dir
