"""The driver's rule for the supervisor's deaths: count deaths, not the errors one death causes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossVerdict:
    new_loss: bool  # this error is a supervisor death not counted before
    gone: bool  # give up: restarts exhausted, or the restart did not come back in time
    reason: str = ""


class SupervisorLosses:
    """One death surfaces as several errors (the `run` call in flight, then calls re-issued before
    Ray noticed), so a loss is counted once per incarnation (`supervisor_starts` in the durable
    state). Gone: more deaths than `max_restarts` (-1: forever, as Ray means it), or no new
    incarnation within `restart_wait_s` of a death."""

    def __init__(self, max_restarts: int, *, restart_wait_s: float):
        self.max_restarts, self.restart_wait_s = max_restarts, restart_wait_s
        self.count = 0
        self._counted_start: int | None = None  # the incarnation whose death was counted last
        self._down_since = 0.0

    def on_error(self, starts: int, now: float) -> LossVerdict:
        if starts != self._counted_start:
            self.count, self._counted_start, self._down_since = self.count + 1, starts, now
            if self.max_restarts != -1 and self.count > self.max_restarts:
                return LossVerdict(
                    True,
                    True,
                    f"supervisor lost {self.count} times (supervisor.max_restarts={self.max_restarts} exhausted)",
                )
            return LossVerdict(True, False)
        if now - self._down_since > self.restart_wait_s:
            return LossVerdict(
                False,
                True,
                f"supervisor did not come back within {self.restart_wait_s:g} s "
                f"(supervisor.call_timeout_s) of its death {self.count}",
            )
        return LossVerdict(False, False)
