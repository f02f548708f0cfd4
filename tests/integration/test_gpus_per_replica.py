"""A replica of k ranks through jobs.train (issue 34; actors/rank_group.py): the embedded local Ray,
CPU, gloo, each rank its own process. k=2 trains like k=1 on the same seed (same tokens, eval loss
within 1e-4 relative, every replica's digest agreeing at every commit, the same bytes on both
levels); int4 with error feedback and 2 fragments within 1e-3; with sync.fragment_delay (the outer
reduce behind the inner steps) within 1e-4; and a rank SIGKILLed from outside
(not rank 0, the actor the roster knows) fails its replica whole: it comes back with all its ranks,
healed, while the other cluster never stops, checked by the shared invariant checker."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from hsgd.record.rundir import read_jsonl
from tests.fakes.deadlines import HANG_S
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, metrics, poll, replica_progress, train

# 2 clusters x 2 replicas, tiny model; 6 rounds of 10 inner steps (60 in all), evaluated every round
TWO_BY_TWO = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=2",
    "sync.outer_every=10",
    "train.rounds=6",
    "checkpoint.every=0",
    "seed=7",
]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _pair(tmp_path: Path, overrides: list[str]) -> dict[int, dict]:
    """{k: (summary, metrics)} of the same run with k=1 and k=2."""
    runs = {}
    for k in (1, 2):
        run_dir = tmp_path / f"k{k}"
        summary = train(run_dir, overrides + [f"topology.gpus_per_replica={k}"])
        check_run(run_dir, rounds=6, steps_per_round=10, victims=set())
        runs[k] = (summary, metrics(run_dir))
    return runs


@pytest.mark.timeout(600)
def test_a_two_by_two_run_of_two_ranks_per_replica_trains_like_one_rank(tmp_path):
    runs = _pair(tmp_path, TWO_BY_TWO)
    (whole, whole_rounds), (sharded, sharded_rounds) = runs[1], runs[2]
    assert sharded["status"] == "completed" and sharded["rounds_committed"] == 6, sharded
    assert _relative(sharded["final_eval_loss"], whole["final_eval_loss"]) <= 1e-4, (
        sharded["final_eval_loss"],
        whole["final_eval_loss"],
    )
    for s, w in zip(sharded_rounds, whole_rounds, strict=False):  # every round, not only the last
        assert len(set(s["replica_digests"].values())) == 1, f"round {s['round']}: replicas disagree"
        assert len(s["replica_digests"]) == 4, f"round {s['round']}: every replica's digest: {s['replica_digests']}"
        assert _relative(s["eval_loss"], w["eval_loss"]) <= 1e-4, (s["round"], s["eval_loss"], w["eval_loss"])
        # each rank moves its own shards: together what one rank moves at k=1
        assert (s["inner_bytes"], s["outer_bytes"]) == (w["inner_bytes"], w["outer_bytes"]), s["round"]
    ups = sorted(e["rid"] for e in events(tmp_path / "k2") if e["event"] == "replica_up")
    assert ups == ["c0r0", "c0r1", "c1r0", "c1r1"], f"one replica_up per replica, never per rank: {ups}"


@pytest.mark.timeout(600)
def test_int4_with_error_feedback_and_two_fragments_with_two_ranks_ends_near_one_rank(tmp_path):
    # int4's 256-value blocks are cut along each rank's shard: close to k=1, not the same bits
    runs = _pair(tmp_path, TWO_BY_TWO + ["sync.outer_compress=int4", "sync.fragments=2", "sync.outer_every=20"])
    (whole, _), (sharded, _) = runs[1], runs[2]
    assert sharded["status"] == "completed"
    assert _relative(sharded["final_eval_loss"], whole["final_eval_loss"]) <= 1e-3, (
        sharded["final_eval_loss"],
        whole["final_eval_loss"],
    )


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_fragment_delay_with_two_ranks_per_replica_ends_like_one_rank(tmp_path):
    # 2 fragments of 10 steps a round, each reduced behind its round's last 2 inner steps: every rank's
    # thread reduces its shard and agrees over the replica's background group (hsgd/train/overlap.py)
    runs = _pair(tmp_path, TWO_BY_TWO + ["sync.fragments=2", "sync.outer_every=20", "sync.fragment_delay=2"])
    (whole, whole_rounds), (sharded, sharded_rounds) = runs[1], runs[2]
    assert sharded["status"] == "completed" and sharded["rounds_committed"] == 6, sharded
    assert _relative(sharded["final_eval_loss"], whole["final_eval_loss"]) <= 1e-4, (
        sharded["final_eval_loss"],
        whole["final_eval_loss"],
    )
    overlapped = [s["round"] for s in sharded_rounds if s["outer_overlapped"]]
    assert overlapped, "no round's reduce ran behind the inner steps with k=2"
    assert overlapped == [w["round"] for w in whole_rounds if w["outer_overlapped"]], "k=2 overlapped other rounds"
    for s, w in zip(sharded_rounds, whole_rounds, strict=False):
        assert _relative(s["eval_loss"], w["eval_loss"]) <= 1e-4, (s["round"], s["eval_loss"], w["eval_loss"])


@pytest.mark.long  # moved out of the default suite (its 20 minutes): a run waited on for its event
@pytest.mark.paced  # steps padded (train.min_step_s): beside the busy long runs (tests/run_all.sh)
@pytest.mark.timeout(900)
def test_a_hot_spare_of_two_ranks_warms_up_and_takes_a_killed_replicas_place(background_drills, tmp_path):
    # one cluster of 2 replicas and a spare, 2 ranks each (6 processes: a second cluster would add
    # nothing here but start-up work); the run goes on until the killed actor, its 2 ranks rebuilt, is
    # the cluster's spare again (however long that takes on busy cores: 5 s alone, minutes beside
    # other runs), then stops
    drill = background_drills(
        FAST
        + [o for o in TWO_BY_TWO if not o.startswith(("topology.clusters=", "train.rounds="))]
        + [
            "topology.clusters=1",
            "train.rounds=10000",
            "topology.gpus_per_replica=2",
            "topology.spares_per_cluster=1",
            "topology.cpus_per_replica=0.5",
            "train.min_step_s=0.1",
            "faults.schedule=[{kind:kill,target:c0r1,round:1,phase:inner,step:3}]",
        ],
        tmp_path,
    )
    # the spare warmed up (its 2 ranks together); the killed c0r1, restarted, became the next spare
    poll("c0r1, killed and restarted, ready as c0's spare", 2 * HANG_S, lambda: _spares_ready(drill.run_dir) == [0, 0])
    summary = drill.stop()
    check_run(drill.run_dir, rounds=summary["rounds_committed"], steps_per_round=10, expect_status="stopped")
    evs = events(drill.run_dir)
    promoted = [e for e in evs if e["event"] == "spare_promoted"]
    assert [e["rid"] for e in promoted] == ["c0r1"]
    ready = [e["spare"] for e in evs if e["event"] == "spare_ready"]
    assert ready[1] == promoted[0]["replaced"] and ready[0] == promoted[0]["spare"], ready


def _spares_ready(run_dir: Path) -> list[int]:
    """The clusters of the run's spare_ready events so far, sorted."""
    return sorted(e["cluster"] for e in events(run_dir) if e["event"] == "spare_ready")


def _steps_between(run_dir: Path, rid: str, start: float, end: float) -> int:
    """How many steps rid committed after `start` and before `end` (steps/<rid>.jsonl)."""
    return sum(start < line["t"] < end for line in read_jsonl(run_dir / "steps" / f"{rid}.jsonl"))


def _stalls(run_dir: Path, rid: str, around: float, steps_per_round: int = 40) -> float:
    """The longest wait between two of rid's consecutive committed steps of one round, within 30 s
    after `around` (steps/; a round's end waits for the outer exchange by design): a figure, printed."""
    lines = [line for line in read_jsonl(run_dir / "steps" / f"{rid}.jsonl") if around - 5 <= line["t"] <= around + 30]
    return max(
        (
            b["t"] - a["t"]
            for a, b in zip(lines, lines[1:], strict=False)
            if b["step"] == a["step"] + 1 and a["step"] % steps_per_round
        ),
        default=0.0,
    )


# 0.1 s steps: rounds of 4 s; each kill's phase made long enough to catch from outside by a slow link.
# The run goes on until the victim is back, healed and committing (a replica of 2 ranks restarts in 5 to
# 15 s on 2 busy cores), then stops: `_came_back_whole`
KILLED = [
    "train.rounds=10000",
    "sync.outer_every=40",
    "train.min_step_s=0.1",
    "topology.gpus_per_replica=2",
    "logging.step_times=true",
    "comm.timeout_s=5",
]
EVERYONE = ("c0r0", "c0r1", "c1r0", "c1r1")


def _in_phase(
    run_dir: Path, rid: str, phase: str, round_index: int, min_step: int = 0, incarnation: int = 0
) -> dict | None:
    """rid's progress once it runs `phase` of round `round_index` (its ranks known), else None."""
    answer = replica_progress(run_dir, rid)
    if (
        answer
        and answer["round"] == round_index
        and answer["phase"] == phase
        and answer["step"] >= min_step
        and answer["incarnation"] >= incarnation
        and len(answer.get("rank_pids", ())) == 2
    ):
        return answer
    return None


def _kill_rank_1(answer: dict) -> float:
    """SIGKILL rank 1 of the replica that gave `answer` (the OS, not the injector; not rank 0, the
    actor the roster knows); when."""
    os.kill(answer["rank_pids"][1], signal.SIGKILL)
    return time.time()


def _committed_again(run_dir: Path, rid: str, after: float) -> dict | None:
    """The first commit that names rid after its first heal_end since `after` (rid back, healed and
    committing again), else None."""
    evs = events(run_dir)
    healed = next((e["t"] for e in evs if e["event"] == "heal_end" and e["target"] == rid and e["t"] > after), None)
    if healed is None:
        return None
    return next((e for e in evs if e["event"] == "commit" and e["t"] > healed and rid in e["replicas"]), None)


def _stopped_once_back(drill, victims, killed_at: float) -> dict:
    """Wait until every victim is back, healed and committing again (however long that takes), then
    stop the run; its summary, checked by the shared invariant checker with only the victims harmed."""
    for rid in victims:
        poll(
            f"{rid} back, healed and committing",
            HANG_S,
            lambda rid=rid: _committed_again(drill.run_dir, rid, killed_at),
        )
    summary = drill.stop()
    steps = int(drill.cfg.sync.outer_every)
    check_run(
        drill.run_dir,
        rounds=summary["rounds_committed"],
        steps_per_round=steps,
        victims=set(victims),
        expect_status="stopped",
    )
    return summary


def _came_back_whole(drill, victim: str, killed_at: float, old_pid: int) -> None:
    """The shared invariants, with only `victim` harmed; it came back as a new process and was healed;
    every replica agrees at the end; every other replica trained on while the victim was down."""
    summary = _stopped_once_back(drill, [victim], killed_at)
    run_dir = drill.run_dir
    evs = events(run_dir)
    assert {e["rid"] for e in evs if e["event"] == "replica_down"} == {victim}, (
        f"only the replica of the killed rank goes down: {[e for e in evs if e['event'] == 'replica_down']}"
    )
    back = [e for e in evs if e["event"] == "replica_up" and e["rid"] == victim and e["t"] > killed_at]
    assert back and back[0]["pid"] != old_pid, f"{victim} came back as a new process: {back}"
    assert [e for e in evs if e["event"] == "heal_end" and e["target"] == victim and e["t"] > killed_at], (
        f"{victim}, back, was healed"
    )
    final = metrics(run_dir)[-1]
    assert len(set(final["replica_digests"].values())) == 1 and len(final["replica_digests"]) == 4, final
    assert summary["status"] == "stopped"
    others = [rid for rid in EVERYONE if rid != victim]
    waited = [rid for rid in others if not _steps_between(run_dir, rid, killed_at, back[0]["t"])]
    assert not waited, f"{waited} committed no step between {victim}'s kill and its return: they waited for it"
    print(
        json.dumps({"victim": victim, "stall_s": {rid: round(_stalls(run_dir, rid, killed_at), 3) for rid in others}})
    )


@pytest.mark.long
@pytest.mark.paced  # steps padded (train.min_step_s): beside the busy long runs (tests/run_all.sh)
@pytest.mark.timeout(600)
def test_a_rank_sigkilled_from_outside_mid_inner_fails_its_replica_whole_and_it_comes_back_healed(
    background_drills, tmp_path
):
    drill = background_drills(FAST + TWO_BY_TWO + KILLED, tmp_path)
    running = poll("round 1's inner steps on c0r1", 240, lambda: _in_phase(drill.run_dir, "c0r1", "inner", 1, 45))
    killed_at = _kill_rank_1(running)
    _came_back_whole(drill, "c0r1", killed_at, running["pid"])


@pytest.mark.long
@pytest.mark.paced  # steps padded (train.min_step_s): beside the busy long runs (tests/run_all.sh)
@pytest.mark.timeout(600)
def test_a_leaders_rank_sigkilled_from_outside_mid_outer_fails_that_replica_whole(background_drills, tmp_path):
    # the slow link between clusters: 1.5 s per outer collective, the window to kill c0's leader in
    drill = background_drills(
        FAST + TWO_BY_TWO + KILLED + ["links.outer.gbps=10", "links.outer.latency_ms=1500"], tmp_path
    )
    reducing = poll(
        "c0r0 in round 1's outer reduce", 240, lambda: _in_phase(drill.run_dir, "c0r0", "outer", 1), every_s=0.05
    )
    killed_at = _kill_rank_1(reducing)
    _came_back_whole(drill, "c0r0", killed_at, reducing["pid"])


@pytest.mark.long
@pytest.mark.paced  # steps padded (train.min_step_s): beside the busy long runs (tests/run_all.sh)
@pytest.mark.timeout(600)
def test_a_rank_sigkilled_from_outside_mid_heal_fails_the_healing_replica_again_and_it_is_healed(
    background_drills, tmp_path
):
    # the inner link's latency (1.5 s a collective) stretches the heal's several collectives into a window
    # a poll catches on busy cores; localsgd (one average a round) keeps it off the inner steps
    drill = background_drills(
        FAST
        + TWO_BY_TWO
        + KILLED
        + ["links.inner.gbps=10", "links.inner.latency_ms=1500", "sync.inner=localsgd", "sync.inner_every=40"],
        tmp_path,
    )
    running = poll("round 1's inner steps on c0r1", 240, lambda: _in_phase(drill.run_dir, "c0r1", "inner", 1, 42))
    _kill_rank_1(running)
    # (a fresh process holds round 0 until its heal loads the source's state)
    healing = poll(
        "c0r1, back, healing", 240, lambda: _in_phase(drill.run_dir, "c0r1", "heal", 0, incarnation=1), every_s=0.05
    )
    killed_at = _kill_rank_1(healing)
    _came_back_whole(drill, "c0r1", killed_at, healing["pid"])


@pytest.mark.realistic
@pytest.mark.timeout(900)
def test_realistic_ranks_of_two_replicas_in_two_clusters_sigkilled_at_once(background_drills, tmp_path):
    # 3 clusters x 2 replicas x 2 ranks (12 processes); rounds of 100 steps x 0.3 s = 30 s of inner work;
    # rank 1 of c0r1 and of c2r0 killed together from outside mid-inner: each replica fails whole, c1 untouched
    drill = background_drills(
        FAST
        + [
            "topology.clusters=3",
            "topology.replicas_per_cluster=2",
            "topology.gpus_per_replica=2",
            "topology.cpus_per_replica=0.5",
            "sync.outer_every=100",
            "train.rounds=1000",  # stopped once both victims are back, healed and committing
            "train.min_step_s=0.3",
            "checkpoint.every=0",
            "train.eval_batches=1",
            # 12 processes joining at once on 2 cores: connects get 10 s
            "comm.timeout_s=10",
            "logging.step_times=true",
        ],
        tmp_path,
    )
    victims = ("c0r1", "c2r0")
    running = {
        rid: poll(f"round 0's inner steps on {rid}", 300, lambda rid=rid: _in_phase(drill.run_dir, rid, "inner", 0, 20))
        for rid in victims
    }
    for answer in running.values():
        os.kill(answer["rank_pids"][1], signal.SIGKILL)
    killed_at = time.time()
    summary = _stopped_once_back(drill, victims, killed_at)
    evs = events(drill.run_dir)
    assert {e["rid"] for e in evs if e["event"] == "replica_down"} == set(victims)
    for rid in victims:
        assert [
            e
            for e in evs
            if e["event"] == "replica_up" and e["rid"] == rid and e["t"] > killed_at and e["pid"] != running[rid]["pid"]
        ], f"{rid} came back as a new process"
        assert [e for e in evs if e["event"] == "heal_end" and e["target"] == rid], f"{rid} was healed"
    assert not [e for e in evs if e["event"] == "cluster_reform" and e.get("cluster") == 1 and e["t"] > killed_at], (
        "c1 never re-forms for the other clusters' losses"
    )
    final = metrics(drill.run_dir)[-1]
    assert len(set(final["replica_digests"].values())) == 1 and len(final["replica_digests"]) == 6, final
    assert summary["status"] == "stopped"
    stalls = {
        rid: round(_stalls(drill.run_dir, rid, killed_at, steps_per_round=100), 3)
        for rid in ("c0r0", "c1r0", "c1r1", "c2r1")
    }
    print(json.dumps({"stall_s": stalls}))  # a figure: a victim's cluster mate waits out its rejoin's join
    # the cluster without a victim trains on while the victims are down (its stall, a figure: 0.4 to 5.4 s
    # measured here with 12 processes on 2 cores, in the note of issue 34)
    returned = min(e["t"] for e in evs if e["event"] == "replica_up" and e["rid"] in victims and e["t"] > killed_at)
    waited = [rid for rid in ("c1r0", "c1r1") if not _steps_between(drill.run_dir, rid, killed_at, returned)]
    assert not waited, f"{waited} committed no step while the victims were down: c1 waited for them"
