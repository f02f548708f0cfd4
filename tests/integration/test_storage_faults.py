"""Storage faults are the run's problem, never a replica's (issue 19, Build 1 / Acceptance 1).

How each fault is made, honestly and as root (the tests run as root, for whom chmod blocks
nothing, and no mount is available):
- `checkpoints/` replaced by a plain file mid-run: every write under it fails (NotADirectoryError
  / FileExistsError), as on a folder gone with a remount.
- the run folder "read-only": moved away and a plain file put at its path, so every write of the
  supervisor (events, metrics, state, status, summary) fails with NotADirectoryError; moving it
  back ends the outage. Real OS errors, no hook in the code.
- one replica's checkpoint write failing: RLIMIT_FSIZE lowered on that replica's process (prlimit)
  below its checkpoint file's size, so its write fails with EFBIG "File too large" — a quota, as
  the kernel reports it (Python ignores SIGXFSZ; torch's zip writer turns it into a RuntimeError);
  its other files stay far below the limit.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import threading
import time
from pathlib import Path

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, summary, train

SMALL = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=1",
    "sync.outer_every=2",
    "supervisor.phase_timeout_s=60",
    "comm.timeout_s=5",
]


def _wait_for(run_dir: Path, predicate, timeout_s: float = 120.0) -> dict | None:
    """The first event of run_dir's events.jsonl that satisfies predicate (polled), or None."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            found = next((e for e in events(run_dir) if predicate(e)), None)
        except OSError:
            found = None
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def _in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _no_replica_killed(evs: list[dict]) -> None:
    bad = [e for e in evs if e["event"] in ("kill", "replica_down", "replica_error")]
    assert not bad, f"a storage fault cost a replica: {bad}"


def test_checkpoints_folder_replaced_by_a_file_skips_checkpoints_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    swapped = threading.Event()

    def swap():
        if _wait_for(run_dir, lambda e: e["event"] == "checkpoint") is not None:
            shutil.rmtree(run_dir / "checkpoints")
            (run_dir / "checkpoints").write_text("a file where the checkpoints were")
            swapped.set()

    thread = _in_background(swap)
    s = train(run_dir, SMALL + ["train.rounds=8", "checkpoint.every=1", "train.min_step_s=0.1"])
    thread.join(5)
    assert swapped.is_set(), "the first checkpoint never came"
    assert s["status"] == "completed", s.get("reason")
    assert s["rounds_committed"] == 8
    evs = events(run_dir)
    failed = [e for e in evs if e["event"] == "checkpoint_failed"]
    assert failed, "no checkpoint_failed event after the checkpoints folder became a file"
    assert all(("Not a directory" in e["error"] or "exists" in e["error"]) for e in failed), failed
    assert s["checkpoints_failed"] == len(failed) == summary(run_dir)["checkpoints_failed"]
    assert any(e["event"] == "checkpoint_failed" and e["round"] == 8 for e in evs), "the last round's too"
    _no_replica_killed(evs)
    assert [m["round"] for m in metrics(run_dir)] == list(range(8))
    check_run(run_dir, rounds=8, steps_per_round=2, victims=set())


def test_a_replica_whose_checkpoint_write_fails_kills_nobody(tmp_path):
    run_dir = tmp_path / "run"
    limited = {}

    def limit():
        up = _wait_for(run_dir, lambda e: e["event"] == "replica_up" and e["rid"] == "c1r0")
        if up is not None:
            # far above what the replica's logs reach in this run, far below its checkpoint file (~7 MB)
            resource.prlimit(up["pid"], resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
            limited["pid"] = up["pid"]

    thread = _in_background(limit)
    s = train(
        run_dir,
        SMALL + ["train.rounds=4", "checkpoint.every=2", "model.n_embd=128", "model.n_layer=2", "model.n_head=2"],
    )
    thread.join(5)
    assert limited, "the replica never came up"
    assert s["status"] == "completed", s.get("reason")
    assert s["rounds_committed"] == 4
    evs = events(run_dir)
    failed = [e for e in evs if e["event"] == "checkpoint_failed"]
    assert [e["round"] for e in failed] == [2, 4], failed
    # torch's zip writer reports the kernel's EFBIG as its own RuntimeError ("unexpected pos"):
    # whatever the write raised, it is that write's failure, answered as io_error
    assert all(e["replicas"] == ["c1r0"] and "c1r0 writing" in e["error"] for e in failed), failed
    assert s["checkpoints_failed"] == 2
    _no_replica_killed(evs)
    ups = [e for e in evs if e["event"] == "replica_up" and e["rid"] == "c1r0"]
    assert [e["pid"] for e in ups] == [limited["pid"]], "the replica was restarted"
    check_run(run_dir, rounds=4, steps_per_round=2, victims=set())


class FolderAway:
    """The run folder moved away and a plain file put at its path (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.away = run_dir, run_dir.with_name(run_dir.name + ".away")
        self.gone = threading.Event()

    def take(self) -> None:
        os.rename(self.run_dir, self.away)
        self.run_dir.write_text("the run folder is gone")
        self.gone.set()

    def give_back(self) -> None:
        if self.gone.is_set():
            self.run_dir.unlink()
            os.rename(self.away, self.run_dir)
            self.gone.clear()


def test_a_run_folder_unwritable_past_the_grace_fails_the_run_with_the_summary_on_the_console(tmp_path, capfd):
    run_dir = tmp_path / "run"
    outage = FolderAway(run_dir)

    def take_after_first_commit():
        if _wait_for(run_dir, lambda e: e["event"] == "commit") is not None:
            outage.take()

    thread = _in_background(take_after_first_commit)
    try:
        s = train(
            run_dir, SMALL + ["train.rounds=200", "checkpoint.every=0", "train.min_step_s=0.05", "run.io_grace_s=3"]
        )
        thread.join(5)
        assert outage.gone.is_set(), "the outage never began"
        out = capfd.readouterr().out
    finally:
        outage.give_back()
    assert s["status"] == "failed"
    assert str(run_dir) in s["reason"] and "unwritable" in s["reason"] and "io_grace_s=3" in s["reason"], s["reason"]
    assert "NotADirectoryError" in s["reason"], s["reason"]
    assert s["rounds_committed"] < 200
    printed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert printed, f"no summary JSON line on the console:\n{out[-3000:]}"
    assert printed[-1]["status"] == "failed" and printed[-1]["reason"] == s["reason"]
    assert "summary.json could not be written" in out
    assert not (run_dir / "summary.json").exists(), "written after the folder came back?"
    # what the folder holds is sound: the rounds recorded before it went (the later ones' records went with it)
    recorded = len(metrics(run_dir))
    assert 1 <= recorded <= s["rounds_committed"], (recorded, s["rounds_committed"])
    check_run(
        run_dir,
        rounds=s["rounds_committed"],
        steps_per_round=2,
        victims=set(),
        expect_status="failed",
        summary=printed[-1],
        recorded=recorded,
    )


def test_a_short_outage_of_the_run_folder_is_survived_and_every_record_written_once(tmp_path):
    run_dir = tmp_path / "run"
    outage = FolderAway(run_dir)
    rounds = 12

    def short_outage():
        if _wait_for(run_dir, lambda e: e["event"] == "commit") is not None:
            outage.take()
            time.sleep(2.0)  # several rounds' worth of events and metrics fail meanwhile
            outage.give_back()

    thread = _in_background(short_outage)
    try:
        s = train(
            run_dir,
            SMALL + [f"train.rounds={rounds}", "checkpoint.every=0", "train.min_step_s=0.05", "run.io_grace_s=30"],
        )
        thread.join(10)
    finally:
        outage.give_back()
    assert s["status"] == "completed", s.get("reason")
    assert summary(run_dir)["status"] == "completed"
    evs = events(run_dir)
    names = [e["event"] for e in evs]
    assert "run_dir_unwritable" in names and "run_dir_writable" in names, "the outage went unnoticed"
    back = next(e for e in evs if e["event"] == "run_dir_writable")
    assert back["buffered"] > 0
    assert [e["round"] for e in evs if e["event"] == "commit"] == list(range(rounds)), "a commit lost or twice"
    assert [m["round"] for m in metrics(run_dir)] == list(range(rounds)), "a round's metrics lost or twice"
    keys = [(e["t"], e["event"], e.get("round"), e.get("phase"), e.get("cluster")) for e in evs]
    assert len(keys) == len(set(keys)), "an event written twice"
    assert names[-1] == "run_end"
    check_run(run_dir, rounds=rounds, steps_per_round=2, victims=set())
