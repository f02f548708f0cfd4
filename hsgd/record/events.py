"""The run's record: `events.jsonl`, `metrics.jsonl` and `summary.json` under run.dir.

- events.jsonl: one JSON object per event — {"t": unix seconds, "event": name, ...fields}. Events
  are typed: `EVENTS` names every event and the fields it always carries (more may follow), and
  `RunLog.event` refuses an unknown name or a missing field, so a reader (jobs.status, the plots,
  a user's notebook) can rely on them; tests/unit/test_event_schema.py checks every call site.
- metrics.jsonl: one object per committed round (see README, "Outputs").
- summary.json: written atomically at the end (and on failure) with full-precision floats.
How records reach the files while the folder fails and recovers: `RunLog`.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from hsgd.record.rundir import NO_WRITE, FolderWriter, append_lines, atomic_write_text, read_jsonl


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
    "join_aborted": EventSpec(("cluster", "round", "epoch", "prefix", "dead", "reason"),
                              "a member of a group being formed is known dead: every member waiting in that "
                              "group's rendezvous is released (their calls answer collective_failed, "
                              "error_kind join_aborted)"),
    "commit_decision": EventSpec(("round", "clusters"), "every leader reduced: the round commits"),
    "commit": EventSpec(("round", "epoch", "replicas", "digests_agree"), "the round is committed and recorded"),
    "round_recorded_late": EventSpec(("round",), "a new supervisor recorded a round its predecessor committed"),
    # failures and recovery
    "collective_failed": EventSpec(("rid", "phase", "round", "cluster", "outcome", "detail"), "a replica's group broke"),
    "replica_error": EventSpec(("rid", "phase", "round", "cluster", "outcome", "detail"),
                               "a replica raised (that replica's failure: it is restarted)"),
    "replica_down": EventSpec(("rid", "cluster", "cause", "round", "incarnation"),
                              "a replica is lost (cause: died | hung | error), each death once: incarnation = Ray's "
                              "restart count of the process that died (null: unknown) in the actor `actor` that "
                              "served rid; phase `restarting` for one that died before it answered, `joining` for "
                              "one that answered but was not yet taken back in"),
    "replica_up": EventSpec(("rid", "pid", "incarnation"), "a replica (re)started and answers (incarnation: Ray's "
                                                           "restart count of its actor; null: unknown)"),
    "non_finite": EventSpec(("rid", "rids", "cluster", "round", "phase", "what"),
                            "a loss, gradient norm or pseudo-gradient was NaN/inf: the cluster's round is void, nobody "
                            "is killed (rid: the first to report, rids: all that did; what: loss | grad_norm | "
                            "pseudo_gradient)"),
    "cluster_benched": EventSpec(("cluster", "round", "reason"),
                                 "warning: non-finite in two rounds running, the cluster sits out until the run's end "
                                 "or a resume"),
    "presumed_dead": EventSpec(("rid", "reason"), "its peers saw its connection close: gone, nothing to kill"),
    "idle_replica_lost": EventSpec(("rid", "round", "detail"), "a replica with no call in flight found dead or restarted"),
    "hang_detected": EventSpec(("rid", "phase", "round", "cluster", "reason", "waited_s", "deadline_s", "stuck_in",
                                "report", "waiting"), "silent and not advancing past its limit; report under hangs/"),
    "kill": EventSpec(("rid", "reason"), "a replica is killed (restartable)"),
    "kill_failed": EventSpec(("rid", "error"), "the kill did not go through (already dead, most often)"),
    "heal_begin": EventSpec(("target", "source", "scope"), "target loads source's state (scope: full | global)"),
    "heal_end": EventSpec(("target", "source", "scope", "seconds", "bytes", "gbps", "transport"),
                          "the heal is done (transport: group | object_store; gbps: bytes over seconds, gigabits/s)"),
    "heal_fallback": EventSpec(("target", "source", "round", "detail"),
                               "a heal over the process group failed: the target is healed through the object store"),
    "heal_source_lost": EventSpec(("source", "round", "detail"), "a heal's source died before its state arrived"),
    "spare_ready": EventSpec(("cluster", "spare", "pid"), "a hot spare is warm"),
    "replica_quarantined": EventSpec(("rid", "node", "moved_to", "deaths"),
                                     "a replica died faults.quarantine_after times within quarantine_window_s: "
                                     "re-created on node moved_to, or (null) kept out for the rest of the run"),
    "spare_promoted": EventSpec(("rid", "spare", "replaced", "pid"), "a hot spare took a lost replica's identity"),
    "spare_lost": EventSpec(("cluster", "spare", "incarnation", "round"),
                            "a hot spare's process died (ready, warming up, or a replaced replica's actor on its way "
                            "to becoming one): Ray restarts it as a spare; one summary `faults` entry"),
    # faults (the injector's own record; observed failures are in summary.json `faults`)
    "fault_scheduled": EventSpec(("fault",), "a fault added while the run goes (drills), as parsed"),
    "fault_armed": EventSpec(("fault", "targets"), "a scheduled fault was handed to the replicas it hits"),
    "fault_fired": EventSpec(("fault", "pid"), "a supervisor fault fired"),
    # checkpoints
    "checkpoint": EventSpec(("round", "path", "replicas"), "a durable checkpoint is final"),
    "checkpoint_skipped": EventSpec(("round", "reason"), "no checkpoint this time (and why)"),
    "checkpoint_refused": EventSpec(("round", "reason"), "a checkpoint whose files disagree was not finalized"),
    "checkpoint_failed": EventSpec(("round", "error", "replicas"),
                                   "storage refused this checkpoint (a replica's write or the supervisor's): skipped, "
                                   "training goes on, the previous one stays"),
    "model_saved": EventSpec(("path", "round", "rid", "bytes"),
                             "the run's end: the committed global model written as model.safetensors by replica rid"),
    "restore": EventSpec(("round", "path", "reason", "replicas"), "every replica loaded a durable checkpoint"),
    "checkpoint_fallback": EventSpec(("path", "reason"),
                                     "a checkpoint that does not verify (or is another config's) was skipped for an "
                                     "older one, at resume or in a restore"),
    "lock_taken_over": EventSpec(("previous_run_id", "reason"),
                                 "train.resume took over the stale lock of the run folder (its process gone, or "
                                 "not refreshed for a minute)"),
    # the run folder itself
    "run_dir_unwritable": EventSpec(("path", "error"),
                                    "writes to the run folder fail: records are kept in memory meanwhile"),
    "run_dir_writable": EventSpec(("path", "down_s", "buffered"),
                                  "the run folder works again; the records kept meanwhile are written, in order"),
    "write_failed": EventSpec(("what", "error"), "a file of the run could not be written (wandb, plots, a report)"),
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


class _Stream:
    """One JSON-lines file and the records not yet in it (oldest first)."""

    def __init__(self, path: Path):
        self.path = path
        self.pending: list[str] = []  # serialized lines, each ending in a newline
        self.rewrite = False  # the file must be replaced by `pending` (rewrite_metrics), not appended to
        self.generation = 0  # bumped by a rewrite: a write begun before it must not drop the new lines


class RunLog:
    """events.jsonl and metrics.jsonl, written so that a failing run folder never reaches the
    caller, and the run's other files (status, durable state, reports, summary) with a deadline.

    `event` and `metrics` keep the record in memory, in order, and ask the folder's writer thread
    (hsgd.record.rundir.FolderWriter) to append what is kept; they neither wait for the write nor
    raise for it. A record leaves memory only once it is in the file (append_lines: all or
    nothing), so while the folder is unwritable records pile up in memory and the next write
    that works writes them all, in order, each once. `write_file` writes a whole file atomically
    through the same thread and waits at most `write_timeout_s`. The folder's health is reported
    by `unwritable_s()` and by two events, `run_dir_unwritable` when writes start failing and
    `run_dir_writable` when one works again (with `warn` called for each, for the console); the
    caller decides how long an outage it tolerates (the supervisor: run.io_grace_s, hsgd.core.deadlines.storage_problem).
    """

    def __init__(self, run_dir: str | Path, *, echo=None, warn=None, write_timeout_s: float = 5.0):
        self.dir = Path(run_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # the first write reports it (run_dir_unwritable)
        self._lock = threading.Lock()
        self._echo = echo  # optional callable(str) for a readable console line
        self._warn = warn  # optional callable(str): the folder's outages, for the console
        self._streams = {name: _Stream(self.dir / f"{name}.jsonl") for name in ("events", "metrics")}
        self._kept = self._written = 0  # records ever kept / ever written (an outage's count: `buffered`)
        self._written_at_failure = 0
        self.writer = FolderWriter(write_timeout_s, on_change=self._health_changed)

    # -- the records ------------------------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> dict:
        check_event(name, fields)
        record = {"t": time.time(), "event": name, **fields}
        self._keep("events", record)
        if self._echo is not None and name not in ("phase_begin", "phase_end"):
            details = " ".join(f"{k}={v}" for k, v in fields.items())
            self._echo(f"[hsgd] {name} {details}")
        return record

    def metrics(self, record: dict) -> None:
        self._keep("metrics", record)

    def rewrite_metrics(self, records: list[dict]) -> bool:
        """Replace metrics.jsonl by `records` atomically (after a restore, the rounds that are
        trained again lose their old lines, so every round is recorded once); records still in
        memory are dropped with the file's. True when the file is replaced within the deadline,
        False when the replacement is kept in memory until the folder works."""
        stream = self._streams["metrics"]
        with self._lock:
            stream.pending = [json.dumps(r, default=str) + "\n" for r in records]
            stream.rewrite, stream.generation = True, stream.generation + 1
        return bool(self.writer.submit("flush", self._flush))

    def records(self, name: str) -> list[dict]:
        """Every record of `name` ("events" or "metrics"): the file's, then those still in memory.
        When the file cannot be read in time (the folder is gone or hung), only those in memory."""
        stream = self._streams[name]

        def read() -> list[dict]:  # on the writer thread: no append runs meanwhile
            with self._lock:
                pending, rewrite = list(stream.pending), stream.rewrite
            return ([] if rewrite else read_jsonl(stream.path)) + [json.loads(line) for line in pending]

        answer = self.writer.submit(("read", name), read, counts=False)
        if isinstance(answer, list):
            return answer
        with self._lock:
            return [json.loads(line) for line in stream.pending]

    def read_jsonl(self, name: str) -> list[dict]:
        """Another JSON-lines file of the run folder (faults_fired.jsonl), read within the write
        deadline; [] when it cannot be."""
        answer = self.writer.submit(("read", name), lambda: read_jsonl(self.dir / name), counts=False)
        return answer if isinstance(answer, list) else []

    def pending(self) -> int:
        """How many records wait in memory for the folder."""
        with self._lock:
            return sum(len(s.pending) for s in self._streams.values())

    # -- other files ------------------------------------------------------------------------------
    def write_file(self, path: str | Path, text: str, *, wait: bool = True, make_parent: bool = False) -> bool | None:
        """Write `path` (relative: under the run folder) atomically on the writer thread. With
        `wait`: True when written within the deadline, False otherwise (it failed — the folder's
        health says why — or it is still under way). Without: None at once (a later write of the
        same path, queued meanwhile, replaces this one)."""
        path = self.dir / path

        def write() -> None:
            if make_parent:
                path.parent.mkdir(exist_ok=True)
            atomic_write_text(path, text)

        return self.writer.submit(("file", str(path)), write, wait=wait)

    # -- health -----------------------------------------------------------------------------------
    def unwritable_s(self) -> tuple[float, str]:
        """(seconds the run folder has been failing writes — 0 when it works —, the last error)."""
        return self.writer.health()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Write what is kept in memory, waiting at most timeout_s (default: the write deadline);
        True when nothing is left there."""
        end = time.monotonic() + (self.writer.deadline_s if timeout_s is None else timeout_s)
        while True:  # again while writing brought news (run_dir_writable) to write
            wrote = self.writer.submit("flush", self._flush, deadline_s=timeout_s and max(0.0, end - time.monotonic()))
            if self.pending() == 0:
                return True
            if wrote is False or time.monotonic() >= end:
                return False

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is kept, waiting at most timeout_s (a run's end). True when all is written."""
        return self.flush(timeout_s)

    # -- the writer thread's side -----------------------------------------------------------------
    def _keep(self, name: str, record: dict) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._streams[name].pending.append(line)
            self._kept += 1
        self.writer.submit("flush", self._flush, wait=False)

    def _flush(self) -> object:
        wrote = False
        for stream in self._streams.values():
            with self._lock:
                lines, rewrite, generation = list(stream.pending), stream.rewrite, stream.generation
            if not lines and not rewrite:
                continue
            if rewrite:
                atomic_write_text(stream.path, "".join(lines))
            else:
                append_lines(stream.path, "".join(lines))  # OSError: they stay in memory, tried again later
            wrote = True
            with self._lock:
                if stream.generation == generation:
                    del stream.pending[:len(lines)]
                    stream.rewrite = False
                self._written += len(lines)
        return None if wrote else NO_WRITE

    def _health_changed(self, ok: bool, error: str, down_s: float) -> None:
        if ok:  # buffered: the records that were not in the files when writes began to fail, or came meanwhile
            with self._lock:
                buffered = self._kept - self._written_at_failure
            self.event("run_dir_writable", path=str(self.dir), down_s=down_s, buffered=buffered)
            message = f"run folder {self.dir} writable again after {down_s:.1f} s; records kept meanwhile are written"
        else:
            with self._lock:
                self._written_at_failure = self._written
            self.event("run_dir_unwritable", path=str(self.dir), error=error)
            message = f"run folder {self.dir} is not writable ({error}); records are kept in memory meanwhile"
        if self._warn is not None:
            try:
                self._warn(message)
            except Exception:  # noqa: BLE001 — the console is best effort too
                pass

