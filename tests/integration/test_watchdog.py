"""Hang watchdog (issue 6): stalls become diagnosed, recovered failures within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, REPO, events, train

SPR = 6
BASE = [
    f"sync.outer_every={SPR}",
    "train.rounds=5",
    "checkpoint.every=0",
    "comm.timeout_s=4",
    "watchdog.floor_s=5",
    "watchdog.multiple=4",
]


def hangs(run_dir):
    return [e for e in events(run_dir) if e["event"] == "hang_detected"]


def test_gil_hang_in_inner_and_collective_stall_in_outer_are_caught(tmp_path):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        BASE
        + [
            "faults.schedule=[{kind:hang,target:c0r1,round:2,phase:inner,step:2,seconds:300},"
            "{kind:hang,target:leader:c1,round:3,phase:outer,seconds:300}]"
        ],
    )
    assert s["status"] == "completed" and s["rounds_committed"] == 5
    check_run(run_dir, rounds=5, steps_per_round=SPR, victims={"c0r1", "c1r0"})  # c1r0 leads c1
    found = hangs(run_dir)
    assert [h["rid"] for h in found] == ["c0r1", "c1r0"], found
    fired = [json.loads(line) for line in (run_dir / "faults_fired.jsonl").read_text().splitlines()]
    for hang, fault in zip(found, fired, strict=False):
        assert hang["t"] - fault["t"] < hang["deadline_s"] + 5, "hang not caught within its deadline + 5 s"
        assert hang["stuck_in"] and "_fire" in hang["stuck_in"], hang
        report = Path(hang["report"]).read_text()
        assert f"HANG: replica {hang['rid']}" in report and "stuck in:" in report
        assert "=== stacks of c0r0 ===" in report
    assert found[0]["waiting"] == ["c0r0"], "the inner peer of c0r1 was waiting on it"
    assert "c0r0" in found[1]["waiting"], "the other leader was waiting in the outer all-reduce"


def test_slow_but_healthy_replica_is_not_killed(tmp_path):
    run_dir = tmp_path / "run"
    slow = ",".join(f"{{kind:slow,target:c0r1,round:{r},phase:inner,step:0,seconds:0.03}}" for r in range(1, 6))
    s = train(
        run_dir,
        [
            "sync.outer_every=20",
            "train.rounds=6",
            "checkpoint.every=0",
            "watchdog.floor_s=1",
            "watchdog.multiple=4",
            f"faults.schedule=[{slow}]",
        ],
    )
    assert s["status"] == "completed"
    check_run(run_dir, rounds=6, steps_per_round=20, victims=set())  # slow is not harmed
    assert hangs(run_dir) == [], "a replica twice as slow is healthy, not hung"
    assert not any(e["event"] == "replica_down" for e in events(run_dir))
    inner = [e["seconds"] for e in events(run_dir) if e["event"] == "phase_end" and e["phase"] == "inner"]
    assert max(inner[1:]) > 1.5 * min(inner[1:]) or max(inner) > 0.6, f"the slow fault did not slow the run: {inner}"


@pytest.mark.long  # a job in its own process, then diagnose attaching to its Ray: over a minute on 2 cores
def test_diagnose_prints_one_stack_section_per_replica(tmp_path):
    run_dir = tmp_path / "run"
    # a user's two terminals: no RAY_AUTH_MODE inherited from this process's Ray (token auth stays on,
    # Ray's default for a new local cluster; diagnose must attach with it)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    # padded steps (min_step_s): the replicas sleep most of each step, so the diagnose process is not
    # starved of the 2 cores by 4 replicas training flat out (it took 45-115 s that way)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.train",
            *FAST,
            f"run.dir={run_dir}",
            "train.rounds=500",
            "sync.outer_every=20",
            "train.min_step_s=0.1",
            "checkpoint.every=0",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            status = run_dir / "status.json"
            if status.exists() and json.loads(status.read_text()).get("phase") in ("inner", "outer", "outer_commit"):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the job never reached its inner phase")
        out = subprocess.run(
            [sys.executable, "-m", "jobs.diagnose", str(run_dir)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        sections = [line for line in out.stdout.splitlines() if line.startswith("=== c")]
        assert [s.split()[1] for s in sections] == ["c0r0", "c0r1", "c1r0", "c1r1"], out.stdout[-3000:]
        assert "supervisor view" in out.stdout and "Thread" in out.stdout
    finally:
        job.send_signal(signal.SIGINT)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout=30)
