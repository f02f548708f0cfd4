"""A replica's faults (hsgd.core.faults.FaultSpec, docs/faults.md), fired inside it:
a phase call carries those due in it (`armed` while the call runs), each fired at the boundary it
names (`_hook`: the trainer's step boundaries and the phase's start), its line written to
faults_fired.jsonl first; a drill's `inject` fires at the next boundary (a crash at once). Mixed
into actors/replica.py's Replica, whose state (`armed`, `pending_now`, `slow_s`, its trainer and
level groups) it acts on.
"""

from __future__ import annotations

import os
import time

import ray

from hsgd.core.faults import FaultSpec
from hsgd.core.phases import STEPS
from hsgd.core.round import PhaseAnswer
from hsgd.record.rundir import write_fault_fired


class InjectedError(RuntimeError):
    """The `error` fault: raised inside a phase, it reaches the supervisor as a RayTaskError."""


class FaultHooks:
    """Replica's faults: `inject` (a control call), `_hook` (at each boundary), `_fire`."""

    @ray.method(concurrency_group="control")
    def inject(self, fault: FaultSpec) -> PhaseAnswer:
        """A fault from outside the schedule (drills; idle members of a `cluster:` target): a crash at
        once, the others at the phase thread's next step or phase boundary (they act on its work)."""
        if fault.kind == "crash":
            self._fire(fault, self.trainer.round, self.trainer.step_in_round)
        self.pending_now.append(fault)
        return self._answer(kind=fault.kind)

    def _hook(self, phase: str, round_index: int, step_in_round: int) -> None:
        while self.pending_now:
            self._fire(self.pending_now.pop(0), round_index, step_in_round)
        for fault in list(self.armed):
            if fault.phase == phase and (STEPS not in fault.phase.traits or fault.step == step_in_round):
                self.armed.remove(fault)
                self._fire(fault, round_index, step_in_round)

    def _fire(self, fault: FaultSpec, round_index: int, step_in_round: int) -> None:
        kind = fault.kind
        write_fault_fired(
            self.fault_writer, self.run_dir, self.rid, kind, fault.phase, round_index, step_in_round, pid=os.getpid()
        )
        if kind == "crash":
            os._exit(17)
        if kind == "kill":
            ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
            time.sleep(60)  # ray.kill is asynchronous; never run another step
        if kind == "hang":
            end = time.monotonic() + float(fault.seconds or 3600)
            while time.monotonic() < end:
                sum(range(3_000_000))  # C loop: holds the GIL for ~20-50 ms at a time
        if kind == "comm":
            self.inner.abort()
            self.outer.abort()
        if kind == "slow":
            self.slow_s = float(fault.seconds or 0.5)
        if kind == "nan":  # the next inner step's loss is NaN, as a diverging replica's
            self.trainer.poison()
        if kind == "error":  # an exception of the replica's own (CUDA OOM, an I/O error, a bug)
            raise InjectedError(f"{self.rid}: injected error in {fault.phase} of round {round_index}")

    def _fire_startup(self, faults: list[FaultSpec] | None) -> None:
        for fault in faults or ():
            self._fire(fault, fault.round, 0)
