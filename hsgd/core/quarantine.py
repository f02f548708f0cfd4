"""A replica that keeps dying is set aside: the rule (the supervisor's actors/quarantine.py applies it).

A replica restarted in place after every death costs its cluster a re-form each time; a bad GPU or
a flaky node makes it die again and again until `faults.max_restarts` runs out. So: a replica that
died `faults.quarantine_after` times within `faults.quarantine_window_s` is quarantined — re-created
as a new actor away from the node it last died on when another node can hold it (its count starts
again there), else kept out for the rest of the run (its cluster goes on smaller, or sits out below
its quorum floor). `quarantine_after` 0 turns it off.
"""

from __future__ import annotations


def recent_deaths(times: list[float], now: float, window_s: float) -> list[float]:
    """The deaths (wall-clock times) still inside the window, oldest first."""
    return sorted(t for t in times if now - t <= window_s)


def quarantine_due(times: list[float], now: float, *, after: int, window_s: float) -> bool:
    """True when the replica with deaths at `times` is to be quarantined now."""
    return after > 0 and len(recent_deaths(times, now, window_s)) >= after
