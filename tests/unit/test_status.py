"""jobs.status: the state the console view is drawn from, and the command itself (no Ray)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jobs.status import collect_state, main
from tests.fakes.deadlines import HANG_S
from tests.fakes.runs import T0, make_run

REPO = Path(__file__).resolve().parents[2]


def _members(state):
    return {c: {r["rid"]: (r["state"], r["leader"]) for r in reps} for c, reps in state["clusters"].items()}


def test_collect_state_finished_run(tmp_path):
    state = collect_state(make_run(tmp_path / "run"))
    assert state["done"] and state["status"] == "completed"
    assert _members(state) == {
        "c0": {"c0r0": ("live", True), "c0r1": ("live", False)},
        "c1": {"c1r0": ("live", True), "c1r1": ("live", False)},
    }
    assert state["epoch"] == 3 and state["round"] == 11 and state["phase"] == "outer_commit"
    assert state["last_loss"] == 4.0 - 0.1 * 11 and state["last_eval_loss"] == 4.05 - 0.1 * 11
    assert state["inner_step"] == 48 and state["tokens_per_s"] == 1000.0
    assert len(state["recent"]) == 8 and "run_end" in state["recent"][-1]
    assert not any("phase_begin" in line or "phase_end" in line for line in state["recent"])


def test_collect_state_while_a_replica_is_down(tmp_path):
    run = make_run(tmp_path / "run", status=None, rounds=7)
    state = collect_state(run)
    assert not state["done"] and state["status"] is None
    assert _members(state)["c0"] == {"c0r0": ("live", True), "c0r1": ("down", False)}
    assert state["epoch"] == 2


def test_status_json_overrides_events(tmp_path):
    run = make_run(tmp_path / "run", status=None, rounds=7)
    (run / "status.json").write_text(
        json.dumps(
            {
                "phase": "heal",
                "round": 7,
                "epoch": 5,
                "members": {"c0": ["c0r0"], "c1": ["c1r0", "c1r1"]},
                "leaders": {"c0": "c0r0", "c1": "c1r1"},
                "last_loss": 1.5,
                "last_eval_loss": None,
                "tokens_per_s": 7.0,
                "inner_step": 28,
                "updated": T0 + 7,
            }
        )
    )
    state = collect_state(run)
    assert (state["phase"], state["round"], state["epoch"], state["last_loss"]) == ("heal", 7, 5, 1.5)
    assert state["last_eval_loss"] == 4.05 - 0.1 * 5, "a null in status.json keeps the value from metrics"
    assert _members(state)["c1"] == {"c1r0": ("live", False), "c1r1": ("live", True)}
    assert not state["done"]
    (run / "status.json").write_text(json.dumps({"phase": "done", "status": "failed"}))
    state = collect_state(run)
    assert state["done"] and state["status"] == "failed"


def test_collect_state_empty_run_dir(tmp_path):
    state = collect_state(tmp_path)
    assert state["clusters"] == {} and state["recent"] == [] and not state["done"]


def test_once_prints_members_and_exits_0(tmp_path):
    run = make_run(tmp_path / "run", status=None, rounds=7)
    out = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(run), "--once"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert out.returncode == 0, out.stderr
    for rid in ("c0r0*", "c0r1", "c1r0*", "c1r1", "down", "replica_down"):
        assert rid in out.stdout, (rid, out.stdout)


def test_missing_run_dir_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no run dir" in capsys.readouterr().err
    out = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_live_view_stops_on_timeout_and_when_done(tmp_path):
    run = make_run(tmp_path / "run", status=None, rounds=7)
    start = time.monotonic()
    assert main([str(run), "--interval", "0.05", "--timeout", "0.3"]) == 0
    assert time.monotonic() - start < HANG_S  # it stops on its timeout, never hangs
    make_run(tmp_path / "done")
    assert main([str(tmp_path / "done"), "--interval", "0.05"]) == 0  # done at once: no timeout needed


def test_a_drained_sites_replicas_show_drained(tmp_path):
    run = make_run(tmp_path / "run")
    with open(run / "events.jsonl", "a") as fh:
        for cluster, outcome in (("c1", "applied"), ("c0", "refused")):
            fh.write(
                json.dumps(
                    {
                        "t": T0 + 100,
                        "event": "site_request",
                        "id": f"x-{cluster}",
                        "kind": "drain",
                        "cluster": cluster,
                        "outcome": outcome,
                        "reason": "r",
                        "round": 5,
                    }
                )
                + "\n"
            )
    members = _members(collect_state(run))
    assert members["c1"] == {"c1r0": ("drained", True), "c1r1": ("drained", False)}
    assert members["c0"] == {"c0r0": ("live", True), "c0r1": ("live", False)}
