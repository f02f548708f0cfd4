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


class StallWatch:
    """Stuck = the step has not moved for `limit_s`: a replica whose step still advances is slow,
    never stuck (the same rule as the round machine's inner phase, for replicas found mid-phase
    after a supervisor restart)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self._last: dict[str, tuple[int, float]] = {}  # rid -> (step, when it was first seen there)

    def stuck(self, rid: str, step: int, now: float) -> bool:
        seen = self._last.get(rid)
        if seen is None or seen[0] != step:
            self._last[rid] = (step, now)
            return False
        return now - seen[1] > self.limit_s
