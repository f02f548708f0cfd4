"""The run's record under run.dir (docs/outputs.md): events.jsonl (`t`: unix seconds) and
metrics.jsonl, written by `RunLog`. Events are typed: `EVENTS` names every event and the fields it
always carries (more may follow), `EVENT_DOCS` what each means (the manual's events reference is
generated from both); `RunLog.event` refuses an unknown name or a missing field.
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
    "round_closed": ("round", "close_s", "steps"),
    "site_late": ("cluster", "round", "steps", "replicas", "waiting_on", "reason"),
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

# event -> what it means: the events reference (docs/reference/events.md, `python -m hsgd.config.reference`) is
# written from EVENTS and these; every event has one (tests/unit/test_reference_pages.py)
EVENT_DOCS: dict[str, str] = {
    # the run and its supervisor
    "supervisor_start": "A supervisor started: `starts` is the durable start count (above 1 after a restart), "
    "`pid` its process.",
    "initial_eval": "The held-out loss of the initial model (`eval_loss`), before the first round.",
    "run_stopped": "A clean stop was asked for (Ctrl-C once, `Drill.stop`): the run stops after `round`.",
    "run_failed": "The run cannot go on (below quorum too long, a total loss with no checkpoint that helps, clusters "
    "benched below `supervisor.min_clusters`, the run folder unwritable past `run.io_grace_s`); `reason` says which.",
    "run_end": "A supervisor's last event: `status` is `completed`, `failed` or `stopped`.",
    "quorum_wait": "Below quorum (`reason`): the supervisor waits up to `wait_s` (`supervisor.quorum_wait_s`) for "
    "replicas to return, then fails the run.",
    "site_request": "A request from `requests/` decided once, at that round's start: `outcome` `applied` or `refused`, "
    'with the `reason` (see Sites, "Sites that come and go").',
    "site_up": "An added site's replicas all answered up, or those up when the others died for good past their "
    "re-creations and they keep its floor (`replicas` lists those up): it joins at that round's start; `seconds` since "
    "it was applied.",
    "site_committed": "The first round an added site committed with the others.",
    "site_abandoned": "An added site given up before it joined: its replicas dead for good and too few left up, or not "
    "up within `supervisor.join_timeout_s`; its replicas and placement group are stopped.",
    # one round's phases
    "phase_begin": "A phase begins: `cluster` is an int for a cluster's own phase, null for the outer level; `epoch` "
    "the membership epoch, `replicas` those called.",
    "phase_end": "A phase ends after `seconds`: `ok` the replicas that answered it, `failed` those that did not; "
    "`cluster` as in `phase_begin`.",
    "membership": "A group formed: `level` `inner` or `outer`, and the group's own `members` and `leaders` (one "
    "cluster's members and leader for `inner`, each cluster's leader for `outer`) under `epoch`.",
    "cluster_reform": "One cluster re-formed after a failure (`reason`), the others untouched: its live `members` "
    "under a new `epoch`.",
    "yield_requested": "A cluster's members were asked to stop at step `at_step`: for a replica joining mid-round "
    "(`supervisor.rejoin=fast`), or because the round closed (`sync.balance=time`); `reason` says which.",
    "round_closed": "`sync.balance=time`: the round's inner phases closed `close_s` seconds after its start; "
    "`steps`: each cluster's in-round step it was asked to stop at (it stops at the first boundary at or after it), "
    "or its whole round when it was done. Saved before the yields are asked: a restarted supervisor follows it.",
    "site_late": "`sync.balance=time`: a cluster was not ready by the round's close plus `sync.grace_s`, or stopped "
    "before `sync.min_round_steps`: the round goes on without it, nobody is killed. `steps`: the in-round steps it "
    "took and loses; `waiting_on`: its members whose calls were given up on (paused or still stepping), called again "
    "once those end; it heals from the new global params at a later round's start.",
    "round_plan": "`sync.balance=steps`: each cluster's inner `steps` for the round and the step times `step_s` they "
    "were planned from (null where unknown); `source` configured, learned, mixed or recorded. With "
    "`sync.fragment_delay` also `fragment_delay`: each cluster's, clamped to its plan.",
    "outer_step_warning": "With `sync.outer=diloco`, the global eval loss rose across two outer steps in a row while "
    "every cluster's own training loss fell: the outer step overshoots (`detail`). Said once, on the console too, "
    "naming `optim.outer.*`; nothing is changed.",
    "join_aborted": "A member of a group being formed is known dead (`dead`), so every member waiting in that group's "
    "rendezvous (`prefix`) is released at once — their calls answer `collective_failed` with `error_kind` "
    "`join_aborted` — instead of waiting out `comm.configure_timeout_s`.",
    "commit_decision": "Every holder reduced the round's pseudo-gradient: the round commits (`clusters` taking part).",
    "commit": "The round is committed under `epoch` by `replicas`; `digests_agree` is true when every replica of a "
    "cluster holds bitwise-equal params.",
    "round_recorded_late": "A new supervisor recorded a round its predecessor committed but did not record.",
    # failures and recovery
    "collective_failed": "A replica's collective failed in `phase` (`outcome`, `detail`); also `error_kind` when the "
    "replica named it: `configure`, `issue`, `wait`, `peer_gone`, `timeout`, `aborted`, `join_aborted`. Its cluster "
    "re-forms.",
    "replica_error": "A replica raised in `phase` (an OOM, an I/O error, an injected `error`): it is restarted and "
    "healed, never the job's failure.",
    "replica_down": "A replica is down: `cause` died, hung or error; `incarnation` is Ray's restart count of the "
    "process that died in `actor`, the actor that served `rid` (a promoted spare's). Each death once, also one while "
    "restarting, warming up or healing, read from Ray's actor table; `phase` `restarting` for a process that died "
    "before it answered, `joining` for one that answered but was not yet taken back in.",
    "replica_up": "A replica answered up: its `pid`, `incarnation`, and `replica_index`, the global replica index "
    "(the data stream) it reads.",
    "non_finite": "A loss, gradient norm or pseudo-gradient of a cluster was NaN/inf (`what`: loss, grad_norm or "
    "pseudo_gradient; `rid` the first to report, `rids` all that did): the cluster's round is void, nobody is killed.",
    "cluster_benched": "A warning: the cluster was non-finite in two rounds running; it sits out until the run's end "
    "or a resume.",
    "presumed_dead": "A replica is taken for dead because its peers saw its connection close.",
    "idle_replica_lost": "A replica with no call in flight was found dead or restarted; its cluster re-forms without "
    "it before the outer exchange.",
    "hang_detected": "A replica was silent and not advancing past its limit (`deadline_s`; it waited `waited_s`, stuck "
    "in `stuck_in`, its group `waiting`): the report is `report` under `hangs/`; it is killed and healed.",
    "kill": "A replica is killed (`reason`: a hang, a quarantine, ...); Ray may restart it.",
    "kill_failed": "A kill did not go through (`error`); the replica was already dead, most often.",
    "heal_begin": "A heal begins: `target` copies the state of `source`; `scope` `full` (from its own cluster) or "
    "`global` (from another).",
    "heal_end": "A heal ended: `bytes` the whole state moved, `seconds` end to end, `gbps` bytes × 8 / seconds / 10⁹ "
    "as in `comm.min_gbps`, `transport` `group` or `object_store`.",
    "heal_fallback": "A heal over the process group failed (`detail`); the target is healed through the object store.",
    "heal_source_lost": "A heal's source died or raised before its state arrived; the heal fails as any other.",
    "spare_ready": "A hot spare of `cluster` is warmed up and ready to take over a lost replica.",
    "replica_quarantined": "A replica died `faults.quarantine_after` times within `faults.quarantine_window_s` "
    "(`deaths`, `window_s`) on `node`: it is re-created on `moved_to`, or kept out when that is null.",
    "spare_promoted": "A hot spare took a lost replica's identity (`replaced`) and data stream.",
    "spare_lost": "A hot spare's process died — ready, warming up, or a replaced replica's actor on its way to "
    "becoming one (`spare`: the actor's name); Ray restarts it as a spare and the pool does not count it ready until "
    "it answers again.",
    # faults
    "fault_scheduled": "A drill added a fault while the run goes (`fault`, as parsed).",
    "fault_armed": "A fault was handed to the replicas it hits (`targets`).",
    "fault_fired": "A supervisor fault fired in the supervisor's process (`pid`); a replica's fault is a line of "
    "`faults_fired.jsonl`.",
    # checkpoints
    "checkpoint": "A checkpoint of `round` is durable and final at `path`, written by `replicas`.",
    "checkpoint_skipped": "No checkpoint of `round` was taken (`reason`: it already exists, replicas failed while "
    "saving).",
    "checkpoint_refused": "A checkpoint's files disagree: it is not finalized (`reason`).",
    "checkpoint_failed": "Storage refused this checkpoint (`error`): a replica's write answered `io_error`, or the "
    "supervisor's own step failed or passed `supervisor.call_timeout_s`. It is skipped, nobody is killed, training "
    "goes on and the previous checkpoint stays.",
    "model_saved": "The run's end: the final global model was written to `path` (`model.safetensors`, `bytes`) by "
    "replica `rid`, from `round`.",
    "restore": "Every replica loaded the durable checkpoint at `path` (`reason`: why the run went back to it); rounds "
    "after it are trained and recorded again, once.",
    "checkpoint_fallback": "A checkpoint that does not verify — unreadable manifest, a file whose sha256 differs, "
    "truncated — or that another config wrote was skipped for the previous kept one, at resume or in a restore "
    "(`path`, `reason`).",
    "lock_taken_over": "`train.resume=true` took over a dead run's stale lock (`previous_run_id`, `reason`).",
    # the run folder itself
    "run_dir_unwritable": "Writes to the run folder fail (`error`); events and metrics wait in memory.",
    "run_dir_writable": "The run folder works again after `down_s` seconds; the `buffered` records that waited are "
    "written, in order, once.",
    "write_failed": "A best-effort write failed (`what`: wandb, pruning old checkpoints, `model.safetensors`; "
    "`error`); the run goes on.",
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
