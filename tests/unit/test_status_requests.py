"""jobs.status and site requests (issue 45): a request goes only into a running hsgd run's folder
(finding 3: one line and exit 2 otherwise, nothing written), and the view lists every request with
what became of it, in the order asked (Build 5)."""

from __future__ import annotations

import json
import os
import time

import pytest

from hsgd.core.site_requests import (
    Decision,
    mark_abandoned,
    mark_done,
    mark_joined,
    pending,
    requests_dir,
    write_request,
)
from hsgd.record.runlock import LOCK_NAME
from jobs.status import collect_state, main
from tests.fakes.run_folders import hold_run_folder

ASKS = (["drain-site", "c1"], ["add-site", "replicas=2"])


@pytest.fixture
def live_run(tmp_path):
    """A run folder as a running driver keeps it: its lock held (and refreshed), run.json naming the run."""
    lock = hold_run_folder(tmp_path / "run", "hsgd-live1")
    yield tmp_path / "run"
    lock.release()


def _refused(capsys, run_dir, ask, *words):
    assert main([str(run_dir), *ask]) == 2, ask
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, f"{ask}: one line on stderr, got {captured.err!r}"
    for word in words:
        assert word in lines[0], f"{ask}: must say {word!r}: {lines[0]!r}"
    assert not requests_dir(run_dir).exists(), f"{ask}: a requests folder was written into {run_dir}"


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"notes.txt": "mine\n"},
        {"config.yaml": "lr: 0.1\n", "summary.json": "{}"},
        {"run.json": "{}"},
        {"run.json": '{"run_id": 7}'},
    ],
    ids=["empty", "a-file", "common-names", "run-json-without-id", "run-json-id-not-a-string"],
)
@pytest.mark.parametrize("ask", ASKS, ids=["drain", "add"])
def test_a_folder_that_is_no_hsgd_run_gets_no_request(tmp_path, capsys, files, ask):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = sorted(p.name for p in tmp_path.iterdir())
    _refused(capsys, tmp_path, ask, "not an hsgd run folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("ask", ASKS, ids=["drain", "add"])
def test_a_missing_folder_gets_no_request(tmp_path, capsys, ask):
    _refused(capsys, tmp_path / "nope", ask, "no run dir")
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("ask", ASKS, ids=["drain", "add"])
def test_an_ended_run_gets_no_request(tmp_path, capsys, ask):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "hsgd-done1"}))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    _refused(capsys, tmp_path, ask, "ended", "completed")


def test_a_run_that_wrote_its_summary_and_still_holds_its_lock_has_ended(live_run, capsys):
    (live_run / "summary.json").write_text(json.dumps({"status": "failed"}))  # written after the lock was taken
    _refused(capsys, live_run, ASKS[0], "ended", "failed")


def test_a_crashed_run_whose_lock_is_stale_gets_no_request(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "hsgd-gone1"}))
    stale = {"run_id": "hsgd-gone1", "host": "elsewhere", "pid": 1, "started_at": 0.0, "refreshed_at": 0.0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    _refused(capsys, tmp_path, ASKS[0], "not running")


@pytest.mark.parametrize("ask", ASKS, ids=["drain", "add"])
def test_a_live_run_gets_the_request_as_before(live_run, capsys, ask):
    assert main([str(live_run), *ask]) == 0
    [request] = pending(live_run)
    assert request.id in capsys.readouterr().out
    assert request.kind == ("drain" if ask[0] == "drain-site" else "add-site")


def test_a_resumed_run_gets_the_request_though_its_last_run_left_a_summary(live_run, capsys):
    old = live_run / "summary.json"
    old.write_text(json.dumps({"status": "failed"}))
    then = time.time() - 3600  # the summary of the run this one resumed, written before its lock was taken
    os.utime(old, (then, then))
    assert main([str(live_run), "drain-site", "c1"]) == 0
    assert len(pending(live_run)) == 1


# -- Build 5: the requests and their outcomes, in the order asked ------------------------------------------
def _history(run):
    """Six requests, written out of order: every outcome a request can have."""
    pend = write_request(run, "drain", "c0", now=1005.0)
    drain = write_request(run, "drain", "c1", now=1000.0)
    mark_done(run, drain, Decision("applied", "drain c1: 1 site(s) go on", 1), 5)
    joined = write_request(run, "add-site", replicas=2, label="rack-a", now=1002.0)
    mark_done(run, joined, Decision("applied", "add-site c2 (2 replica(s)): room on rack-a", 2), 6)
    mark_joined(run, joined.id, "c2", 8, run_id="hsgd-live1")
    bad = write_request(run, "drain", "c7", now=1001.0)
    mark_done(run, bad, Decision("refused", "drain c7: no such cluster; valid: c0..c2", None), 5)
    gone = write_request(run, "add-site", replicas=1, now=1003.0)
    mark_done(run, gone, Decision("applied", "add-site c3 (1 replica(s))", 3), 9)
    mark_abandoned(run, gone.id, "c3", 11, "its replicas died before they were up", run_id="hsgd-live1")
    starting = write_request(run, "add-site", replicas=3, name="berlin", now=1004.0)
    mark_done(run, starting, Decision("applied", "add-site c4 (3 replica(s))", 4), 12)
    return [drain, bad, joined, gone, starting, pend]


def test_the_state_lists_each_request_with_its_outcome_in_the_order_asked(live_run):
    asked = _history(live_run)
    listed = collect_state(live_run)["requests"]
    assert [r["id"] for r in listed] == [r.id for r in asked]
    assert [r["outcome"] for r in listed] == ["applied", "refused", "joined", "abandoned", "applied", "pending"]
    assert [r["round"] for r in listed] == [5, 5, 8, 11, 12, None]
    assert [r["cluster"] for r in listed] == ["c1", "c7", "c2", "c3", "c4", "c0"]
    assert listed[1]["reason"] == "drain c7: no such cluster; valid: c0..c2"
    assert listed[3]["reason"] == "its replicas died before they were up"
    lines = [r["line"] for r in listed]
    assert all("\n" not in line and r.id in line for line, r in zip(lines, asked, strict=True))
    assert "joined at round 8" in lines[2] and "replicas=2" in lines[2] and "label=rack-a" in lines[2]
    assert "abandoned at round 11" in lines[3] and "its replicas died" in lines[3]
    assert "refused at round 5" in lines[1] and "no such cluster" in lines[1]
    assert "pending" in lines[5]


def test_once_prints_one_line_per_request_in_the_order_asked(live_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    asked = _history(live_run)
    assert main([str(live_run), "--once"]) == 0
    out = capsys.readouterr().out
    assert "site requests" in out
    rows = [next(line for line in out.splitlines() if r.id in line) for r in asked]
    assert [out.index(row) for row in rows] == sorted(out.index(row) for row in rows)
    for row, word in zip(rows, ("applied", "refused", "joined", "abandoned", "applied", "pending"), strict=True):
        assert word in row, (word, row)


def test_a_malformed_request_file_is_listed_pending_with_its_problem(live_run):
    requests_dir(live_run).mkdir()
    (requests_dir(live_run) / "0000000001000-drain-c9-deadbeef.json").write_text("not json")
    [listed] = collect_state(live_run)["requests"]
    assert listed["outcome"] == "pending" and "unreadable request file" in listed["line"]


def test_a_run_without_requests_lists_none(live_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert collect_state(live_run).get("requests", []) == []
    assert main([str(live_run), "--once"]) == 0
    assert "site requests" not in capsys.readouterr().out
