"""A failing or hung run folder never reaches the run loop: RunLog keeps events and metrics in
memory while the folder cannot be written and writes them, in order and once each, when it can;
FolderWriter bounds every wait for a write; append_lines writes whole lines or none.

The outage is made the way root cannot bypass (the tests run as root, for whom permissions do not
block writes): the run folder is moved away and a plain file put at its path, so every write under
it fails with NotADirectoryError, as on a folder that is gone; putting it back ends the outage."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from hsgd.core.deadlines import storage_problem
from hsgd.record.events import RunLog
from hsgd.record.rundir import FolderWriter, append_lines, call_with_deadline, read_jsonl


class Outage:
    """The run folder replaced by a file (see the module docstring), and put back."""

    def __init__(self, folder: Path):
        self.folder, self.away = folder, folder.with_name(folder.name + ".away")

    def __enter__(self):
        os.rename(self.folder, self.away)
        self.folder.write_text("not a folder")
        return self

    def __exit__(self, *exc):
        self.folder.unlink()
        os.rename(self.away, self.folder)


def _events(folder: Path) -> list[dict]:
    return read_jsonl(folder / "events.jsonl")


def test_events_and_metrics_wait_in_memory_during_an_outage_and_land_in_order_once(tmp_path):
    folder = tmp_path / "run"
    warnings = []
    log = RunLog(folder, warn=warnings.append, write_timeout_s=2.0)
    log.event("run_stopped", round=0)
    log.metrics({"round": 0})
    assert log.flush()
    with Outage(folder):
        for r in range(1, 6):
            log.event("run_stopped", round=r)  # never raises, never waits for the folder
            log.metrics({"round": r})
        log.flush()
        assert log.unwritable_s()[0] > 0 and "NotADirectoryError" in log.unwritable_s()[1]
        assert log.pending() >= 10, "the records of the outage are kept in memory"
        assert log.write_file("status.json", "{}") is False, "a whole-file write fails too, without raising"
    log.event("run_stopped", round=6)  # the first write after the outage carries everything kept
    assert log.flush(10.0), "everything kept is written once the folder works"
    events = _events(folder)
    rounds = [e["round"] for e in events if e["event"] == "run_stopped"]
    assert rounds == list(range(7)), f"every event once, in order: {rounds}"
    names = [e["event"] for e in events]
    assert names.count("run_dir_unwritable") == 1 and names.count("run_dir_writable") == 1, names
    assert names.index("run_dir_unwritable") < names.index("run_dir_writable")
    back = next(e for e in events if e["event"] == "run_dir_writable")
    assert back["buffered"] > 0 and back["down_s"] >= 0
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == list(range(6)), "metrics once, in order"
    assert log.unwritable_s() == (0.0, "")
    assert len(warnings) == 2 and "not writable" in warnings[0] and "writable again" in warnings[1], warnings


def test_records_read_the_file_and_what_waits_in_memory(tmp_path):
    folder = tmp_path / "run"
    log = RunLog(folder, write_timeout_s=2.0)
    log.metrics({"round": 0})
    assert log.flush()
    with Outage(folder):
        log.metrics({"round": 1})
        log.flush()
        assert [m["round"] for m in log.records("metrics")] == [1], "the file is gone: what is in memory"
    assert [m["round"] for m in log.records("metrics")] == [0, 1], "file first, then memory, nothing twice"
    log.flush(10.0)


def test_a_rewrite_during_an_outage_replaces_the_file_when_the_folder_is_back(tmp_path):
    folder = tmp_path / "run"
    log = RunLog(folder, write_timeout_s=2.0)
    for r in range(4):
        log.metrics({"round": r})
    assert log.flush()
    with Outage(folder):
        log.metrics({"round": 4})
        assert log.rewrite_metrics([{"round": 0}, {"round": 1}]) is False, "kept until the folder works"
        log.metrics({"round": 2})
    assert log.flush(10.0)
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == [0, 1, 2]


def test_a_hung_write_costs_a_caller_its_deadline_and_nothing_after(tmp_path):
    release = threading.Event()
    writer = FolderWriter(deadline_s=0.2)
    order = []
    assert writer.submit("hung", lambda: (release.wait(30), order.append("hung"))) is False, (
        "the caller is answered at its deadline while the write hangs"
    )
    # the deadline runs from when the thread began the write, which on a loaded machine may be a
    # little after the submit: wait for it (bounded), never read it at the caller's instant
    until = time.monotonic() + 5.0
    while writer.stuck_s() == 0 and time.monotonic() < until:
        time.sleep(0.01)
    assert writer.stuck_s() > 0
    assert "has not returned" in writer.health()[1] and writer.health()[0] > 0
    assert writer.submit("next", lambda: order.append("next")) is False, "no wait behind a stuck write"
    release.set()
    assert writer.submit(object(), lambda: None, deadline_s=10.0, counts=False), "the queue drains"
    assert order == ["hung", "next"], "queued writes run in order once the stuck one returns"
    assert writer.health() == (0.0, "")


def test_run_log_never_blocks_on_a_hung_folder(tmp_path):
    log = RunLog(tmp_path / "run", write_timeout_s=0.2)
    release = threading.Event()
    log.writer.submit("hung", lambda: release.wait(30), wait=False)
    for r in range(50):
        log.event("run_stopped", round=r)
    assert log.write_file("status.json", "{}") is False
    assert log.flush() is False and log.pending() == 50
    assert [e["round"] for e in log.records("events")] == list(range(50)), "in memory, readable meanwhile"
    release.set()
    assert log.flush(10.0)
    assert [e["round"] for e in _events(tmp_path / "run")] == list(range(50))


def test_queued_writes_of_one_file_keep_the_newest(tmp_path):
    release = threading.Event()
    writer = FolderWriter(deadline_s=5.0)
    writer.submit("hold", lambda: release.wait(30), wait=False)
    written = []
    for i in range(5):
        writer.submit("status", lambda i=i: written.append(i), wait=False)
    release.set()
    assert writer.submit(object(), lambda: None, deadline_s=10.0, counts=False), "the queue drains"
    assert written == [4], "a newer status replaces one still queued"


def test_a_write_that_fails_part_way_is_cut_back_and_retried_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"n": 0}) + "\n")
    size = path.stat().st_size
    line = json.dumps({"n": 1, "pad": "x" * 200}) + "\n"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 50, hard))  # Python ignores SIGXFSZ: EFBIG past the limit
    try:
        with pytest.raises(OSError):
            append_lines(path, line)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert path.stat().st_size == size, "the part written is cut back"
    append_lines(path, line)
    assert [r["n"] for r in read_jsonl(path)] == [0, 1]


def test_a_fragment_left_at_the_end_stays_a_line_of_its_own(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"n": 0}) + '\n{"n": 1, "trunc')
    append_lines(path, json.dumps({"n": 1}) + "\n")
    assert [r["n"] for r in read_jsonl(path)] == [0, 1], "the fragment is skipped, the record is whole"


def test_call_with_deadline_answers_a_hung_call_with_timeout_error():
    release = threading.Event()
    with pytest.raises(TimeoutError, match="did not return within"):
        call_with_deadline(lambda: release.wait(30), 0.2, "a hung call")
    release.set()
    with pytest.raises(NotADirectoryError):
        call_with_deadline(lambda: (_ for _ in ()).throw(NotADirectoryError("x")), 5.0)
    assert call_with_deadline(lambda: 7, 5.0) == 7
    assert issubclass(TimeoutError, OSError), "a storage timeout is handled as a storage error"


def test_only_an_outage_longer_than_the_grace_ends_the_run_and_its_reason_names_folder_grace_and_error():
    assert storage_problem(0.0, "", grace_s=60.0, run_dir="/runs/x") is None
    assert storage_problem(60.0, "No space left", grace_s=60.0, run_dir="/runs/x") is None, (
        "the grace itself is allowed"
    )
    reason = storage_problem(61.4, "No space left", grace_s=60.0, run_dir="/runs/x")
    assert reason == "run folder /runs/x unwritable for 61 s (run.io_grace_s=60): No space left", reason
    assert "io_grace_s=2.5" in storage_problem(3.0, "gone", grace_s=2.5, run_dir=Path("/runs/y"))
