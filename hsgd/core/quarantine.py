"""A replica that keeps dying is set aside: the rule (the supervisor's actors/quarantine.py applies it).

A replica restarted in place after every death costs its cluster a re-form each time; a bad GPU or
a flaky node makes it die again and again until `faults.max_restarts` runs out. So: a replica that
died `faults.quarantine_after` times within `faults.quarantine_window_s` is quarantined — re-created
as a new actor away from the node it last died on when another node can hold it (its count starts
again there), else kept out for the rest of the run (its cluster goes on smaller, or sits out below
its quorum floor). `quarantine_after` 0 turns it off.

Only a replica's own deaths count. Replicas of one node dying together — each within
`faults.node_loss_window_s` of the previous (a raylet crash or an OOM kills a node's actors within
a second or two of each other) — are one death of the node (`node_losses`), counted against none
of them: the node is the culprit, and moving one replica away would not help the others. Such
deaths are left to Ray (restarts, bounded by `faults.max_restarts`) and to the round machine: on a
one-node run there is nowhere to move, and setting every replica aside would end the run in
`quorum lost` where a restore from the checkpoint is due. A death is judged on the deaths known when
it is reported: the first replica reported of a node loss counts it as its own until a second one
joins it, so a replica is never quarantined for node losses alone (it needs `after - 1` of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Death = tuple[float, str | None, str]  # (wall-clock time, node id — None when unknown —, replica id)


def recent_deaths(times: list[float], now: float, window_s: float) -> list[float]:
    """The deaths (wall-clock times) still inside the window, oldest first."""
    return sorted(t for t in times if now - t <= window_s)


def quarantine_due(times: list[float], now: float, *, after: int, window_s: float) -> bool:
    """True when the replica with deaths at `times` is to be quarantined now."""
    return after > 0 and len(recent_deaths(times, now, window_s)) >= after


def takes_spare(rid: str, quarantined: Mapping[str, dict]) -> bool:
    """May a hot spare take over rid? Not once quarantined: moved, its own actor serves it on the node
    quarantine chose (a spare of its cluster's placement group may sit on the very node it left, and
    promoting one would make the moved actor a spare: the move undone); kept out, it stays out."""
    return rid not in quarantined


@dataclass(frozen=True)
class NodeLoss:
    """Replicas of `node` that died together, from `t` (the first death's time): one death of the node."""

    node: str
    t: float
    rids: tuple[str, ...]  # sorted, each once


def _node_runs(deaths: Iterable[Death], window_s: float) -> list[list[Death]]:
    """The node losses' deaths: those of one known node, each within window_s of the previous, when
    they are of two replicas or more (one replica dying twice quickly is its own crash loop)."""
    if window_s <= 0:
        return []
    runs: list[list[Death]] = []
    for d in sorted((d for d in deaths if d[1] is not None), key=lambda d: (d[1], d[0])):
        if runs and runs[-1][-1][1] == d[1] and d[0] - runs[-1][-1][0] <= window_s:
            runs[-1].append(d)
        else:
            runs.append([d])
    return [run for run in runs if len({rid for *_, rid in run}) > 1]


def node_losses(deaths: Iterable[Death], window_s: float) -> list[NodeLoss]:
    """The node losses among `deaths`, oldest first (window_s 0: none)."""
    losses = [
        NodeLoss(str(run[0][1]), run[0][0], tuple(sorted({d[2] for d in run}))) for run in _node_runs(deaths, window_s)
    ]
    return sorted(losses, key=lambda loss: loss.t)


def own_deaths(deaths: Iterable[Death], window_s: float) -> dict[str, list[float]]:
    """Each replica's own deaths (times, oldest first): all but those of a node loss (`node_losses`,
    with the same window_s). Replicas with none are absent."""
    deaths = list(deaths)
    of_nodes = {d for run in _node_runs(deaths, window_s) for d in run}
    own: dict[str, list[float]] = {}
    for t, _, rid in sorted((d for d in deaths if d not in of_nodes), key=lambda d: d[0]):
        own.setdefault(rid, []).append(t)
    return own


class DeathLog:
    """Deaths as the supervisor learns them, one at a time, and whether the replica is due for quarantine.
    The simulation and actors/quarantine.py keep one each; `own` is what the durable state keeps."""

    def __init__(self, *, after: int, window_s: float, node_loss_window_s: float, deaths: Iterable[Death] = ()):
        self.after, self.window_s, self.node_loss_window_s = after, window_s, node_loss_window_s
        self.deaths: list[Death] = sorted(deaths, key=lambda d: d[0])

    def died(self, t: float, node: str | None, rid: str) -> bool:
        """rid died at t on node (None: unknown): True when it is due for quarantine now (its own
        deaths in the window reach `after`, this one included unless a node loss already holds it)."""
        keep_s = self.window_s + self.node_loss_window_s  # what still counts, and what a node loss may join
        self.deaths = [d for d in self.deaths if t - d[0] <= keep_s] + [(t, node, rid)]
        return quarantine_due(self.own(rid, t), t, after=self.after, window_s=self.window_s)

    def own(self, rid: str, now: float) -> list[float]:
        """rid's own deaths within the quarantine window at `now`, oldest first."""
        return recent_deaths(own_deaths(self.deaths, self.node_loss_window_s).get(rid, []), now, self.window_s)

    def forget(self, rid: str) -> None:
        """rid starts a fresh count (re-created on another node)."""
        self.deaths = [d for d in self.deaths if d[2] != rid]

    def losses(self) -> list[NodeLoss]:
        return node_losses(self.deaths, self.node_loss_window_s)
