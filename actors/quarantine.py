"""Quarantine, carried out (the rule: hsgd/core/quarantine.py; docs/sites.md, "Quarantine"): a replica
killed for good is re-created as a new actor pinned to another node of its site's label (Ray restarts
an actor with its original options, so only a new actor can leave the node). It rejoins as any
restarted replica. The new actor is detached, as an added site's: a restarted supervisor finds it by
the name in the durable identity map (Ray ends a non-detached actor with its owner); the driver
stops it at the run's end (`stop_moved`). A quarantined id takes no hot spare (hsgd.core.quarantine
`takes_spare`): a spare of its cluster may sit on the very node it left.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import ray
from omegaconf import OmegaConf
from ray._private.state import available_resources_per_node
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.placement import quarantine_node, rank_resources, replica_resources
from actors.roster import lookup, replica_actor_name
from hsgd.core.quarantine import DeathLog
from hsgd.record.run_state import RunState


def moved_actor_name(run_id: str, rid: str, move: int) -> str:
    """The actor serving rid after its `move`-th quarantine move."""
    return f"{replica_actor_name(run_id, rid)}-q{move}"


class Quarantine:
    """`state`: the durable RunState (`death_times`, `quarantined`); `roster`: the Roster whose
    actors it replaces; `injected(rid)`: an injected fault explains rid's latest death."""

    def __init__(
        self,
        cfg,
        run_id: str,
        run_dir: str,
        state,
        roster,
        log,
        save,
        injected: Callable[[str], bool] = lambda rid: False,
    ):
        self.cfg, self.run_id, self.run_dir, self.injected = cfg, run_id, run_dir, injected
        self.state, self.roster, self.log, self._save = state, roster, log, save
        self.after, self.window_s = int(cfg.faults.quarantine_after), float(cfg.faults.quarantine_window_s)
        self.deaths = DeathLog(  # a predecessor's count: own deaths, their nodes no longer needed
            after=self.after,
            window_s=self.window_s,
            node_loss_window_s=float(cfg.faults.node_loss_window_s),
            deaths=[(float(t), None, rid) for rid, times in state.death_times.items() for t in times],
        )
        self.told: set[tuple[str, float]] = set()  # node losses said on the console

    def death(self, rid: str) -> None:
        """rid's process died (each death once, as the roster logs it). Counted against rid unless
        replicas of its node die with it (hsgd/core/quarantine.py: a node loss is the node's)."""
        kept_out = rid in self.state.quarantined and self.state.quarantined[rid].get("moved_to") is None
        if self.after <= 0 or kept_out or self.injected(rid):
            return
        now, node = time.time(), (self.roster.replica_info.get(rid) or {}).get("node_id")
        due = self.deaths.died(now, node, rid)
        for loss in self.deaths.losses():
            if (loss.node, loss.t) in self.told:
                continue
            self.told.add((loss.node, loss.t))
            print(
                f"[hsgd] {', '.join(loss.rids)} of node {loss.node[:8]} died within "
                f"{self.deaths.node_loss_window_s:g} s of each other: the node's death, counted against none of them",
                flush=True,
            )
        own = {r: self.deaths.own(r, now) for r in {d[2] for d in self.deaths.deaths}}
        self.state.death_times = {r: times for r, times in own.items() if times}
        if due:
            self._set_aside(rid, node, len(own[rid]))
        self._save()

    def _set_aside(self, rid: str, node: str | None, deaths: int) -> None:
        with contextlib.suppress(Exception):  # already gone for good
            ray.kill(self.roster.handles[rid], no_restart=True)
        backends = (self.roster.replica_info.get(rid) or {}).get("backends") or {"inner": "gloo", "outer": "gloo"}
        gpus = 1.0 if "nccl" in backends.values() else 0.0
        resources = replica_resources(self.cfg, gpus)  # room for the whole replica (its k ranks) on one node
        topo = self.roster.topology
        target = quarantine_node(
            ray.nodes(),
            available_resources_per_node(),  # room for one replica now
            resources,
            away_from=node,
            label=topo.label(topo.cluster_of(rid)),
        )
        moves = int((self.state.quarantined.get(rid) or {}).get("moves", 0)) + 1
        if target is None:
            self.roster.set_aside(rid)
        else:
            name = moved_actor_name(self.run_id, rid, moves)
            from actors.startup import start_replica

            rank = rank_resources(self.cfg, gpus)  # each of its k ranks asks one rank's, pinned to that node
            options = {
                "num_cpus": rank["CPU"],
                "num_gpus": rank.get("GPU", 0),
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=target, soft=False),
            }
            handle = start_replica(
                OmegaConf.to_container(self.cfg, resolve=True),
                name,
                options,
                rid,
                self.run_dir,
                backends,
                index_table=self.state.replica_indices,
                lifetime="detached",  # as an added site's: it outlives this supervisor; `stop_moved` ends it
            )
            self.roster.replace(rid, name, handle)
            self.deaths.forget(rid)  # a fresh count on the new node
            self.state.death_times.pop(rid, None)
        self.state.quarantined[rid] = {"node": node, "moved_to": target, "moves": moves, "t": time.time()}
        self.log.event(
            "replica_quarantined", rid=rid, node=node, moved_to=target, deaths=deaths, window_s=self.window_s
        )
        where = (
            f"re-created on node {target[:8]}"
            if target
            else "kept out for the rest of the run (no other node holds it)"
        )
        print(
            f"[hsgd] {rid} quarantined after {deaths} deaths in {self.window_s:g} s on node "
            f"{(node or '?')[:8]}: {where}",
            flush=True,
        )


def stop_moved(run_dir: str, run_id: str) -> None:
    """The run's end (the driver, beside actors.site_changes.stop_joined_sites): every actor quarantine
    re-created is detached, so it outlives its supervisor and is stopped here, best effort (one already
    gone is none). Earlier moves of one id were killed when it moved again: their lookups find none."""
    state = RunState.read(run_dir)
    if state.run_id != run_id:
        return  # another run's state: not ours to stop
    for rid, record in state.quarantined.items():
        for move in range(1, int(record.get("moves", 0)) + 1):
            handle = lookup(moved_actor_name(run_id, rid, move))
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
