"""What every side of a peer benchmark shares: the step log each trainer writes, the kill from
outside, and the figures read from the logs.

Every trainer in a comparison (hsgd, torchft, Ray Train) writes one step log per replica with
hsgd.record.steps.StepLog: a JSON line per committed step, `{"replica", "step", "t", "pid"}` (`t`
is wall time, `time.time()`, when the step's optimizer update is applied everywhere it must be;
flushed at once, so a SIGKILL loses no line already written). hsgd writes it with
`logging.step_times=true`. The bench kills a replica from outside with SIGKILL (its pid is
the last line's), then reads the logs:

    survivors' stall   for each replica that was not killed: the time from its last committed
                       step before the kill to its first committed step after it;
    rejoin             for the killed replica: the time from the kill to its next committed step
                       (under any pid: the restarted process writes to the same log).

The peers are benchmark-only dependencies (the `bench` extra); this module imports none of them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from hsgd.record.steps import StepLog  # noqa: F401 — the one writer of step logs, re-exported for the peers


def read_steps(folder: str | os.PathLike) -> dict[str, list[dict]]:
    """Every replica's committed steps, in file order (a torn last line, from a kill, is skipped)."""
    steps: dict[str, list[dict]] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        steps[path.stem] = rows
    return steps


def wait_for_step(folder: str | os.PathLike, replica: str, step: int, timeout_s: float, poll_s: float = 0.05) -> dict:
    """The first line of `replica` at `step` or later; TimeoutError after timeout_s."""
    path = Path(folder) / f"{replica}.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for row in read_steps(folder).get(replica, []):
                if row["step"] >= step:
                    return row
        time.sleep(poll_s)
    raise TimeoutError(f"{replica} did not reach step {step} within {timeout_s:.0f} s")


@dataclass
class Kill:
    replica: str
    pid: int
    t: float  # wall time the SIGKILL was sent


def kill_at_step(folder: str | os.PathLike, replica: str, step: int, timeout_s: float) -> Kill:
    """SIGKILL the process that wrote `replica`'s line for `step` (or later), from outside."""
    wait_for_step(folder, replica, step, timeout_s)
    pid = read_steps(folder)[replica][-1]["pid"]  # the newest line's writer: the live process
    os.kill(pid, signal.SIGKILL)
    return Kill(replica=replica, pid=pid, t=time.time())


@dataclass
class Recovery:
    """The figures of one kill (seconds)."""

    victim: str
    survivors_stall_s: dict[str, float] = field(default_factory=dict)
    rejoin_s: float | None = None  # None: the victim never committed a step again

    def as_dict(self) -> dict:
        stalls = list(self.survivors_stall_s.values())
        return {
            "victim": self.victim,
            "survivors_stall_s": self.survivors_stall_s,
            "survivors_stall_median_s": statistics.median(stalls) if stalls else None,
            "survivors_stall_max_s": max(stalls) if stalls else None,
            "rejoin_s": self.rejoin_s,
        }


def kept(rows: list[dict]) -> list[dict]:
    """The lines whose step is never committed again later: a step a rollback undid (Ray Train
    resumes from its last checkpoint and commits those steps again) is not progress."""
    last = {row["step"]: i for i, row in enumerate(rows)}
    return [row for i, row in enumerate(rows) if last[row["step"]] == i]


def recovery(steps: dict[str, list[dict]], kill: Kill) -> Recovery:
    """Survivors' stall and the victim's rejoin for one kill, read from the step logs. After the
    kill only kept steps count (a survivor that commits one more step before its group notices the
    death, and then rolls it back, has not gone on)."""
    out = Recovery(victim=kill.replica)
    for replica, rows in steps.items():
        after = [row["t"] for row in kept(rows) if row["t"] > kill.t]
        if replica == kill.replica:
            out.rejoin_s = after[0] - kill.t if after else None
            continue
        before = [row["t"] for row in rows if row["t"] <= kill.t]
        if before and after:
            out.survivors_stall_s[replica] = after[0] - before[-1]
    return out


def step_time_s(steps: dict[str, list[dict]], before_t: float | None = None) -> float | None:
    """The median time between consecutive committed steps of the same process (before `before_t`
    when given): the fault-free step time a stall is compared with."""
    gaps = []
    for rows in steps.values():
        for a, b in zip(rows, rows[1:], strict=False):
            if a["pid"] == b["pid"] and (before_t is None or b["t"] <= before_t):
                gaps.append(b["t"] - a["t"])
    return statistics.median(gaps) if gaps else None


def committed_steps(steps: dict[str, list[dict]]) -> int:
    """Distinct (replica, step) pairs committed: a step redone after a restart counts once."""
    return sum(len({row["step"] for row in rows}) for rows in steps.values())
