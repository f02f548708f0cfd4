"""Hang watchdog: per-phase deadlines learned from the run itself, and hang reports.

Deadlines. A fixed timeout is either too short for a slow healthy run or too long for a hang.
`PhaseClock` keeps the recent durations of each phase, per unit of work (an inner phase of k
steps counts k units), and sets the deadline of the next call to

    clamp(multiple * median(recent seconds per unit) * units, floor_s, ceiling_s)

so a replica twice as slow as usual is left alone (multiple defaults to 4) while a hung one is
caught within seconds of the floor. Until a phase has been seen `min_samples` times its deadline
is the ceiling.

Reports. When a deadline passes, the supervisor collects a stack dump of every replica in the
phase (py-spy when present, else faulthandler through a signal, else the replica's own answer)
and `hang_report` writes which replica is stuck, in which function, and who waits on it.
"""
from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass
class PhaseClock:
    multiple: float = 4.0
    floor_s: float = 15.0
    ceiling_s: float = 300.0
    window: int = 20
    min_samples: int = 2

    def __post_init__(self) -> None:
        self._per_unit: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.window))

    def observe(self, phase: str, seconds: float, units: int = 1) -> None:
        """Record a phase call that completed without failure."""
        if units > 0 and seconds >= 0:
            self._per_unit[phase].append(seconds / units)

    def median(self, phase: str, default: float) -> float:
        """Median recent seconds per unit of `phase`, or `default` before any was seen."""
        history = self._per_unit.get(phase)
        return statistics.median(history) if history else default

    def deadline(self, phase: str, units: int = 1) -> float:
        history = self._per_unit.get(phase)
        if not history or len(history) < self.min_samples:
            return self.ceiling_s
        expected = statistics.median(history) * max(units, 1)
        return min(self.ceiling_s, max(self.floor_s, self.multiple * expected))


# What StallWatch.verdict says about one replica after a supervisor restart
IDLE, BUSY, WAITING, STUCK, HUNG = "idle", "busy", "waiting", "stuck", "hung"
STEPPED_PHASES = ("inner",)  # phases whose work is steps: alive while the step moves


class StallWatch:
    """Replicas found mid-phase after a supervisor restart (the old supervisor's calls run on):
    which to wait for, which to kill.

    - In an inner phase a replica is stuck when its step has not moved for `limit_s` (the round
      machine's rule: a replica whose step still advances is slow, never stuck).
    - In any other phase (a checkpoint write, a heal, the outer exchange or commit, forming a
      group) there is no step to watch: it is stuck when the same phase call (same `phase` and
      `phase_since`) has gone on longer than that phase's own limit, `phase_limits[phase]`
      (scaled to the work by the caller: bytes at comm.min_gbps for a heal or an outer sync),
      else `limit_s`. A step that does not move there is no sign of a hang.
    - A replica that does not answer at all (its control channel is silent: a hang that holds the
      GIL) is hung after `silent_s` of silence; the caller kills it so Ray restarts it.

    Clocks are the caller's (`now`, monotonic): a replica's own `phase_since` only tells one
    phase call from the next, never how long it ran (another node's clock)."""

    def __init__(self, limit_s: float, phase_limits: dict[str, float] | None = None, silent_s: float | None = None):
        self.limit_s = limit_s
        self.phase_limits = dict(phase_limits or {})
        self.silent_s = limit_s if silent_s is None else silent_s
        self._last: dict[str, tuple[int, float]] = {}  # rid -> (step, when it was first seen there)
        self._phase: dict[str, tuple[tuple, float]] = {}  # rid -> ((phase, phase_since), first seen in it)
        self._silent: dict[str, float] = {}  # rid -> when it first did not answer

    def stuck(self, rid: str, step: int, now: float) -> bool:
        """The step rule alone: `step` has not moved for longer than limit_s."""
        seen = self._last.get(rid)
        if seen is None or seen[0] != step:
            self._last[rid] = (step, now)
            return False
        return now - seen[1] > self.limit_s

    def limit(self, phase: str) -> float:
        return self.phase_limits.get(phase, self.limit_s)

    def verdict(self, rid: str, answer: dict | None, now: float) -> str:
        """`answer`: rid's progress answer ({"phase", "step", "phase_since"}), or None when it did
        not answer in time (not when it is known dead: that is the caller's, and no kill).
        Returns IDLE (admit it), BUSY (wait), WAITING (silent, within silent_s), STUCK (in a phase
        past its limit: kill) or HUNG (silent past silent_s: kill)."""
        if answer is None:
            since = self._silent.setdefault(rid, now)
            return HUNG if now - since > self.silent_s else WAITING
        self._silent.pop(rid, None)
        phase = answer.get("phase", "idle")
        if phase == "idle":
            self._last.pop(rid, None)
            self._phase.pop(rid, None)
            return IDLE
        if phase in STEPPED_PHASES:
            self._phase.pop(rid, None)
            return STUCK if self.stuck(rid, int(answer.get("step", -1)), now) else BUSY
        self._last.pop(rid, None)
        call = (phase, answer.get("phase_since"))
        seen = self._phase.get(rid)
        if seen is None or seen[0] != call:
            self._phase[rid] = (call, now)
            return BUSY
        return STUCK if now - seen[1] > self.limit(phase) else BUSY
