"""A run folder as a running driver keeps it (no Ray): hsgd's own marks, its lock held and refreshed."""

from __future__ import annotations

import json
from pathlib import Path

from hsgd.record.runlock import RunLock


def hold_run_folder(run_dir, run_id: str = "hsgd-test1") -> RunLock:
    """Make `run_dir` the folder of a running run: its lock taken (hsgd.record.runlock) and run.json
    naming the run, as actors/launch.py leaves them. Release the returned lock when done."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir, run_id).acquire(takeover=False)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id}))
    return lock
