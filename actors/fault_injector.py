"""The one place a run's faults are scheduled, armed and recorded (torchft's FailureInjector, for
many faults: `faults.schedule`, random `faults.mtbf_s`, drills' `add`). `arm` hands each replica
fault to the phase call that must carry it (it fires inside the replica at the boundary named, so
runs replay bitwise); a target not in that call (a non-leader of `cluster:c1` in the outer reduce)
is hit from outside at once. Supervisor faults fire here. A replica fault counts as fired once its
line is in faults_fired.jsonl (the replica writes it), never when armed: a call can end before its
boundary, and the round and phase's next call carries it again. The fired indices are durable.
"""

from __future__ import annotations

import os
import time

import ray

from hsgd.config.layout import RunLayout
from hsgd.core.faults import (
    FaultSpec,
    due_faults,
    fired_as,
    parse_fault,
    parse_schedule,
    random_schedule,
    topology_shape,
)
from hsgd.record.run_state import RunState
from hsgd.record.rundir import write_fault_fired

DEADLY = ("kill", "crash", "hang", "error")  # fault kinds that end in the replica's death


class FaultInjector:
    """`layout`: the run's (its configured sites, steps per round); `state`: the durable state (fired and
    added faults), saved by `save`; `log`: the supervisor's RunLog."""

    def __init__(self, cfg, layout: RunLayout, run_dir: str, state: RunState, log, save):
        self.run_dir, self.state, self.log, self._save = run_dir, state, log, save
        self.armed_at: dict[str, list[float]] = {}  # rid -> when deadly faults were armed on it
        self.deadly_armed: set[int] = set()  # the deadly faults counted in armed_at
        self.shape = topology_shape(layout.topology)
        self.faults: list[FaultSpec] = parse_schedule(list(cfg.faults.schedule), **self.shape)
        fc, spr = cfg.faults, layout.steps_per_round
        if fc.mtbf_s > 0:
            self.faults += random_schedule(
                mtbf_s=fc.mtbf_s,
                kinds=list(fc.kinds),
                seed=fc.seed,
                rounds=cfg.train.rounds,
                round_s_estimate=spr * fc.step_s,
                steps_per_round=spr,
                **self.shape,
            )
        for raw in state.added_faults:  # faults a drill added before a restart
            self.faults.append(parse_fault(raw, index=len(self.faults), **self.shape))
        self.missed: set[int] = set()  # faults whose moment came with the target down or its call ending first

    def add(self, raw: dict) -> str:
        """Schedule one more fault (drills). Validated like the config's; recorded durably."""
        spec = parse_fault(raw, index=len(self.faults), **self.shape)
        self.faults.append(spec)
        self.state.added_faults.append(dict(raw))
        self._save()
        self.log.event("fault_scheduled", fault=spec.describe())
        return spec.describe()

    def pending(self, round_index: int, phases: tuple[str, ...]) -> bool:
        return any(
            i not in self.state.fired and f.round == round_index and f.phase in phases and f.target_kind != "supervisor"
            for i, f in enumerate(self.faults)
        )

    def arm(
        self, round_index: int, phases: tuple[str, ...], plan, *, only: set[str], handles: dict | None = None
    ) -> dict[str, list[FaultSpec]]:
        """rid -> the faults due in its call of `round_index` covering `phases` (rid in `only`)."""
        armed: dict[str, list[FaultSpec]] = {}
        due = [
            d
            for d in due_faults(self.faults, self.state.fired, round_index=round_index, phases=phases, plan=plan)
            if set(d.targets) & only
        ]
        fired = self._fired_lines(d.index for d in due)
        due = [d for d in due if d.index not in fired]
        self.missed |= {
            i
            for i, f in enumerate(self.faults)
            if f.round == round_index and f.phase in phases and f.target_kind == "replica" and f.target not in plan.live
        }
        for d in due:
            if d.spec.kind in DEADLY and d.index not in self.deadly_armed:  # once per fault, though re-carried
                self.deadly_armed.add(d.index)
                for rid in d.targets:
                    self.armed_at.setdefault(rid, []).append(time.time())
            if not set(d.targets) <= only:  # hit from outside now: fired here, never carried again
                self.state.fired.append(d.index)
            self.missed.add(d.index)  # carried: unless its line comes, its call ended before its boundary
            self.log.event("fault_armed", fault=d.spec.describe(), targets=list(d.targets))
            for rid in d.targets:
                if rid in only:
                    armed.setdefault(rid, []).append(d.spec)
                elif handles is not None and d.spec.kind == "kill":  # from outside, at once
                    self.record_fired(rid, d.spec.kind, d.spec.phase, round_index)
                    ray.kill(handles[rid], no_restart=False)
                elif handles is not None:
                    handles[rid].inject.remote(d.spec)  # fire-and-forget: it may never answer
        if due or fired:
            self._save()
        return armed

    def explains_death(self, rid: str, window_s: float = 120.0) -> bool:
        """A deadly fault armed on rid in the last `window_s` explains its death (one each): quarantine skips it."""
        recent = [t for t in self.armed_at.get(rid, ()) if time.time() - t <= window_s]
        self.armed_at[rid] = recent[1:]
        return bool(recent)

    def _fired_lines(self, indices) -> set[int]:
        """Which of `indices` a replica fired (its faults_fired.jsonl line); recorded as fired."""
        indices = [i for i in indices if i not in self.state.fired]
        lines = self.log.read_jsonl("faults_fired.jsonl") if indices else []
        fired = {i for i in indices if any(fired_as(self.faults[i], line) for line in lines)}
        self.state.fired.extend(sorted(fired))
        return fired

    def supervisor_faults(self, round_index: int, phase: str) -> None:
        """Fire a supervisor fault scheduled for this round and phase (the supervisor dies here)."""
        for i, f in enumerate(self.faults):
            if i in self.state.fired or f.target_kind != "supervisor" or f.round != round_index or f.phase != phase:
                continue
            self.state.fired.append(i)
            self._save()  # before dying: a restarted supervisor must not fire it again
            self.log.event("fault_fired", fault=f.describe(), pid=os.getpid())
            self.record_fired("supervisor", f.kind, phase, round_index)
            if f.kind == "kill":
                ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
                time.sleep(60)
            os._exit(17)

    def record_fired(self, rid: str, kind: str, phase: str, round_index) -> None:
        write_fault_fired(self.log.writer, self.run_dir, rid, kind, phase, round_index, 0)

    def not_fired(self) -> list[str]:
        """Faults that never fired. One whose round (committed) and phase came without it firing found
        its target down: it is recorded in faults_fired.jsonl from outside (no pid) with
        `target_down: true` (docs/faults.md) and is not listed."""
        self._fired_lines(range(len(self.faults)))
        for i, f in enumerate(self.faults):
            if i not in self.state.fired and i in self.missed and f.round < self.state.committed_round:
                self.state.fired.append(i)
                write_fault_fired(
                    self.log.writer, self.run_dir, f.target, f.kind, f.phase, f.round, f.step, target_down=True
                )
        self._save()
        return [f.describe() for i, f in enumerate(self.faults) if i not in self.state.fired]
