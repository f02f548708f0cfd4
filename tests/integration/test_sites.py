"""Sites of different sizes, end to end (issue 32): three sites of 3, 2 and 1 replicas train through
an injected kill in every site and processes SIGKILLed from outside; every replica reads the data
stream its id was given when first created (the index table), through restarts and a resume. Every
run goes through the shared invariant checker, which checks the table too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from hsgd.core.topology import Topology
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, inner_running, poll, replica_progress, train

SITES = "topology.sites=[{replicas:3,name:eu-1},{replicas:2,name:us-2},{replicas:1,name:ap-3}]"
TABLE = dict(Topology.of_sites((3, 2, 1)).index_table)  # c0r0..c0r2 = 0..2, c1r0, c1r1 = 3, 4, c2r0 = 5


def _table_held(run_dir: Path) -> None:
    state = json.loads((Path(run_dir) / "supervisor_state.json").read_text())
    assert state["replica_indices"] == TABLE, f"the run's index table: {state['replica_indices']}"
    for e in events(run_dir):
        if e["event"] == "replica_up":
            assert e["replica_index"] == TABLE[e["rid"]], f"{e['rid']} read another replica's stream: {e}"


SPR = 10
SHORT = [
    SITES,
    f"sync.outer_every={SPR}",
    "train.min_step_s=0.2",
    "train.eval_batches=1",
    "comm.timeout_s=4",
    "comm.configure_timeout_s=10",
    "checkpoint.every=1",
    "checkpoint.keep=10",
]
KILL_IN_EVERY_SITE = (
    "faults.schedule=[{kind:kill,target:c0r1,round:1,phase:inner,step:3},"
    "{kind:kill,target:c1r0,round:2,phase:inner,step:3},"
    "{kind:kill,target:c2r0,round:3,phase:inner,step:3}]"
)


@pytest.mark.long  # moved out of the default suite (its 20 minutes): a run waited on for its event
@pytest.mark.paced  # steps padded (train.min_step_s): beside the busy long runs (tests/run_all.sh)
def test_sites_of_3_2_1_train_through_a_kill_in_every_site_and_an_outside_sigkill_then_resume(
    background_drills, tmp_path
):
    drill = background_drills(FAST + SHORT + ["train.rounds=5", KILL_IN_EVERY_SITE], tmp_path)
    run_dir = Path(drill.run_dir)
    running = poll("round 0's inner steps on c0r2", 180, lambda: inner_running(run_dir, ["c0r2"], 0, 3))
    os.kill(running["c0r2"]["pid"], signal.SIGKILL)  # the OS, not the injector
    s = drill.wait_done(600)
    check_run(run_dir, rounds=5, steps_per_round=SPR, victims={"c0r1", "c1r0", "c2r0", "c0r2"})
    assert s["topology"]["sizes"] == [3, 2, 1] and [x["name"] for x in s["topology"]["sites"]] == [
        "eu-1",
        "us-2",
        "ap-3",
    ]
    observed = [f["rid"] for f in s["faults"] if f["source"] == "observed"]
    assert observed == ["c0r2"], f"the outside SIGKILL must be reported as observed: {s['faults']}"
    assert sorted(f["rid"] for f in s["faults"] if f["source"] == "injected") == ["c0r1", "c1r0", "c2r0"]
    _table_held(run_dir)
    manifest = json.loads(sorted((run_dir / "checkpoints").glob("round_*/manifest.json"))[-1].read_text())
    assert manifest["replica_indices"] == TABLE and manifest["sites"] == [3, 2, 1]
    # a resume with the same sites, from a copy of round 3's checkpoint: the same table, the same streams
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "round_000003", resumed_dir / "checkpoints" / "round_000003")
    r = train(resumed_dir, SHORT + ["train.rounds=5", "train.resume=true"])
    assert r["status"] == "completed" and r["rounds_committed"] == 5, r.get("reason")
    _table_held(resumed_dir)
    check_run(resumed_dir, rounds=5, steps_per_round=SPR, victims=set())


# -- the regime users run --------------------------------------------------------------------------
REALISTIC_SPR = 100
REALISTIC = [
    SITES,
    f"sync.outer_every={REALISTIC_SPR}",
    "train.min_step_s=0.3",
    "checkpoint.every=0",
    "train.eval_batches=1",
    "comm.timeout_s=5",
]


@pytest.mark.realistic
def test_realistic_sites_survive_outside_sigkills_of_several_replicas_and_of_a_whole_site(background_drills, tmp_path):
    """Rounds of 30 s of inner work; in round 0 c0r0 and c0r2 are SIGKILLed from outside at once, in
    round 1 the whole 2-replica site (c1r0, c1r1): completes, the invariants hold, every killed
    replica is back (replica_up) within 2 rounds; wait_done(600) ends a hung run."""
    drill = background_drills(FAST + REALISTIC + ["train.rounds=4"], tmp_path)
    run_dir = Path(drill.run_dir)
    kills: dict[str, tuple[int, float]] = {}
    for round_index, victims in ((0, ("c0r0", "c0r2")), (1, ("c1r0", "c1r1"))):
        running = poll(
            f"round {round_index}'s inner steps on {victims}",
            300,
            lambda: inner_running(run_dir, victims, round_index, 20),  # noqa: B023 — called within the iteration
        )
        for rid in victims:
            os.kill(running[rid]["pid"], signal.SIGKILL)  # the OS, not the injector
            kills[rid] = (round_index, time.time())
    s = drill.wait_done(600)
    check_run(run_dir, rounds=4, steps_per_round=REALISTIC_SPR, victims=set(kills))
    _table_held(run_dir)
    evs = events(run_dir)
    for rid, (round_index, t_kill) in kills.items():
        back = next((e for e in evs if e["event"] == "commit" and e["t"] > t_kill and rid in e["replicas"]), None)
        assert back is not None, f"{rid} never took part in a commit again after its SIGKILL in round {round_index}"
        assert back["round"] <= round_index + 2, f"{rid} killed in round {round_index} was back only for {back}"
    assert sorted(f["rid"] for f in s["faults"] if f["source"] == "observed") == sorted(kills), s["faults"]


# -- quarantine ---------------------------------------------------------------------------------------
QUARANTINE = [
    "sync.outer_every=10",
    "train.min_step_s=0.3",
    "train.rounds=20",
    "train.eval_batches=1",
    "comm.timeout_s=4",
    "comm.configure_timeout_s=10",
    "checkpoint.every=0",
    "supervisor.rejoin=fast",
    "faults.quarantine_after=3",
    "faults.quarantine_window_s=600",
]


def sigkill_three_times(progress, rid: str) -> list[int]:
    """SIGKILL rid's process from outside three times, each time once a new process of it works in a
    phase (a flaky node: no injected fault explains these deaths). Returns the pids killed."""
    killed: list[int] = []
    for n in range(3):

        def working():
            p = progress(rid)
            return p if p and p.get("pid") and p["pid"] not in killed and p.get("phase") not in (None, "idle") else None

        pid = poll(f"{rid}'s process #{n + 1} at work", 300, working)["pid"]
        os.kill(pid, signal.SIGKILL)  # the OS, not the injector
        killed.append(pid)
    return killed


@pytest.mark.long  # three SIGKILLs each awaited at work: over a minute
@pytest.mark.paced  # steps padded to 0.3 s: beside the busy long runs (tests/run_all.sh)
def test_a_replica_that_keeps_dying_on_the_only_node_is_kept_out_and_the_run_completes(background_drills, tmp_path):
    drill = background_drills(FAST + QUARANTINE, tmp_path)
    run_dir = Path(drill.run_dir)
    sigkill_three_times(lambda rid: replica_progress(run_dir, rid), "c0r1")
    s = drill.wait_done(600)
    assert s["status"] == "completed" and s["replicas_quarantined"] == 1, s
    check_run(run_dir, rounds=20, steps_per_round=10, victims={"c0r1"})
    evs = events(run_dir)
    quarantined = [e for e in evs if e["event"] == "replica_quarantined"]
    assert len(quarantined) == 1 and quarantined[0]["rid"] == "c0r1" and quarantined[0]["moved_to"] is None, quarantined
    assert quarantined[0]["deaths"] == 3
    later = [e for e in evs if e["event"] == "commit" and e["t"] > quarantined[0]["t"]]
    assert later and all("c0r1" not in e["replicas"] for e in later), "a replica kept out never trains again"
    assert all("c0r0" in e["replicas"] for e in later), "its cluster goes on smaller"


def test_deaths_an_injected_fault_explains_never_quarantine(tmp_path):
    """Three injected kills of one replica (a drill) test recovery, not the node: it comes back each time."""
    kills = ",".join(f"{{kind:kill,target:c0r1,round:{r},phase:inner,step:3}}" for r in (0, 2, 4))
    s = train(
        tmp_path / "run",
        [*QUARANTINE[:-1], "faults.quarantine_window_s=600", "train.rounds=6", f"faults.schedule=[{kills}]"],
    )
    assert s["status"] == "completed" and s["replicas_quarantined"] == 0, s
    assert not [e for e in events(tmp_path / "run") if e["event"] == "replica_quarantined"]
    check_run(tmp_path / "run", rounds=6, steps_per_round=10, victims={"c0r1"})
