"""The Ray Train v2 peer (benchmarks/peers/raytrain_peer.py) survives a SIGKILL the way Ray Train does:
the whole worker group restarts from the latest checkpoint, and the figures come from the logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray.train  # noqa: F401 — the bench extra is installed in CI: a missing Ray Train fails here, never skips

from benchmarks.peers import common
from benchmarks.peers.raytrain_peer import _kill_figures, _killer, run_raytrain

STEPS, EVERY, KILL_AT = 30, 5, 12


@pytest.mark.long  # a Ray Train worker group started twice: about a minute on 2 cores
@pytest.mark.paced  # steps padded to 0.2 s: run beside the realistic tests (tests/run_all.sh)
def test_raytrain_peer_restarts_the_group_from_its_checkpoint_after_a_kill(tmp_path):
    result = run_raytrain(
        model="tiny",
        replicas=2,
        steps=STEPS,
        min_step_s=0.2,
        out=tmp_path,
        kills=[("r1", KILL_AT)],
        checkpoint_every=EVERY,
        timeout_s=150,
    )
    assert result["result_error"] is None, result
    assert result["peer"] == "ray_train" and [k["replica"] for k in result["kills"]] == ["r1"], result
    steps = common.read_steps(tmp_path / "steps")
    assert sorted(steps) == ["r0", "r1"]
    for replica, rows in steps.items():
        assert max(r["step"] for r in rows) == STEPS, (replica, rows[-3:])
    kill = result["kills"][0]
    victim_after = [r for r in steps["r1"] if r["t"] > kill["t"]]
    assert victim_after and all(r["pid"] != kill["pid"] for r in victim_after), "the victim came back as a new process"
    assert result["group_starts"] == 2, "Ray Train restarted the worker group once"
    figures = result["recoveries"][0]
    assert figures["highest_step_before"] >= KILL_AT
    assert figures["resumed_at_step"] % EVERY == 0, "the group resumed from a reported checkpoint"
    # Ray Train registers a reported checkpoint at its controller's next poll of every worker, so
    # a kill loses the steps since the newest registered one: up to two checkpoint intervals
    assert 0 <= figures["steps_lost"] <= 2 * EVERY, figures
    assert set(figures["survivors_stall_s"]) == {"r0"} and figures["survivors_stall_s"]["r0"] > 0, figures
    assert figures["rejoin_s"] is not None and figures["back_at_failed_step_s"] is not None, figures
    assert result["step_time_s"] is not None and result["committed_steps"] == 2 * STEPS


def _row(replica: str, step: int, pid: int, t: float) -> str:
    return json.dumps({"replica": replica, "step": step, "t": t, "pid": pid}) + "\n"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_timed_kill_hits_the_group_started_after_the_previous_kill_not_a_dying_process(tmp_path):
    first_r0, first_r1, second_r0 = _sleeper(), _sleeper(), _sleeper()
    try:
        now = time.time()
        with open(tmp_path / "r0.jsonl", "w") as f:
            f.writelines(_row("r0", s, first_r0.pid, now) for s in (1, 2, 3))
        with open(tmp_path / "r1.jsonl", "w") as f:
            f.writelines(_row("r1", s, first_r1.pid, now) for s in (1, 2, 3))
        done, errors, stop = [], [], threading.Event()
        killer = threading.Thread(
            target=_killer, args=(tmp_path, [("r1", 3)], [(0.0, "r0")], time.monotonic() + 30, stop, done, errors)
        )
        killer.start()
        while not done and killer.is_alive():
            time.sleep(0.02)
        time.sleep(0.3)  # the timed kill is due: it must wait for r0's restarted process
        assert len(done) == 1 and first_r0.poll() is None, "r0's old process is the dying group's: not a target"
        with open(tmp_path / "r0.jsonl", "a") as f:
            f.write(_row("r0", 1, second_r0.pid, time.time()))
        killer.join(timeout=20)
        assert not errors and [(k.replica, k.pid) for k in done] == [("r1", first_r1.pid), ("r0", second_r0.pid)]
        assert first_r1.wait(timeout=10) == -signal.SIGKILL and second_r0.wait(timeout=10) == -signal.SIGKILL
        assert first_r0.poll() is None
    finally:
        for p in (first_r0, first_r1, second_r0):
            p.kill()
            p.wait(timeout=10)


def test_steps_lost_and_back_at_the_failed_step_are_read_against_the_resumed_checkpoint():
    pid_old, pid_new = 10, 20
    steps = {
        "r0": [{"step": s, "t": float(s), "pid": pid_old} for s in range(1, 13)]
        + [{"step": s, "t": 20.0 + s, "pid": pid_new + 1} for s in range(6, 16)],
        "r1": [{"step": s, "t": float(s), "pid": pid_old + 1} for s in range(1, 13)]
        + [{"step": s, "t": 20.0 + s, "pid": pid_new} for s in range(6, 16)],
    }
    starts = [
        {"rank": 0, "resumed_at": 0, "t": 0.5, "pid": pid_old},
        {"rank": 0, "resumed_at": 5, "t": 25.5, "pid": pid_new + 1},
        {"rank": 1, "resumed_at": 0, "t": 0.5, "pid": pid_old + 1},
        {"rank": 1, "resumed_at": 5, "t": 25.6, "pid": pid_new},
    ]
    figures = _kill_figures(steps, starts, common.Kill(replica="r1", pid=pid_old + 1, t=12.5))
    assert figures["highest_step_before"] == 12 and figures["resumed_at_step"] == 5 and figures["steps_lost"] == 7
    assert figures["back_at_failed_step_s"] == 33.0 - 12.5  # step 13, past the 12 committed before the kill
    assert figures["rejoin_s"] == 26.0 - 12.5 and figures["survivors_stall_s"] == {"r0": 26.0 - 12.0}
    assert figures["group_restarted_s"] == 25.5 - 12.5
