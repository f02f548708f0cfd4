"""Deadlines: learned from the run itself, or scaled to the bytes moved (hang reports: hsgd.record.hangs).

A fixed timeout is either too short for a slow healthy run or too long for a hang. `PhaseClock`
keeps each phase's recent seconds per unit of work (an inner phase of k steps is k units) and sets
the next call's deadline to clamp(multiple * median * units, floor_s, ceiling_s): a replica twice
as slow as usual is left alone, a hung one caught near the floor; the ceiling until a phase was
seen `min_samples` times. A transfer's deadline is a fixed part plus its bytes at comm.min_gbps
(`collective_timeout_s`); the round settings, the collectives (hsgd/train/comm.py) and the actors'
waits all take them from here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass

# A full state is at most 7x its params — the params, AdamW's two moments, the global params, the
# outer momentum, the error-feedback residual (with a codec) and the outer snapshot (with
# sync.fragment_delay: one fragment's pseudo-gradient, at most the params), each at most as large as
# the params — plus small tensors (AdamW's `step` per parameter).
STATE_PER_PARAM_BYTE = 7
STATE_SMALL_BYTES = 1 << 20


def collective_timeout_s(base_s: float, payload_bytes: int, min_gbps: float) -> float:
    """How long one transfer of `payload_bytes` may take: a fixed part (a peer's answer) plus the
    payload at the slowest link speed assumed; a simulated link's sleep (`links.*`) comes after it."""
    return base_s + payload_bytes * 8 / (min_gbps * 1e9)


def state_bytes_bound(param_bytes: int) -> int:
    """The most bytes a full state of a model with `param_bytes` of params can hold."""
    return STATE_PER_PARAM_BYTE * param_bytes + STATE_SMALL_BYTES


def heal_deadline_s(
    *, call_timeout_s: float, configure_timeout_s: float, timeout_s: float, state_bytes: int, min_gbps: float
) -> float:
    """How long one heal of `state_bytes` may take, end to end (the round's heal deadline and the
    final heal's wait): its group's join, one stalled collective before it fails, the calls
    themselves, and the state twice at min_gbps (over the group, then the object store fallback)."""
    return collective_timeout_s(call_timeout_s + configure_timeout_s + timeout_s, 2 * state_bytes, min_gbps)


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
        if len(self._per_unit.get(phase, ())) < max(1, self.min_samples):
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.multiple * self.median(phase, 0.0) * max(units, 1)))


# What StallWatch.verdict says about one replica after a supervisor restart
IDLE, BUSY, WAITING, STUCK, HUNG = "idle", "busy", "waiting", "stuck", "hung"


class StallWatch:
    """Replicas found mid-phase after a supervisor restart (the old supervisor's calls run on):
    which to wait for, which to kill.

    - Inner phase: stuck when its step has not moved for `limit_s` (advancing = slow, never stuck).
    - Any other phase (checkpoint, heal, outer exchange, forming a group) has no step to watch:
      stuck when the same call (`phase`, `phase_since`) has run past `phase_limits[phase]` (the
      caller scales it to the bytes), else `limit_s`.
    - No answer at all (a hang holding the GIL): hung after `silent_s`; the caller kills it.

    Clocks are the caller's (`now`, monotonic): a replica's `phase_since` only tells one call from
    the next, never how long it ran (another node's clock)."""

    def __init__(self, limit_s: float, phase_limits: dict[str, float] | None = None, silent_s: float | None = None):
        self.limit_s = limit_s
        self.phase_limits = dict(phase_limits or {})
        self.silent_s = limit_s if silent_s is None else silent_s
        # rid -> (("inner", step) or (phase, phase_since), when it was first seen there)
        self._seen: dict[str, tuple[tuple, float]] = {}
        self._silent: dict[str, float] = {}  # rid -> when it first did not answer

    def limit(self, phase: str) -> float:
        return self.phase_limits.get(phase, self.limit_s)

    def verdict(self, rid: str, answer: dict | None, now: float) -> str:
        """`answer`: rid's progress answer ({"phase", "step", "phase_since"}), or None when it did
        not answer in time (a known death is the caller's). IDLE (admit it), BUSY (wait), WAITING
        (silent within silent_s), STUCK or HUNG (kill)."""
        if answer is None:
            since = self._silent.setdefault(rid, now)
            return HUNG if now - since > self.silent_s else WAITING
        self._silent.pop(rid, None)
        phase = answer.get("phase", "idle")
        if phase == "idle":
            self._seen.pop(rid, None)
            return IDLE
        stepped = phase == "inner"  # its work is steps: alive while the step moves
        call = (phase, int(answer.get("step", -1)) if stepped else answer.get("phase_since"))
        seen = self._seen.get(rid)
        if seen is None or seen[0] != call:
            self._seen[rid] = (call, now)
            return BUSY
        return STUCK if now - seen[1] > (self.limit_s if stepped else self.limit(phase)) else BUSY


def storage_problem(down_s: float, error: str, *, grace_s: float, run_dir) -> str | None:
    """None while the run folder's outage (`down_s`, `error`: RunLog.unwritable_s()) is within
    `grace_s` (run.io_grace_s), else why the run ends: a folder that stays unwritable that long."""
    if down_s <= grace_s:
        return None
    return f"run folder {run_dir} unwritable for {down_s:.0f} s (run.io_grace_s={grace_s:g}): {error}"
