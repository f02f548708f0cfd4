"""Who serves each replica id, who is live, and which process groups they still hold: the
supervisor's view of its replicas between (and across) rounds.

It asks replicas for their progress (the control channel, which answers while a phase runs),
brings back replicas that (re)started, hands a dead replica's id to a ready hot spare, and marks a
replica down when it does not answer. A new process under an id holds no group: its cluster's
inner group (and, for a leader, the outer group) must be configured again. The decisions about
what a round does with this view are hsgd.core.round's; "stuck after a supervisor restart" is
hsgd.core.deadlines.StallWatch's.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from actors.spares import SparePool
from hsgd.core.deadlines import StallWatch
from hsgd.core.membership import Plan, live_plan
from hsgd.core.topology import Topology


def replica_actor_name(run_id: str, rid: str) -> str:
    return f"hsgd:{run_id}:{rid}"


def spare_actor_name(run_id: str, cluster: int, k: int) -> str:
    return f"hsgd:{run_id}:spare-c{cluster}-{k}"


def lookup(name: str):
    """The actor of that name, or None (a restarted supervisor finds a replica that died for good)."""
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def restarts_exhausted(handle) -> bool:
    """`gone` only when Ray's actor table says DEAD (no restart will come): Ray also raises
    ActorDiedError for an actor it is about to restart."""
    try:
        from ray._private.state import state as gcs

        info = gcs.actor_table(handle._actor_id.hex())
        return info.get("State") == "DEAD"
    except Exception:  # noqa: BLE001 — the table is best effort; assume it may come back
        return False


class Roster:
    """`durable`: the supervisor's durable dict; the identity map (`identity`: rid -> actor name)
    and the spare pool's names live in it, so a restarted supervisor finds the same actors."""

    def __init__(self, topology: Topology, run_id: str, durable: dict, log, *, call_timeout_s: float,
                 spares_per_cluster: int, save: Callable[[], None]):
        self.topology, self.log, self.call_timeout_s, self._save = topology, log, call_timeout_s, save
        # which actor serves which replica id (a hot spare that took over serves a dead one's id)
        self.names: dict[str, str] = durable.setdefault(
            "identity", {rid: replica_actor_name(run_id, rid) for rid in topology.replica_ids()})
        self.spares = SparePool(durable.setdefault(
            "spares", {str(c): [spare_actor_name(run_id, c, k) for k in range(spares_per_cluster)]
                       for c in range(topology.clusters)}), lookup)
        self.handles = {rid: lookup(name) for rid, name in self.names.items()}
        self.gone = {rid for rid, h in self.handles.items() if h is None}  # restarts exhausted
        self.live: dict[str, tuple[int, int]] = {}  # rid -> committed (round, step)
        self.param_bytes = 0  # model size, as replicas report it: scales heal and collective deadlines
        self.pids: dict[str, int] = {}
        self.replica_info: dict[str, dict] = {}  # rid -> {pid, node_id}: for stack dumps
        # the groups formed last round, handed to the next round's machine
        self.leaders: dict[int, str] = {}
        self.configured: dict[int, tuple] = {}
        self.outer_configured = None

    # -- questions ------------------------------------------------------------------------------------
    def missing(self) -> list[str]:
        return [rid for rid in self.topology.replica_ids() if rid not in self.live and rid not in self.gone]

    def plan(self, epoch: int) -> Plan:
        """The live view for fault targeting and status (outside a round)."""
        return live_plan(self.topology, self.live, self.leaders, epoch)

    def probe(self, rid: str, timeout_s: float) -> dict | None:
        """Ask a replica for its progress; None if it does not answer in time or is gone."""
        if rid in self.gone:
            return None
        try:
            return ray.get(self.handles[rid].progress.remote(), timeout=timeout_s)
        except ActorDiedError:
            if restarts_exhausted(self.handles[rid]):
                self.gone.add(rid)
            return None
        except (ActorUnavailableError, RayActorError, GetTimeoutError):
            return None

    def ask_all(self, method: str, timeout_s: float) -> dict[str, Any]:
        """Every live replica's answer to a no-argument call; those that fail are left out."""
        refs = {rid: getattr(self.handles[rid], method).remote() for rid in sorted(self.live)}
        out = {}
        for rid, ref in refs.items():
            try:
                out[rid] = ray.get(ref, timeout=timeout_s)
            except Exception:  # noqa: BLE001 — a replica lost meanwhile: its answer is absent
                pass
        return out

    # -- changes --------------------------------------------------------------------------------------
    def admit(self, rid: str, answer: dict) -> None:
        self.live[rid] = (int(answer["round"]), int(answer["step"]))
        self.param_bytes = max(self.param_bytes, int(answer.get("param_bytes") or 0))
        self.note_up(rid, answer)

    def note_up(self, rid: str, answer: dict) -> None:
        self.replica_info[rid] = {"pid": answer.get("pid"), "node_id": answer.get("node_id")}
        if rid in self.pids and self.pids[rid] != answer.get("pid"):
            self._forget_groups(rid)  # a new process holds no group
        if self.pids.get(rid) != answer.get("pid"):
            self.pids[rid] = answer.get("pid")
            self.log.event("replica_up", rid=rid, round=answer["round"], step=answer["step"], pid=answer.get("pid"))

    def down(self, rid: str, cause: str, phase: str, round_index: int, detail: str = "") -> None:
        if cause == "error":  # the replica raised: restart it clean, as any failed replica
            try:
                ray.kill(self.handles[rid], no_restart=False)
            except Exception:  # noqa: BLE001 — already gone
                pass
        if self.live.pop(rid, None) is not None:
            self.log.event("replica_down", rid=rid, cluster=self.topology.cluster_of(rid), cause=cause,
                           phase=phase, round=round_index, detail=detail[:300])
            self._forget_groups(rid)

    def down_after(self, rid: str, err: BaseException, phase: str, round_index: int) -> None:
        """A call to rid raised: Ray says it died, or the replica itself raised."""
        self.down(rid, "died" if isinstance(err, RayActorError) else "error", phase, round_index, str(err))

    def _forget_groups(self, rid: str) -> None:
        c = self.topology.cluster_of(rid)
        self.configured.pop(c, None)
        if self.leaders.get(c) == rid:
            del self.leaders[c]
            self.outer_configured = None

    def refresh(self) -> None:
        """Every live replica's committed (round, step); those that do not answer are down."""
        refs = {rid: self.handles[rid].progress.remote() for rid in sorted(self.live)}
        for rid, ref in refs.items():
            try:
                self.admit(rid, ray.get(ref, timeout=self.call_timeout_s))
            except Exception as err:  # noqa: BLE001 — any failure to answer means down
                self.down(rid, "died", "progress", -1, type(err).__name__)

    def rejoin(self, wait_s: float) -> None:
        """Round boundary: bring back replicas that (re)started, waiting up to wait_s for them."""
        deadline = time.monotonic() + wait_s
        while True:
            for rid in self.missing():
                answer = self.probe(rid, min(2.0, max(0.2, deadline - time.monotonic())))
                if answer is not None:  # one still in a phase of a dead supervisor: await_idle waits
                    self.admit(rid, answer)
            if not self.missing() or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def promote_spare(self, rid: str, wait_s: float = 0.0) -> dict | None:
        """A ready spare of rid's cluster takes over rid (the dead actor becomes a spare once back).
        Returns the spare's progress: it joins like any restarted replica. None: no spare ready."""
        if not self.spares:
            return None
        self.spares.check(self.log)
        if not self.spares.ready and wait_s > 0:
            self.spares.check(self.log, wait_s=wait_s)  # between rounds: give pending answers a moment
        taken = self.spares.promote(rid, self.topology.cluster_of(rid), self.handles[rid], self.names[rid],
                                    self.call_timeout_s)
        if taken is None:
            return None
        name, handle, answer = taken
        self.log.event("spare_promoted", rid=rid, spare=name, replaced=self.names[rid], pid=answer.get("pid"))
        self.names[rid], self.handles[rid] = name, handle
        self.gone.discard(rid)
        self._save()
        return answer

    def await_idle(self, stuck_after_s: float, show: Callable[[list[str]], None], period_s: float) -> None:
        """After a supervisor restart, replicas may still run a phase of the old one (the inner
        phase goes on to the round's end). Wait while they advance; kill one stuck in a phase."""
        watch = StallWatch(stuck_after_s)
        while True:
            busy = []
            for rid in list(self.live):
                answer = self.probe(rid, self.call_timeout_s)
                if answer is None:
                    self.down(rid, "died", "await_idle", -1)
                elif answer.get("phase", "idle") == "idle":
                    self.admit(rid, answer)
                elif watch.stuck(rid, answer["step"], time.monotonic()):
                    self.log.event("kill", rid=rid, reason=f"stuck in {answer.get('phase')} after a supervisor restart")
                    ray.kill(self.handles[rid], no_restart=False)
                    self.down(rid, "hung", answer.get("phase", "?"), answer.get("round", -1))
                else:
                    busy.append(rid)
            if not busy:
                return
            show(busy)
            time.sleep(period_s)
