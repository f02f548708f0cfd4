"""A guard against a bad outer step: the model each outer step makes gets worse while every cluster's
own model gets better. That is the outer optimizer overshooting (too large a learning rate or
momentum for this many clusters and this H; DiLoCo's 0.7 / 0.9 were fitted to hundreds of outer
steps of 8 workers), not the data or the inner optimizer. The run says so once and changes nothing:
a user's setting is never changed behind their back.
"""
from __future__ import annotations

from typing import Mapping


class OuterStepWatch:
    """Feed it every evaluated round: `observe` returns the warning's text the first time the global
    eval loss rose across two outer steps in a row (three evaluations, each higher) while every
    cluster's own mean training loss fell across the same rounds; None otherwise, and always after."""

    def __init__(self, knobs: str):
        self.knobs = knobs  # e.g. "optim.outer.lr=0.7, optim.outer.momentum=0.9, nesterov=True"
        self.seen: list[tuple[int, float, dict[int, float]]] = []  # (round, eval loss, cluster -> train loss)
        self.fired = False

    def observe(self, round_index: int, eval_loss: float | None, cluster_loss: Mapping[int, float]) -> str | None:
        if self.fired or eval_loss is None or not cluster_loss:
            return None
        self.seen = (self.seen + [(round_index, float(eval_loss), dict(cluster_loss))])[-3:]
        if len(self.seen) < 3:
            return None
        (r0, e0, l0), (_, e1, l1), (r2, e2, l2) = self.seen
        clusters = set(l0) & set(l1) & set(l2)
        if not (e0 < e1 < e2) or not clusters or not all(l0[c] > l1[c] > l2[c] for c in clusters):
            return None
        self.fired = True
        return (f"the global eval loss rose across two outer steps in a row ({e0:.4f} -> {e1:.4f} -> {e2:.4f}, "
                f"rounds {r0}..{r2}) while every cluster's own training loss fell: the outer step overshoots; "
                f"try a smaller optim.outer.lr or optim.outer.momentum (now {self.knobs})")


def cluster_losses(replica_loss: Mapping[str, float], cluster_of) -> dict[int, float]:
    """Each cluster's mean of its replicas' mean training loss in a round (metrics' `replica_loss`)."""
    by_cluster: dict[int, list[float]] = {}
    for rid, loss in replica_loss.items():
        by_cluster.setdefault(cluster_of(rid), []).append(float(loss))
    return {c: sum(v) / len(v) for c, v in by_cluster.items()}
