"""A clock that moves only when told (or when something sleeps on it): patched over a module's
`time`, a test checks when a deadline fires in the module's own seconds, not the machine's."""

from __future__ import annotations


class FakeClock:
    """Stands in for the `time` module: monotonic/perf_counter/time read `now`; sleep(s) records s
    and moves `now` on by it."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(0.0, seconds)
