"""A guard against a bad outer step: the model each outer step makes gets worse while every cluster's
own model gets better. That is the outer optimizer overshooting (too large a learning rate or
momentum for this many clusters and this H; DiLoCo's 0.7 / 0.9 were fitted to hundreds of outer
steps of 8 workers), not the data or the inner optimizer. The run says so once and changes nothing:
a user's setting is never changed behind their back.
"""

from __future__ import annotations

from collections.abc import Mapping


class OuterStepWatch:
    """Feed it every committed round: `observe` returns the warning's text the first time the global
    eval loss rose across two outer steps in a row (three evaluations, each higher) while, in both
    of those rounds, every cluster's own training loss fell over the round's inner steps (the inner
    phase improves each model, the outer step undoes it); None otherwise, and always after."""

    def __init__(self, knobs: str):
        self.knobs = knobs  # e.g. "optim.outer.lr=0.7, optim.outer.momentum=0.9, nesterov=True"
        # evaluated rounds: (round, eval loss, cluster -> (early, late) training loss in that round)
        self.seen: list[tuple[int, float, dict[int, tuple[float, float]]]] = []
        self.fired = False

    def observe(
        self, round_index: int, eval_loss: float | None, cluster_trend: Mapping[int, tuple[float, float]]
    ) -> str | None:
        if self.fired or eval_loss is None:
            return None
        self.seen = (self.seen + [(round_index, float(eval_loss), dict(cluster_trend))])[-3:]
        if len(self.seen) < 3:
            return None
        (r0, e0, _), (_, e1, t1), (r2, e2, t2) = self.seen
        inner_fell = all(t and all(late < early for early, late in t.values()) for t in (t1, t2))
        if not (e0 < e1 < e2) or not inner_fell:
            return None
        self.fired = True
        return (
            f"the global eval loss rose across two outer steps in a row ({e0:.4f} -> {e1:.4f} -> {e2:.4f}, "
            f"rounds {r0}..{r2}) while every cluster's own training loss fell inside those rounds: the outer "
            f"step overshoots; try a smaller optim.outer.lr or optim.outer.momentum (now {self.knobs})"
        )


def cluster_trends(losses: Mapping[str, list[float]], cluster_of) -> dict[int, tuple[float, float]]:
    """Each cluster's training loss early and late in a round: the mean over its replicas of the mean of
    their first and of their last third of step losses (replicas with fewer than 2 steps left out)."""
    by_cluster: dict[int, list[tuple[float, float]]] = {}
    for rid, steps in losses.items():
        if len(steps) >= 2:
            k = max(1, len(steps) // 3)
            by_cluster.setdefault(cluster_of(rid), []).append((sum(steps[:k]) / k, sum(steps[-k:]) / k))
    return {
        c: (sum(early for early, _ in v) / len(v), sum(late for _, late in v) / len(v)) for c, v in by_cluster.items()
    }
