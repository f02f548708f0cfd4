"""The fault injector: the one place a run's faults are scheduled, armed and recorded.

Like torchft's FailureInjector, for a schedule of many faults (`faults.schedule`, random
`faults.mtbf_s`, drills' `add`). `arm` hands each replica fault to the phase call that must carry
it (it fires inside the replica at the boundary named, so runs replay bitwise); a target that takes
no part in that call (a non-leader of `cluster:c1` in the outer all-reduce) is hit from outside at
once, as a node failure would. Supervisor faults fire here. Every fault fires once: the fired
indices are durable; `not_fired` lists what never had its moment, for the summary.
"""
from __future__ import annotations

import os
import time

import ray

from hsgd.config.rounds import steps_per_round
from hsgd.core.faults import FaultSpec, due_faults, parse_fault, parse_schedule, random_schedule, topology_shape
from hsgd.core.topology import topology_of
from hsgd.record.run_state import RunState
from hsgd.record.rundir import write_fault_fired


DEADLY = ("kill", "crash", "hang", "error")  # fault kinds that end in the replica's death


class FaultInjector:
    """`state`: the run's durable state (fired and added faults live there), saved by `save`;
    `log`: the supervisor's RunLog (events, and faults_fired.jsonl through its writer)."""

    def __init__(self, cfg, run_dir: str, state: RunState, log, save):
        self.run_dir, self.state, self.log, self._save = run_dir, state, log, save
        self.armed_at: dict[str, list[float]] = {}  # rid -> when deadly faults were armed on it
        self.shape = topology_shape(topology_of(cfg))
        self.faults: list[FaultSpec] = parse_schedule(list(cfg.faults.schedule), **self.shape)
        fc, spr = cfg.faults, steps_per_round(cfg)
        if fc.mtbf_s > 0:
            self.faults += random_schedule(mtbf_s=fc.mtbf_s, kinds=list(fc.kinds), seed=fc.seed,
                                           rounds=cfg.train.rounds, round_s_estimate=spr * fc.step_s,
                                           steps_per_round=spr, **self.shape)
        for raw in state.added_faults:  # faults a drill added before a restart
            self.faults.append(parse_fault(raw, index=len(self.faults), **self.shape))

    def add(self, raw: dict) -> str:
        """Schedule one more fault (drills). Validated like the config's; recorded durably."""
        spec = parse_fault(raw, index=len(self.faults), **self.shape)
        self.faults.append(spec)
        self.state.added_faults.append(dict(raw))
        self._save()
        self.log.event("fault_scheduled", fault=spec.describe())
        return spec.describe()

    def pending(self, round_index: int, phases: tuple[str, ...]) -> bool:
        """Any replica fault of this round and these phases still to fire? (cheap: no plan needed)"""
        return any(i not in self.state.fired and f.round == round_index and f.phase in phases and f.target_kind != "supervisor"
                   for i, f in enumerate(self.faults))

    def arm(self, round_index: int, phases: tuple[str, ...], plan, *, only: set[str],
            handles: dict | None = None) -> dict[str, list[dict]]:
        """Faults due in a call of `round_index` covering `phases` made to the replicas `only`:
        rid -> fault messages to pass with that replica's call."""
        armed: dict[str, list[dict]] = {}
        due = [d for d in due_faults(self.faults, self.state.fired, round_index=round_index, phases=phases, plan=plan)
               if set(d.targets) & only]
        for d in due:
            if d.spec.kind in DEADLY:
                for rid in d.targets:
                    self.armed_at.setdefault(rid, []).append(time.time())
            self.state.fired.append(d.index)
            self.log.event("fault_armed", fault=d.spec.describe(), targets=list(d.targets))
            for rid in d.targets:
                if rid in only:
                    armed.setdefault(rid, []).append(d.message())
                elif handles is not None and d.spec.kind == "kill":  # from outside, at once
                    self.record_fired(rid, d.spec.kind, d.spec.phase, round_index)
                    ray.kill(handles[rid], no_restart=False)
                elif handles is not None:
                    handles[rid].inject.remote(d.message())  # fire-and-forget: it may never answer
        if due:
            self._save()
        return armed

    def explains_death(self, rid: str, window_s: float = 120.0) -> bool:
        """A deadly fault armed on rid in the last `window_s` explains its death (each fault one
        death): an injected failure, which says nothing about rid's node (quarantine skips it)."""
        recent = [t for t in self.armed_at.get(rid, ()) if time.time() - t <= window_s]
        self.armed_at[rid] = recent[1:]
        return bool(recent)

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
        return [f.describe() for i, f in enumerate(self.faults) if i not in self.state.fired]
