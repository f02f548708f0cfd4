"""The run's durable state (`supervisor_state.json` in run.dir), typed, with every default here.
The supervisor saves it whole whenever it changes; the driver writes the first (`begin`) and reads
it when the supervisor is gone. Its file name and JSON keys never change: an older run folder resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hsgd.record.rundir import atomic_write_text, read_json

STATE_FILE = "supervisor_state.json"


@dataclass
class RunState:
    run_id: str = ""  # a supervisor never loads another run's state
    fingerprint: dict | None = None  # of the config
    started_at: float = field(default_factory=time.time)
    epoch: int = 0
    committed_round: int = 0
    supervisor_starts: int = 0
    fired: list[int] = field(default_factory=list)  # indices into the fault schedule
    # a drill's faults as it wrote them (the config's syntax, parsed again by a restarted supervisor's FaultInjector)
    added_faults: list[dict[str, object]] = field(default_factory=list)
    initial_eval_loss: float | None = None
    evaluated: bool = False  # initial_eval_loss is known (on disk: the key is present, even as null)
    identity: dict[str, str] = field(default_factory=dict)  # replica id -> the actor serving it
    spares: dict[str, list[str]] = field(default_factory=dict)
    deaths_seen: dict = field(default_factory=dict)  # deaths already reported
    benched: list[int] = field(default_factory=list)
    non_finite_rounds: dict[str, int] = field(default_factory=dict)
    checkpoints_failed: int = 0
    last_restore: dict = field(default_factory=dict)
    replica_indices: dict[str, int] = field(default_factory=dict)  # rid -> global index, for the whole run
    death_times: dict[str, list[float]] = field(default_factory=dict)  # each replica's recent deaths (quarantine)
    quarantined: dict[str, dict] = field(default_factory=dict)
    round_plan: dict = field(
        default_factory=dict
    )  # sync.balance=steps: the latest round's StepPlan (a successor follows it)
    tokens_per_cluster: list[int] = field(default_factory=list)  # committed rounds' tokens, per cluster

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["evaluated"]
        for key in ("round_plan", "tokens_per_cluster"):  # newer keys: an older run's file keeps its keys
            if not out[key]:
                del out[key]
        if not self.evaluated:
            del out["initial_eval_loss"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def read(cls, run_dir: str | Path) -> RunState:
        """Whatever state the folder holds: unknown keys ignored, absent ones defaulted (all of them
        when the file is absent or unreadable)."""
        raw = read_json(Path(run_dir) / STATE_FILE)
        raw = raw if isinstance(raw, dict) else {}
        state = cls(**{k: v for k, v in raw.items() if k in {f.name for f in fields(cls)} - {"evaluated"}})
        state.evaluated = "initial_eval_loss" in raw
        return state

    @classmethod
    def load(cls, run_dir: str | Path, run_id: str) -> RunState:
        """This run's state; another run's (or none) is never loaded: a fresh one for run_id."""
        state = cls.read(run_dir)
        return state if state.run_id == run_id else cls(run_id=run_id)

    def write(self, run_dir: str | Path) -> None:
        """Atomic: a temp name, then a rename (the driver's writes; the supervisor's go through its RunLog)."""
        atomic_write_text(Path(run_dir) / STATE_FILE, self.to_json())

    @classmethod
    def begin(cls, run_dir: str | Path, run_id: str, fingerprint: dict, *, resumed: bool) -> RunState:
        """A run's first state (the driver's, before the supervisor starts); a resumed run keeps the old
        state's epoch, fired faults and initial eval loss (its view of replicas is stale)."""
        state = cls(run_id=run_id, fingerprint=fingerprint)
        if resumed:
            old = cls.read(run_dir)
            state.epoch, state.fired = old.epoch, old.fired
            state.initial_eval_loss, state.evaluated = old.initial_eval_loss, old.evaluated
        return state
