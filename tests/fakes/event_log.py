"""A stand-in for hsgd.record.events.RunLog: the run's records in memory, no folder writes."""

from __future__ import annotations

from pathlib import Path


class EventLog:
    """RunLog's interface in memory. `event` refuses what RunLog refuses (an event not in EVENTS, or
    lacking one of its fields) and keeps (name, fields) in `events`, in order. `records("events")`
    answers what events.jsonl would hold: pass a list as `kept` to share it with a restarted
    supervisor's log, as the file is shared. A test that keeps one list of everything its fakes were
    asked passes it as `calls`: each event is appended to it as ("event", name, fields). With
    `run_dir`, the log has RunLog's `writer` and reads the folder's other files (`read_jsonl`)."""

    def __init__(self, kept: list[dict] | None = None, *, calls: list | None = None, run_dir=None):
        self.events: list[tuple[str, dict]] = []
        self.kept = [] if kept is None else kept  # events.jsonl's records: {"event": name, **fields}
        self.calls = calls
        self.written_metrics: list[dict] = []
        self.dir = None if run_dir is None else Path(run_dir)
        if self.dir is not None:
            from hsgd.record.rundir import FolderWriter

            self.writer = FolderWriter(5.0)

    def event(self, name: str, **fields) -> None:
        from hsgd.record.events import check_event

        check_event(name, fields)
        self.events.append((name, fields))
        self.kept.append({"event": name, **fields})
        if self.calls is not None:
            self.calls.append(("event", name, fields))

    def named(self, name: str) -> list[dict]:
        """The fields of every `name` event, in order."""
        return [f for n, f in self.events if n == name]

    def metrics(self, record: dict) -> None:
        self.written_metrics.append(record)

    def rewrite_metrics(self, records: list[dict]) -> bool:
        self.written_metrics = list(records)
        return True

    def records(self, name: str) -> list[dict]:
        assert name in ("events", "metrics"), name
        return list(self.kept) if name == "events" else list(self.written_metrics)

    def read_jsonl(self, name: str) -> list[dict]:
        from hsgd.record.rundir import read_jsonl

        return [] if self.dir is None else read_jsonl(self.dir / name)
