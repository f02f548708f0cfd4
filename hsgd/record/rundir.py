"""The run folder on disk: atomic writes (temp name, fsync, rename) and JSON-lines readers.

Nothing under run.dir is ever half-written: every file is written to a temp name in the same
folder and renamed into place, so a crash leaves the old file or the new one, never a mix.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_summary(run_dir: str | Path, summary: dict) -> None:
    # json writes floats with repr(): the shortest string that round-trips, i.e. full precision.
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=2, sort_keys=True))


def read_json(path: str | Path) -> dict:
    """A JSON file the run keeps rewriting (status.json, run.json, supervisor_state.json): {} when it
    is absent or unreadable (a reader elsewhere may race the writer's rename, or a crash)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return records
