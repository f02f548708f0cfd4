"""The run's record: `events.jsonl`, `metrics.jsonl` and `summary.json` under run.dir.

- events.jsonl: one JSON object per event — {"t": unix seconds, "event": name, ...fields}. Events
  are typed: `EVENTS` names every event and the fields it always carries (more may follow), and
  `RunLog.event` refuses an unknown name or a missing field, so a reader (jobs.status, the plots,
  a user's notebook) can rely on them; tests/unit/test_event_schema.py checks every call site.
- metrics.jsonl: one object per committed round (see README, "Outputs").
- summary.json: written atomically at the end (and on failure) with full-precision floats.
Each line is flushed as written, so a live reader (jobs.status, a notebook) sees it at once.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple


class EventSpec(NamedTuple):
    fields: tuple[str, ...]  # always present (besides "t" and "event"); an event may carry more
    doc: str


EVENTS: dict[str, EventSpec] = {
    # the run and its supervisor
    "supervisor_start": EventSpec(("starts", "pid"), "a supervisor incarnation started (its durable start count)"),
    "initial_eval": EventSpec(("eval_loss",), "held-out loss of the initial model"),
    "run_stopped": EventSpec(("round",), "a clean stop was requested; the run stops after this round"),
    "run_failed": EventSpec(("reason",), "the run cannot go on (below quorum too long, total loss, no checkpoint)"),
    "run_end": EventSpec(("status",), "the last event of a supervisor's run: completed | failed | stopped"),
    "quorum_wait": EventSpec(("reason", "wait_s"), "below quorum: waiting up to wait_s for replicas to return"),
    # one round's phases
    "phase_begin": EventSpec(("phase", "round", "cluster", "epoch", "replicas"),
                             "a phase call went out (cluster: int for a cluster's own phase, null for the outer level)"),
    "phase_end": EventSpec(("phase", "round", "cluster", "seconds", "ok", "failed"), "every member answered or was given up on"),
    "membership": EventSpec(("epoch", "level", "cluster", "members", "leaders"),
                            "a group is being formed (by the first call that uses it) under a fresh epoch"),
    "cluster_reform": EventSpec(("cluster", "round", "epoch", "members", "reason"),
                                "one cluster re-formed after a failure (or to take a joiner in); the others untouched"),
    "yield_requested": EventSpec(("cluster", "round", "at_step", "replicas", "reason"),
                                 "a cluster's members asked to stop at a step boundary for a replica joining mid-round"),
    "commit_decision": EventSpec(("round", "clusters"), "every leader reduced: the round commits"),
    "commit": EventSpec(("round", "epoch", "replicas", "digests_agree"), "the round is committed and recorded"),
    "round_recorded_late": EventSpec(("round",), "a new supervisor recorded a round its predecessor committed"),
    # failures and recovery
    "collective_failed": EventSpec(("rid", "phase", "round", "cluster", "outcome", "detail"), "a replica's group broke"),
    "replica_error": EventSpec(("rid", "phase", "round", "cluster", "outcome", "detail"),
                               "a replica raised (that replica's failure: it is restarted)"),
    "replica_down": EventSpec(("rid", "cluster", "cause", "round"), "a replica is lost (cause: died | hung | error)"),
    "replica_up": EventSpec(("rid", "pid"), "a replica (re)started and answers"),
    "presumed_dead": EventSpec(("rid", "reason"), "its peers saw its connection close: gone, nothing to kill"),
    "idle_replica_lost": EventSpec(("rid", "round", "detail"), "a replica with no call in flight found dead or restarted"),
    "hang_detected": EventSpec(("rid", "phase", "round", "cluster", "reason", "waited_s", "deadline_s", "stuck_in",
                                "report", "waiting"), "silent and not advancing past its limit; report under hangs/"),
    "kill": EventSpec(("rid", "reason"), "a replica is killed (restartable)"),
    "kill_failed": EventSpec(("rid", "error"), "the kill did not go through (already dead, most often)"),
    "heal_begin": EventSpec(("target", "source", "scope"), "target loads source's state (scope: full | global)"),
    "heal_end": EventSpec(("target", "source", "scope", "seconds", "bytes"), "the heal is done"),
    "heal_source_lost": EventSpec(("source", "round", "detail"), "a heal's source died before its state arrived"),
    "spare_ready": EventSpec(("cluster", "spare", "pid"), "a hot spare is warm"),
    "spare_promoted": EventSpec(("rid", "spare", "replaced", "pid"), "a hot spare took a lost replica's identity"),
    # faults (the injector's own record; observed failures are in summary.json `faults`)
    "fault_scheduled": EventSpec(("fault",), "a fault added while the run goes (drills), as parsed"),
    "fault_armed": EventSpec(("fault", "targets"), "a scheduled fault was handed to the replicas it hits"),
    "fault_fired": EventSpec(("fault", "pid"), "a supervisor fault fired"),
    # checkpoints
    "checkpoint": EventSpec(("round", "path", "replicas"), "a durable checkpoint is final"),
    "checkpoint_skipped": EventSpec(("round", "reason"), "no checkpoint this time (and why)"),
    "checkpoint_refused": EventSpec(("round", "reason"), "a checkpoint whose files disagree was not finalized"),
    "restore": EventSpec(("round", "path", "reason", "replicas"), "every replica loaded a durable checkpoint"),
}


class EventSchemaError(ValueError):
    """An event that is not in EVENTS, or lacks one of its fields: a bug at the call site."""


def check_event(name: str, fields: dict) -> None:
    spec = EVENTS.get(name)
    if spec is None:
        raise EventSchemaError(f"unknown event {name!r}; known events: {', '.join(sorted(EVENTS))}")
    missing = [f for f in spec.fields if f not in fields]
    if missing:
        raise EventSchemaError(f"event {name!r} lacks {', '.join(missing)} (it always carries {', '.join(spec.fields)})")


class RunLog:
    def __init__(self, run_dir: str | Path, *, echo=None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._echo = echo  # optional callable(str) for a readable console line
        self._events = open(self.dir / "events.jsonl", "a", encoding="utf-8")
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

    def event(self, name: str, **fields: Any) -> dict:
        check_event(name, fields)
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


