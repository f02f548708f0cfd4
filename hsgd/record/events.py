"""The run's record: `events.jsonl`, `metrics.jsonl` and `summary.json` under run.dir.

- events.jsonl: one JSON object per event — {"t": unix seconds, "event": name, ...fields}; events
  are phase_begin/phase_end, membership, configure, heal, commit, abort, fault, checkpoint, run_*.
- metrics.jsonl: one object per committed round (see README, "Outputs").
- summary.json: written atomically at the end (and on failure) with full-precision floats.
Each line is flushed as written, so a live reader (jobs.status, a notebook) sees it at once.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any



class RunLog:
    def __init__(self, run_dir: str | Path, *, echo=None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._echo = echo  # optional callable(str) for a readable console line
        self._events = open(self.dir / "events.jsonl", "a", encoding="utf-8")
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

    def event(self, name: str, **fields: Any) -> dict:
        record = {"t": time.time(), "event": name, **fields}
        with self._lock:
            self._events.write(json.dumps(record, default=str) + "\n")
            self._events.flush()
        if self._echo is not None and name not in ("phase_begin", "phase_end"):
            details = " ".join(f"{k}={v}" for k, v in fields.items())
            self._echo(f"[hsgd] {name} {details}")
        return record

    def metrics(self, record: dict) -> None:
        with self._lock:
            self._metrics.write(json.dumps(record, default=str) + "\n")
            self._metrics.flush()

    def rewrite_metrics(self, records: list[dict]) -> None:
        """Replace metrics.jsonl with `records` atomically (after a restore, the rounds that are
        trained again lose their old lines, so every round is recorded once)."""
        from hsgd.record.rundir import atomic_write_text

        with self._lock:
            self._metrics.close()
            atomic_write_text(self.dir / "metrics.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in records))
            self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

    def close(self) -> None:
        with self._lock:
            self._events.close()
            self._metrics.close()


