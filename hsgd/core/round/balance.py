"""sync.balance=steps: each cluster's inner steps for one round, so no site idles at the outer sync
(and sync.balance=time's close: `close_after_s`; the machine's side is close.py).

Every round is `steps_per_round` (spr) inner steps in every cluster unless balanced. Balanced, a
cluster whose steps take t_c seconds runs

    n_c = clamp(round(spr * t_fastest / t_c), 1, spr)

steps, so its inner phase lasts about as long as the fastest cluster's spr steps (async Local-SGD,
arXiv 2401.09135: each worker its own number of local steps). t_c is the site's configured step
time when set (deterministic: a benchmark or a replay plans alike), else the cluster's learned
median; a cluster with neither runs spr. The outer mean weighs clusters by the tokens they trained
(hsgd.core.outer_plan.token_weights), so fewer steps count for less.

The plan is decided once, at the round's start, and recorded (durable state, a `round_plan`
event): a restarted supervisor follows the recorded plan of the round it resumes, never re-measures,
unless the round's clusters differ from the plan's (a site joined): then it is planned again.
A heal inside the round copies a member of the same cluster, so it lands on that cluster's plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """Round `round`'s inner steps per cluster, what they were planned from, and its origin:
    configured | learned | mixed | recorded (a restarted supervisor's, read back)."""

    round: int
    steps: tuple[int, ...]
    step_s: tuple[float | None, ...]
    source: str

    def to_dict(self) -> dict:
        return {"round": self.round, "steps": list(self.steps), "step_s": list(self.step_s), "source": self.source}

    @classmethod
    def from_dict(cls, raw: dict) -> StepPlan:
        return cls(
            int(raw["round"]),
            tuple(int(n) for n in raw["steps"]),
            tuple(None if s is None else float(s) for s in raw.get("step_s") or ()),
            "recorded",
        )


def plan_steps(steps_per_round: int, step_s: Sequence[float | None]) -> tuple[int, ...]:
    """The rule above: one step count per cluster, each in [1, steps_per_round]."""
    known = [s for s in step_s if s is not None and s > 0]
    if not known:
        return (steps_per_round,) * len(step_s)
    fastest = min(known)
    return tuple(
        steps_per_round
        if s is None or s <= 0  # (halves round up, never to even)
        else max(1, min(steps_per_round, math.floor(steps_per_round * fastest / s + 0.5)))
        for s in step_s
    )


def plan_round(
    round_index: int, steps_per_round: int, configured: Sequence[float | None], learned: Sequence[float | None]
) -> StepPlan:
    """Round `round_index`'s plan: each cluster's configured step time where set, else its learned one."""
    step_s = tuple(c if c is not None else m for c, m in zip(configured, learned, strict=True))
    used = {
        "configured" if c is not None else "learned" for c, s in zip(configured, step_s, strict=True) if s is not None
    }
    source = used.pop() if len(used) == 1 else "mixed" if used else "learned"
    return StepPlan(round_index, plan_steps(steps_per_round, step_s), step_s, source)


def plan_for_round(
    round_index: int,
    saved: dict | None,
    *,
    steps_per_round: int,
    configured: Sequence[float | None],
    learned: Sequence[float | None],
) -> tuple[StepPlan, bool]:
    """Round `round_index`'s plan and whether it is new (to be saved before any call). The saved plan is
    followed when it is this round's and covers exactly this round's clusters (`len(configured)`); a
    round retried after a site joined (below quorum, a restore) has one cluster more than its saved plan,
    so it is planned again (issue 45, finding 7), never indexed past its end."""
    if saved and saved.get("round") == round_index and len(saved.get("steps") or ()) == len(configured):
        return StepPlan.from_dict(saved), False
    return plan_round(round_index, steps_per_round, configured, learned), True


def close_after_s(
    round_s: float | None, steps_per_round: int, learned: Sequence[float | None], *, lead_s: float
) -> float | None:
    """sync.balance=time: when a round's inner phases close, in seconds after its start: `sync.round_s`
    when set, else the fastest cluster's learned seconds for the round's steps plus `lead_s` (a yield
    is asked that long ahead of the boundary it lands on); None while no cluster's step time is known
    (the round runs its steps, and the step times are learned)."""
    if round_s:
        return float(round_s)
    known = [s for s in learned if s is not None and s > 0]
    return min(known) * steps_per_round + lead_s if known else None


def fragment_delay_of(fragment_delay: int, steps: int, inner_every: int = 1) -> int:
    """sync.fragment_delay in a round of `steps` planned steps: clamped so the snapshot lies inside the
    round (at its start at the latest) and, under localsgd (`inner_every` > 1), moved back to the last
    step boundary where the members agree (an average, or the round's start)."""
    delay = min(fragment_delay, steps)
    return steps - (steps - delay) // inner_every * inner_every
