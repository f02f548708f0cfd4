"""Every death seen once, and spares keep who they became (issue 21, Acceptance 2 and 3): deaths no
call ever sees — a process SIGKILLed while Ray restarts it, a promoted spare's process killed from
outside — are read from Ray's own restart count (actors/lifecycle.py). Every run goes through the
shared invariant checker; the tests add what is particular to their failure."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import ray

from tests.fakes.deadlines import HANG_S
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events
from tests.integration.runs import poll as poll_every

SPR = 10
# 10 steps x 0.2 s of simulated accelerator time: rounds of ~2 s. A run goes on until what a test
# waits for happened (a restart, a spare taken back: 2-4 s alone, more on busy cores), then stops
ROUNDS = "train.rounds=10000"
BASE = [
    f"sync.outer_every={SPR}",
    "train.min_step_s=0.2",
    "checkpoint.every=0",
    "train.eval_batches=1",
    "comm.timeout_s=4",
    "comm.configure_timeout_s=10",
    "supervisor.rejoin=fast",
]


def _poll(what: str, timeout_s: float, probe):
    """Often: a restart here lasts 2-4 s and the tests catch the actor between its processes."""
    return poll_every(what, timeout_s, probe, every_s=0.02)


@pytest.fixture
def drill_run(background_drills, tmp_path):
    """A run started in the background; stopped at teardown if a test left it running."""
    return lambda overrides: background_drills(FAST + BASE + overrides, tmp_path)


def _info(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _row(actor_name: str) -> dict | None:
    """The actor's row in Ray's actor table (State, NumRestarts, Pid), as the supervisor reads it."""
    from ray._private.state import state as gcs

    return next((r for r in gcs.actor_table(None).values() if r["Name"] == actor_name), None)


def _event(run_dir: Path, name: str, **fields) -> dict | None:
    return next(
        (e for e in events(run_dir) if e["event"] == name and all(e.get(k) == v for k, v in fields.items())), None
    )


def _stopped(drill) -> dict:
    """Stop the run; its summary, checked by the shared invariant checker with only c0r1 harmed."""
    s = drill.stop()
    check_run(
        drill.run_dir, rounds=s["rounds_committed"], steps_per_round=SPR, victims={"c0r1"}, expect_status="stopped"
    )
    return s


def test_a_replica_killed_again_while_ray_restarts_it_is_two_faults(drill_run):
    drill = drill_run([ROUNDS, "faults.schedule=[{kind:kill,target:c0r1,round:1,phase:inner,step:2}]"])
    actor = f"hsgd:{_info(drill.run_dir)['run_id']}:c0r1"
    first = _poll("c0r1's actor alive", 60, lambda: (r := _row(actor)) and r["State"] == "ALIVE" and r)
    # the injector's kill: Ray restarts the actor in a new process; SIGKILL that one while its
    # constructor still runs (no call reaches it there: only the restart count shows this death)
    again = _poll(
        "c0r1's actor restarting in a new process after the injector's kill",
        120,
        lambda: (
            (r := _row(actor))
            and r["State"] == "RESTARTING"
            and r["NumRestarts"] == 1
            and r["Pid"] not in (0, first["Pid"])
            and r
        ),
    )
    os.kill(again["Pid"], signal.SIGKILL)  # the OS, not the injector
    _poll(
        "c0r1 up as its actor's third process",
        HANG_S,
        lambda: _event(drill.run_dir, "replica_up", rid="c0r1", incarnation=2),
    )
    s = _stopped(drill)
    evs = events(drill.run_dir)
    downs = [e for e in evs if e["event"] == "replica_down" and e["rid"] == "c0r1"]
    assert [e["incarnation"] for e in downs] == [0, 1], (
        f"each of c0r1's two deaths is one replica_down, with the incarnation that died: {downs}"
    )
    assert downs[1]["phase"] == "restarting", downs[1]
    faults = [f for f in s["faults"] if f["rid"] == "c0r1"]
    assert sorted(f["source"] for f in faults) == ["injected", "observed"], (
        f"two faults for c0r1 in summary.json (the injector's kill and the SIGKILL): {s['faults']}"
    )
    assert len(s["faults"]) == 2, s["faults"]
    up = [e for e in evs if e["event"] == "replica_up" and e["rid"] == "c0r1" and e["t"] > downs[1]["t"]]
    assert up and up[0]["incarnation"] == 2, f"c0r1 came back as its actor's third process: {up}"


def test_a_promoted_spare_that_dies_comes_back_as_the_replica_it_replaced(drill_run):
    drill = drill_run([ROUNDS, "topology.spares_per_cluster=1"])
    _poll("c0's spare warm", 120, lambda: _event(drill.run_dir, "spare_ready", cluster=0))
    drill.inject("kill", "c0r1")  # now, from outside: the spare takes c0r1's id
    promoted = _poll("a spare promoted to c0r1", 60, lambda: _event(drill.run_dir, "spare_promoted", rid="c0r1"))
    spare = promoted["spare"]
    _poll("the spare healed as c0r1", 60, lambda: _event(drill.run_dir, "heal_end", target="c0r1"))
    assert _row(spare)["Pid"] == promoted["pid"] and _row(spare)["NumRestarts"] == 0
    handle = ray.get_actor(spare, namespace=_info(drill.run_dir)["namespace"])

    def serving():
        try:
            return ray.get(handle.progress.remote(), timeout=5)
        except Exception:  # noqa: BLE001 — restarting: ask again
            return None

    assert serving()["rid"] == "c0r1"
    os.kill(promoted["pid"], signal.SIGKILL)  # the promoted spare's process, from outside
    back = _poll(
        "the spare's actor back in a new process", 60, lambda: (a := serving()) and a["pid"] != promoted["pid"] and a
    )
    assert back["incarnation"] == 1, back
    _poll(
        "the spare's new process taken back, as c0r1 or as the spare",
        HANG_S,
        lambda: [
            e
            for e in events(drill.run_dir)
            if e["event"] in ("replica_up", "spare_ready") and e.get("pid") == back["pid"]
        ],
    )
    s = _stopped(drill)
    evs = events(drill.run_dir)
    # the supervisor takes it back as c0r1 — unless c0r1's own old actor, restarted as a spare
    # meanwhile, was ready first and took c0r1's id (a ready spare is promoted at once): then
    # this process, no longer serving c0r1, becomes the cluster's spare. Never both, never neither.
    up = [e for e in evs if e["event"] == "replica_up" and e["rid"] == "c0r1" and e["pid"] == back["pid"]]
    repromoted = [e for e in evs if e["event"] == "spare_promoted" and e["rid"] == "c0r1"][1:]
    spared = [e for e in evs if e["event"] == "spare_ready" and e["spare"] == spare and e["pid"] == back["pid"]]
    if repromoted:
        assert spared and not up, (
            f"c0r1 went to {repromoted[0]['spare']}; this process must become the spare: {spared}, {up}"
        )
    else:
        assert up and up[0]["incarnation"] == 1 and not spared, (
            f"c0r1 rejoined as the spare's actor's new process: {up}"
        )
        # it is c0r1 again — that replica's id and data stream — not the spare it was constructed as
        assert back["rid"] == "c0r1" and back["spare"] is False, back
        assert back["replica_index"] == 1, f"c0r1's data stream is replica index 1: {back}"
    downs = [e for e in evs if e["event"] == "replica_down" and e["rid"] == "c0r1"]
    assert len(downs) == 2, f"two deaths of c0r1 (its own actor, then the spare serving it): {downs}"
    assert sorted(f["source"] for f in s["faults"] if f["rid"] == "c0r1") == ["injected", "observed"], s["faults"]
    assert not [e for e in evs if e["event"] == "spare_lost"], "the promoted spare died as c0r1, not as a spare"
