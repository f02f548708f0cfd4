"""The run's record under run.dir (README, "Outputs"): events.jsonl (`t`: unix seconds) and
metrics.jsonl, written by `RunLog`. Events are typed: `EVENTS` names every event and the fields it
always carries (more may follow); `RunLog.event` refuses an unknown name or a missing field.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from hsgd.record.rundir import NO_WRITE, FolderWriter, append_lines, atomic_write_text, read_jsonl

# event -> the fields it always carries (besides "t" and "event")
EVENTS: dict[str, tuple[str, ...]] = {
    # the run and its supervisor
    "supervisor_start": ("starts", "pid"),  # starts: the durable start count
    "initial_eval": ("eval_loss",),  # held-out loss of the initial model
    "run_stopped": ("round",),  # a clean stop was requested; the run stops after this round
    "run_failed": ("reason",),  # the run cannot go on (below quorum too long, total loss, no checkpoint)
    "run_end": ("status",),  # a supervisor's last event: completed | failed | stopped
    "quorum_wait": ("reason", "wait_s"),  # below quorum: waiting up to wait_s for replicas to return
    # a site request (hsgd/core/site_requests.py) decided at a round's start, once: outcome applied | refused
    "site_request": ("id", "kind", "cluster", "outcome", "reason", "round"),
    # an added site's replicas answered up (all, or those left at its floor when others died for good):
    # it joins at round's start (seconds since it was applied); `replicas`: those up
    "site_up": ("cluster", "round", "replicas", "seconds"),
    "site_committed": ("cluster", "round", "replicas"),  # an added site took part in round's commit, the first time
    # an applied add-site given up before it joined (its replicas died for good, too few left): stopped, none join
    "site_abandoned": ("cluster", "round", "reason"),
    # one round's phases
    "phase_begin": ("phase", "round", "cluster", "epoch", "replicas"),
    "phase_end": ("phase", "round", "cluster", "seconds", "ok", "failed"),
    "membership": ("epoch", "level", "cluster", "members", "leaders"),
    "cluster_reform": ("cluster", "round", "epoch", "members", "reason"),
    "yield_requested": ("cluster", "round", "at_step", "replicas", "reason"),
    "round_plan": ("round", "steps", "step_s", "source"),
    "outer_step_warning": (
        "round",
        "detail",
    ),  # the global eval loss rose while every cluster's fell (once)  # sync.balance=steps: each cluster's inner steps
    "join_aborted": ("cluster", "round", "epoch", "prefix", "dead", "reason"),
    "commit_decision": ("round", "clusters"),  # every leader reduced: the round commits
    "commit": ("round", "epoch", "replicas", "digests_agree"),
    "round_recorded_late": ("round",),  # a new supervisor recorded a round its predecessor committed
    # failures and recovery
    "collective_failed": ("rid", "phase", "round", "cluster", "outcome", "detail"),
    "replica_error": ("rid", "phase", "round", "cluster", "outcome", "detail"),  # it raised: restarted
    "replica_down": ("rid", "cluster", "cause", "round", "incarnation"),
    "replica_up": ("rid", "pid", "incarnation"),
    "non_finite": ("rid", "rids", "cluster", "round", "phase", "what"),
    "cluster_benched": ("cluster", "round", "reason"),
    "presumed_dead": ("rid", "reason"),
    "idle_replica_lost": ("rid", "round", "detail"),
    "hang_detected": (
        "rid",
        "phase",
        "round",
        "cluster",
        "reason",
        "waited_s",
        "deadline_s",
        "stuck_in",
        "report",
        "waiting",
    ),  # silent and not advancing past its limit; report under hangs/
    "kill": ("rid", "reason"),  # a replica is killed (restartable)
    "kill_failed": ("rid", "error"),  # already dead, most often
    "heal_begin": ("target", "source", "scope"),  # scope: full | global
    "heal_end": ("target", "source", "scope", "seconds", "bytes", "gbps", "transport"),
    "heal_fallback": ("target", "source", "round", "detail"),
    "heal_source_lost": ("source", "round", "detail"),  # a heal's source died before its state arrived
    "spare_ready": ("cluster", "spare", "pid"),
    "replica_quarantined": ("rid", "node", "moved_to", "deaths"),  # set aside: re-created on moved_to, or kept out
    "spare_promoted": ("rid", "spare", "replaced", "pid"),  # a hot spare took a lost replica's identity
    "spare_lost": ("cluster", "spare", "incarnation", "round"),
    # faults (the injector's own record; observed failures are in summary.json `faults`)
    "fault_scheduled": ("fault",),  # added by a drill while the run goes, as parsed
    "fault_armed": ("fault", "targets"),  # handed to the replicas it hits
    "fault_fired": ("fault", "pid"),  # a supervisor fault
    # checkpoints
    "checkpoint": ("round", "path", "replicas"),  # durable and final
    "checkpoint_skipped": ("round", "reason"),
    "checkpoint_refused": ("round", "reason"),  # its files disagree: not finalized
    "checkpoint_failed": ("round", "error", "replicas"),
    "model_saved": ("path", "round", "rid", "bytes"),
    "restore": ("round", "path", "reason", "replicas"),  # every replica loaded a durable checkpoint
    "checkpoint_fallback": ("path", "reason"),
    "lock_taken_over": ("previous_run_id", "reason"),
    # the run folder itself
    "run_dir_unwritable": ("path", "error"),
    "run_dir_writable": ("path", "down_s", "buffered"),
    "write_failed": ("what", "error"),
}


class EventSchemaError(ValueError):
    """An event that is not in EVENTS, or lacks one of its fields: a bug at the call site."""


def check_event(name: str, fields: dict) -> None:
    spec = EVENTS.get(name)
    if spec is None:
        raise EventSchemaError(f"unknown event {name!r}; known events: {', '.join(sorted(EVENTS))}")
    missing = [f for f in spec if f not in fields]
    if missing:
        raise EventSchemaError(f"event {name!r} lacks {', '.join(missing)} (it always carries {', '.join(spec)})")


class _Stream:
    """One JSON-lines file and the records not yet in it (oldest first)."""

    def __init__(self, path: Path):
        self.path = path
        self.pending: list[str] = []  # serialized lines, each ending in a newline
        self.rewrite = False  # the file must be replaced by `pending` (rewrite_metrics), not appended to
        self.generation = 0  # bumped by a rewrite: a write begun before it must not drop the new lines


class RunLog:
    """events.jsonl and metrics.jsonl, written so that a failing run folder never reaches the
    caller, and the run's other files within `write_timeout_s`, all through the folder's `FolderWriter`.

    `event` and `metrics` keep the record in memory, in order, and neither wait for the write nor
    raise for it. A record leaves memory only once it is in the file (append_lines: all or nothing),
    so an unwritable folder piles records up in memory and the next write that works writes them
    all, in order, each once. Health: `unwritable_s()`, the events `run_dir_unwritable` /
    `run_dir_writable`, and `warn` for the console; the caller decides how long an outage it
    tolerates (hsgd.core.deadlines.storage_problem).
    """

    def __init__(self, run_dir: str | Path, *, warn=None, write_timeout_s: float = 5.0):
        self.dir = Path(run_dir)
        with contextlib.suppress(OSError):  # the first write reports it (run_dir_unwritable)
            self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._warn = warn  # optional callable(str): the folder's outages, for the console
        self._streams = {name: _Stream(self.dir / f"{name}.jsonl") for name in ("events", "metrics")}
        self._kept = self._written = 0  # records ever kept / ever written (an outage's count: `buffered`)
        self._written_at_failure = 0
        self.writer = FolderWriter(write_timeout_s, on_change=self._health_changed)

    # -- the records ------------------------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        check_event(name, fields)
        self._keep("events", {"t": time.time(), "event": name, **fields})

    def metrics(self, record: dict) -> None:
        self._keep("metrics", record)

    def rewrite_metrics(self, records: list[dict]) -> bool:
        """Replace metrics.jsonl by `records` atomically (after a restore, rounds trained again lose
        their old lines), dropping those still in memory. True when replaced within the deadline,
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
        """Write `path` (relative: under the run folder) atomically on the writer thread; answers as
        `FolderWriter.submit` (a later write of the same path, queued meanwhile, replaces this one)."""
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
                    del stream.pending[: len(lines)]
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
            with contextlib.suppress(Exception):  # the console is best effort too
                self._warn(message)
