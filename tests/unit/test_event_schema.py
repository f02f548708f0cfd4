"""The typed event schema (hsgd/record/events.py EVENTS): every event the code logs is declared
with the fields it always carries, RunLog refuses anything else, and the manual's events page
(docs/reference/events.md, the public contract) names every event."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hsgd.record.events import EVENTS, EventSchemaError, RunLog

REPO = Path(__file__).resolve().parents[2]


def _event_calls():
    """(where, event name, keyword names, has **splat) of every `<x>.event(...)` call in the code."""
    for folder in ("actors", "hsgd", "jobs"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "event"
                    and node.args
                ):
                    continue
                first = node.args[0]
                branches = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                for branch in branches:
                    assert isinstance(branch, ast.Constant) and isinstance(branch.value, str), (
                        f"{where}: an event's name must be a literal, so it can be checked against the schema"
                    )
                    keywords = {k.arg for k in node.keywords if k.arg is not None}
                    yield where, branch.value, keywords, any(k.arg is None for k in node.keywords)


def test_every_call_site_logs_a_declared_event_with_its_fields():
    calls = list(_event_calls())
    assert len(calls) > 30, "the scan found the call sites"
    for where, name, keywords, _splat in calls:
        assert name in EVENTS, f"{where}: event {name!r} is not declared in hsgd/record/events.py EVENTS"
        missing = set(EVENTS[name]) - keywords
        assert not missing, f"{where}: event {name!r} lacks {sorted(missing)}"
    unused = set(EVENTS) - {name for _, name, _, _ in calls}
    assert not unused, f"declared but never logged: {sorted(unused)}"


def test_run_log_refuses_an_unknown_event_or_a_missing_field(tmp_path):
    log = RunLog(tmp_path)
    with pytest.raises(EventSchemaError, match="unknown event 'comitt'.*commit"):
        log.event("comitt", round=1)
    with pytest.raises(EventSchemaError, match="'commit' lacks digests_agree"):
        log.event("commit", round=1, epoch=2, replicas=["c0r0"])
    log.event("commit", round=1, epoch=2, replicas=["c0r0"], digests_agree=True, extra="kept")
    log.flush(10.0)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 1, "nothing of a refused event reaches the file"
    record = json.loads(lines[0])
    assert record["event"] == "commit" and record["extra"] == "kept" and isinstance(record["t"], float)


def test_events_page_names_every_event():
    page = (REPO / "docs" / "reference" / "events.md").read_text(encoding="utf-8")
    missing = [name for name in EVENTS if f"## `{name}`" not in page]
    assert not missing, f"docs/reference/events.md has no section for {missing}"
