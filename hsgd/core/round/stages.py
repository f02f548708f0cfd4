"""The stages of a round: a cluster's (cluster.py) and the outer exchange's (outer.py). What is
derived from a stage is a property of it, never a set kept in step by hand."""
from __future__ import annotations

from enum import StrEnum


class ClusterStage(StrEnum):
    """Where a cluster is in its round (cluster.py)."""
    NEW = "new"  # the round has not started it yet
    HEAL = "heal"  # laggards copy state
    INNER = "inner"  # its inner phase runs (forming its group first when its members changed)
    AVERAGE = "average"  # inner `none`: the cluster's mean
    READY = "ready"  # done: waiting for the outer exchange
    REFORM = "reform"  # an outer retry broke it: it re-forms before the next exchange
    OUT = "out"  # it sits the round out (too few members, void, benched)

    @property
    def waits_for_outer(self) -> bool:
        """Nothing left to do before the outer exchange (ready, or sitting out)."""
        return self in (ClusterStage.READY, ClusterStage.OUT)


class OuterStage(StrEnum):
    """Where the outer exchange is (outer.py)."""
    WAIT = "wait"  # for every participating cluster to be ready
    REDUCE = "reduce"
    COMMIT = "commit"
    DONE = "done"
