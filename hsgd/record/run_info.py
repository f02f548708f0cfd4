"""run.json, how `jobs.diagnose`, `jobs.status`, drills and notebooks find a run's actors: written by
the driver when it starts (the run's id, Ray address and replica ids; first, so the folder is known
as hsgd's), when the replicas' nodes are known, and at the run's end (`job_s`, the replicas of sites
added mid-run); by the supervisor at each site join (`replicas` widened). Every write is here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

RUN_INFO = "run.json"


def write_run_info(run_dir: str | Path, info: dict) -> None:
    atomic_write_text(Path(run_dir) / RUN_INFO, json.dumps(info, indent=1))


def widen_replicas(run_dir: str | Path, run_id: str, replica_ids: Callable[[list[str]], list[str]]) -> None:
    """run.json's `replicas` replaced by `replica_ids(replicas)`; another run's file (a folder reused
    by hand) is left alone."""
    info = json.loads((Path(run_dir) / RUN_INFO).read_text(encoding="utf-8"))
    if info.get("run_id") == run_id:
        info["replicas"] = replica_ids(list(info.get("replicas") or []))
        write_run_info(run_dir, info)
