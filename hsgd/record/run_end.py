"""A run never ends without its summary: the driver's summary when the supervisor could not make
one (`driver_summary`), and `ensure_summary`, which leaves summary.json holding it or prints it."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hsgd.record.metrics import fallback_summary
from hsgd.record.run_state import STATE_FILE
from hsgd.record.rundir import atomic_write_text, call_with_deadline, read_json, read_jsonl

if TYPE_CHECKING:
    from hsgd.config.layout import RunLayout

DRIVER_IO_S = 10.0  # the driver's wait for one read or write of the run folder at the run's end


def driver_summary(run_dir: str, layout: RunLayout, reason: str) -> dict:
    """summary.json of a run that failed where the supervisor could not say so itself (it is gone, or
    its run call raised), from what the driver can still read within DRIVER_IO_S."""
    try:
        durable, metrics = call_with_deadline(
            lambda: (read_json(Path(run_dir) / STATE_FILE), read_jsonl(Path(run_dir) / "metrics.jsonl")),
            DRIVER_IO_S,
            f"reading {run_dir}",
        )
    except Exception:  # noqa: BLE001 — the folder itself is gone or hung: what is known is the reason
        durable, metrics = {}, []
    summary = fallback_summary(
        status="failed",
        reason=reason,
        durable=durable,
        metrics=metrics,
        steps_per_round=layout.steps_per_round,
        now=time.time(),
        run_dir=run_dir,
    )
    return {
        **summary,
        "topology": layout.with_indices(durable.get("replica_indices")).topology.describe(),
        "replicas_quarantined": len(durable.get("quarantined") or {}),
    }


def ensure_summary(run_dir: str, summary: dict) -> None:
    """summary.json holds `summary` when this returns, or the summary is printed on the console as
    one JSON line (after a line saying why): a run never ends without its summary."""
    # json writes floats with repr(): the shortest string that round-trips, i.e. full precision
    text = json.dumps(summary, indent=2, sort_keys=True, default=str)
    path = Path(run_dir) / "summary.json"
    with contextlib.suppress(Exception):  # absent, unreadable, hung: write it
        if call_with_deadline(lambda: path.read_text(encoding="utf-8"), DRIVER_IO_S, f"reading {path}") == text:
            return  # the supervisor wrote it
    try:
        call_with_deadline(
            lambda: atomic_write_text(path, json.dumps(summary, indent=2, sort_keys=True)),
            DRIVER_IO_S,
            f"writing {path}",
        )
    except Exception as err:  # noqa: BLE001 — OSError, TimeoutError, or a summary json cannot hold
        print(
            f"[hsgd] summary.json could not be written to {run_dir} ({type(err).__name__}: {err}); "
            f"the summary follows as one JSON line:",
            flush=True,
        )
        print(json.dumps(summary, sort_keys=True, default=str), flush=True)
