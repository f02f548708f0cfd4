"""The supervisor's view of its replicas between (and across) rounds: who serves each replica id,
who is live, which process groups they still hold. A new process under an id holds no group: its
cluster's groups must be configured again. Deaths are logged here, each once (ActorWatch).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import ray
from ray._private.state import state as gcs
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.lifecycle import ActorWatch
from actors.spares import SparePool
from hsgd.core.deadlines import HUNG, IDLE, STUCK, StallWatch, collective_timeout_s
from hsgd.core.membership import Plan, live_plan
from hsgd.core.outer_plan import holds_outer_group
from hsgd.core.phases import MOVES_STATE, Phase
from hsgd.core.round import PhaseAnswer
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState

AWAIT_PASS_S = 3.0  # await_idle: the longest one pass waits for the replicas' answers


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
    """DEAD in Ray's actor table (no restart comes): Ray raises ActorDiedError for one about to restart too."""
    try:
        return gcs.actor_table(handle._actor_id.hex()).get("State") == "DEAD"
    except Exception:  # noqa: BLE001 — the table is best effort; assume it may come back
        return False


class Roster:
    """`state`: durable (identity map, spare names, deaths seen), so a restarted supervisor finds the same actors."""

    def __init__(
        self,
        topology: Topology,
        run_id: str,
        state: RunState,
        log,
        *,
        call_timeout_s: float,
        spares_per_cluster: int,
        save: Callable[[], None],
    ):
        self.topology, self.log, self.call_timeout_s, self._save = topology, log, call_timeout_s, save
        if not state.identity:  # the first supervisor: the actors the driver started
            state.identity.update({rid: replica_actor_name(run_id, rid) for rid in topology.replica_ids()})
            state.spares.update(
                {
                    str(c): [spare_actor_name(run_id, c, k) for k in range(spares_per_cluster)]
                    for c in range(topology.clusters)
                }
            )
        self.names: dict[str, str] = state.identity
        self.spares = SparePool(state.spares, lookup)
        self.watch = ActorWatch(self.names, self.spares.names, state.deaths_seen, save=save)
        self.handles = {rid: lookup(name) for rid, name in self.names.items()}
        self.gone = {rid for rid, h in self.handles.items() if h is None}  # restarts exhausted
        self.live: dict[str, tuple[int, int]] = {}  # rid -> committed (round, step)
        self.param_bytes = 0  # model size, as replicas report it: scales heal and collective deadlines
        self.tokens_per_step = 0  # a replica's tokens per inner step, as replicas report it (the record's counts)
        self.pids: dict[str, int] = {}  # rid -> the pid that last answered up
        self.replica_info: dict[str, dict] = {}  # rid -> {node_id, backends}: for stack dumps and quarantine
        # the groups formed last round, handed to the next round's machine
        self.leaders: dict[int, str] = {}
        self.configured: dict[int, tuple] = {}
        self.outer_configured = None
        self.on_death: Callable[[str], None] = lambda rid: None  # each replica death, once (quarantine)
        self.drained_clusters: set[int] = set()  # stopped on purpose (actors/site_changes.py): their deaths are none
        # sync.balance=time: rid -> (the ref of its call given up on when its cluster was late, since when): it is
        # live but held out of every round until that call ends (`available`)
        self.late: dict[str, tuple[Any, float]] = {}

    def available(self, stuck_after_s: float) -> dict[str, tuple[int, int]]:
        """The live replicas a round may call. One whose late call ended is back at the position it answered
        (behind: it heals); one whose call still runs is held out, unless it ran past `stuck_after_s` since
        it was given up on: then it is hung, and killed restartable like any hung replica."""
        for rid, (ref, since) in list(self.late.items()):
            if rid not in self.live:
                del self.late[rid]
            elif ray.wait([ref], timeout=0, fetch_local=False)[0]:
                del self.late[rid]
                try:
                    answer = PhaseAnswer.read(ray.get(ref, timeout=self.call_timeout_s))
                except RayActorError:  # its process is gone: the actor table tells the rest
                    self.down(rid, "died", "late", -1)
                    continue
                except Exception as err:  # noqa: BLE001 — it raised: its own failure, restarted clean
                    self.down(rid, "error", "late", -1, f"{type(err).__name__}: {err}")
                    continue
                if answer.round >= 0:
                    self.live[rid] = (answer.round, answer.step)
            elif time.monotonic() - since > stuck_after_s:
                del self.late[rid]
                self.log.event("kill", rid=rid, reason=f"late call still running {stuck_after_s:.0f}s after its round")
                with contextlib.suppress(Exception):  # already gone: Ray restarts it anyway
                    ray.kill(self.handles[rid], no_restart=False)
                self.down(rid, "hung", "late", -1)
        return {rid: p for rid, p in self.live.items() if rid not in self.late}

    def missing(self) -> list[str]:
        return [rid for rid in self.topology.replica_ids() if rid not in self.live and rid not in self.gone]

    def plan(self, epoch: int) -> Plan:
        """The live view for fault targeting and status (outside a round)."""
        return live_plan(self.topology, self.live, self.leaders, epoch)

    def probe(self, rid: str, timeout_s: float) -> dict | None:
        """Ask a replica for its progress; None if it does not answer in time or is gone."""
        return self._ask_progress([rid], {}, timeout_s).get(rid, (None, True))[0]

    def ask_all(self, method: str, timeout_s: float, *, down: str | None = None) -> dict[str, Any]:
        """Every live replica's answer to a no-argument call; one that fails is left out (`down`: marked down).
        One held out by its late call is not asked (a paused process would answer nothing)."""
        refs = {rid: getattr(self.handles[rid], method).remote() for rid in sorted(self.live) if rid not in self.late}
        out = {}
        for rid, ref in refs.items():
            try:
                out[rid] = ray.get(ref, timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 — a replica lost meanwhile: its answer is absent
                if down is not None:
                    self.down(rid, "died", down, -1, type(err).__name__)
        return out

    def admit(self, rid: str, answer: dict) -> None:
        self.live[rid] = (int(answer["round"]), int(answer["step"]))
        self.param_bytes = max(self.param_bytes, int(answer.get("param_bytes") or 0))
        self.tokens_per_step = max(self.tokens_per_step, int(answer.get("tokens_per_step") or 0))
        self.note_up(rid, answer)

    def note_up(self, rid: str, answer: dict) -> None:
        self.replica_info[rid] = {"node_id": answer.get("node_id"), "backends": answer.get("backends")}
        self.watch.note_up(rid, answer.get("incarnation"))
        if rid in self.pids and self.pids[rid] != answer.get("pid"):
            self._forget_groups(rid)  # a new process holds no group
        if self.pids.get(rid) != answer.get("pid"):
            self.pids[rid] = answer.get("pid")
            self.log.event(
                "replica_up",
                rid=rid,
                round=answer["round"],
                step=answer["step"],
                pid=answer.get("pid"),
                incarnation=answer.get("incarnation"),
                replica_index=answer.get("replica_index"),
            )

    def down(self, rid: str, cause: str, phase: str, round_index: int, detail: str = "") -> None:
        if cause == "error":  # the replica raised: restart it clean, as any failed replica
            self.restart_raised(rid, phase, round_index, detail)
        if self.live.pop(rid, None) is not None:
            self.died(rid, cause, phase, round_index, detail)
            self._forget_groups(rid)

    def restart_raised(self, rid: str, phase: str | None, round_index: int, detail: str = "") -> None:
        """rid raised in a phase: its `replica_down` (cause `error`) is logged *before* the kill, so
        Ray's actor table does not report the kill first as a plain death; Ray restarts it clean."""
        self.died(rid, "error", phase, round_index, detail)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.handles[rid], no_restart=False)

    def died(self, rid: str, cause: str, phase: str | None, round_index: int, detail: str = "") -> bool:
        """The process serving rid died (or was killed), learned from a call: its `replica_down`,
        unless the watch already reported that death (ActorWatch.note_death). True if logged."""
        dead = self.watch.note_death(rid)
        if dead is None:
            return False  # the watch saw this death first: logged then
        actor, incarnation = dead
        self.log.event(
            "replica_down",
            rid=rid,
            cluster=self.topology.cluster_of(rid),
            cause=cause,
            phase=phase,
            round=round_index,
            detail=detail[:300],
            incarnation=incarnation,
            actor=actor,
        )
        self.on_death(rid)
        return True

    def deaths(self, live, round_index: int, phase: str | None) -> list[str]:
        """Every death Ray's actor table shows since the last look, logged once (`replica_down`, or a
        spare's `spare_lost`). Returns the replicas whose latest known process died (for the round
        machine). `phase`: what one in `live` was doing; another died `joining` or `restarting`."""
        lost = []
        for d in self.watch.poll():
            if (self.topology.cluster_of(d.rid) if d.rid else d.cluster) in self.drained_clusters:
                continue  # drained: stopped on purpose, no failure
            if d.rid is None:
                self.spares.ready.discard(d.name)  # not ready until it answers again
                self.log.event(
                    "spare_lost",
                    cluster=d.cluster,
                    spare=d.name,
                    incarnation=d.incarnation,
                    round=round_index,
                    state=d.state,
                )
                continue
            latest = self.watch.latest(d)
            where = phase if d.rid in live and latest else "joining" if self.watch.answered(d) else "restarting"
            self.log.event(
                "replica_down",
                rid=d.rid,
                cluster=self.topology.cluster_of(d.rid),
                cause="died",
                phase=where,
                round=round_index,
                detail=f"Ray's actor table: {d.state}",
                incarnation=d.incarnation,
                actor=d.name,
            )
            self.on_death(d.rid)
            if latest:
                lost.append(d.rid)
        return lost

    def table_tells(self, rid: str) -> bool:
        """Ray's actor table, read every tick, shows a death or restart of the process serving rid."""
        return self.watch.tells(self.names.get(rid))

    def down_after(self, rid: str, err: BaseException, phase: str, round_index: int) -> None:
        self.down(rid, "died" if isinstance(err, RayActorError) else "error", phase, round_index, str(err))

    def _forget_groups(self, rid: str) -> None:
        c = self.topology.cluster_of(rid)
        self.configured.pop(c, None)
        if self.leaders.get(c) == rid:
            del self.leaders[c]
        if holds_outer_group(self.outer_configured, rid):
            self.outer_configured = None  # a shard holder's (the leader's) outer group is gone

    def refresh(self) -> None:
        for rid, answer in self.ask_all("progress", self.call_timeout_s, down="progress").items():
            try:
                self.admit(rid, answer)
            except (KeyError, TypeError, ValueError) as err:  # a malformed answer: that replica's failure
                self.down(rid, "died", "progress", -1, type(err).__name__)

    def rejoin(self, wait_s: float) -> None:
        """Round boundary: bring back replicas that (re)started, waiting up to wait_s for them."""
        deadline = time.monotonic() + wait_s
        while True:
            self._reap("rejoin")
            for rid in self.missing():
                answer = self.probe(rid, min(2.0, max(0.2, deadline - time.monotonic())))
                if answer is not None:  # one still in a phase of a dead supervisor: await_idle waits
                    self.admit(rid, answer)
            if not self.missing() or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def promote_spare(self, rid: str, wait_s: float = 0.0) -> dict | None:
        """A ready spare of rid's cluster takes over rid (the dead actor becomes a spare once back);
        returns its progress (it joins as a restarted replica), or None: no spare ready, or (between
        rounds, `wait_s` > 0) rid's own restarted actor answers: never two processes serving one id."""
        if not self.spares or self.topology.cluster_of(rid) in self.drained_clusters:
            return None
        self.spares.check(self.log)
        if not self.spares.ready and wait_s > 0:
            self.spares.check(self.log, wait_s=wait_s)  # between rounds: give pending answers a moment
        if wait_s > 0 and self.probe(rid, 0.2) is not None:
            return None  # rid's own actor is back (it may have answered mid-round already): it rejoins as itself
        taken = self.spares.promote(
            rid, self.topology.cluster_of(rid), self.handles[rid], self.names[rid], self.call_timeout_s
        )
        if taken is None:
            return None
        name, handle, assumed = taken
        answer = PhaseAnswer.read(assumed).wire()  # its progress, as `admit` and `note_up` read an `up` answer
        self.log.event(
            "spare_promoted",
            rid=rid,
            spare=name,
            replaced=self.names[rid],
            pid=answer.get("pid"),
            incarnation=answer.get("incarnation"),
        )
        self.watch.promoted(rid, name, answer.get("incarnation"), self.names[rid])
        self.replace(rid, name, handle)
        return answer

    def await_idle(
        self, stuck_after_s: float, show: Callable[[list[str]], None], period_s: float, *, min_gbps: float = 1.0
    ) -> None:
        """After a supervisor restart, replicas may still run a phase of the old one: wait while they
        work; kill (down `hung`, Ray restarts it) one StallWatch finds stuck or silent for
        `stuck_after_s` (a checkpoint, heal, outer exchange or commit: `call_timeout_s` plus 3 x the
        params at `min_gbps`). A dead one is only marked down (a kill could hit its new process). One
        progress question per replica at a time; a pass waits at most AWAIT_PASS_S."""
        watch = StallWatch(stuck_after_s, silent_s=stuck_after_s)
        asked: dict[str, Any] = {}  # rid -> its progress question still unanswered
        while True:
            self._reap("await_idle")
            busy = []
            answers = self._ask_progress(sorted(self.live), asked, min(self.call_timeout_s, AWAIT_PASS_S))
            sizes = [int(a.get("param_bytes") or 0) for a, _ in answers.values() if a]
            self.param_bytes = max([self.param_bytes, *sizes])
            state_s = max(stuck_after_s, collective_timeout_s(self.call_timeout_s, 3 * self.param_bytes, min_gbps))
            watch.phase_limits = dict.fromkeys(Phase.having(MOVES_STATE), state_s)
            for rid, (answer, gone) in answers.items():
                if gone:  # Ray says its process is gone: restarting by itself, nothing to kill
                    self.down(rid, "died", "await_idle", -1)
                    continue
                verdict = watch.verdict(rid, answer, time.monotonic())
                if verdict == IDLE:
                    self.admit(rid, answer)
                elif verdict in (STUCK, HUNG):
                    phase = "silent" if verdict == HUNG else answer.get("phase", "?")
                    limit = watch.silent_s if verdict == HUNG else watch.limit(phase)
                    self.log.event(
                        "kill",
                        rid=rid,
                        reason=f"{'no answer' if verdict == HUNG else f'stuck in {phase}'} "
                        f"for over {limit:.0f}s after a supervisor restart",
                    )
                    with contextlib.suppress(Exception):  # already gone: Ray restarts it anyway
                        ray.kill(self.handles[rid], no_restart=False)
                    self.down(rid, "hung", phase, -1 if answer is None else answer.get("round", -1))
                else:  # busy, or silent but not yet for long
                    busy.append(rid)
            if not busy:
                return
            show(busy)
            time.sleep(period_s)

    def _reap(self, phase: str) -> None:
        """Every death Ray's actor table shows (logged by `deaths`): no longer live."""
        for rid in self.deaths(self.live, -1, phase):
            if self.live.pop(rid, None) is not None:
                self._forget_groups(rid)

    def replace(self, rid: str, name: str, handle) -> None:
        """A new actor `name` serves rid (a promoted spare, quarantine's): it joins as a restarted one."""
        self.names[rid], self.handles[rid] = name, handle
        self.gone.discard(rid)
        if self.live.pop(rid, None) is not None:
            self._forget_groups(rid)
        self._save()

    def set_aside(self, rid: str) -> None:
        """rid is out for the rest of the run (quarantined where no other node can hold it)."""
        self.gone.add(rid)
        if self.live.pop(rid, None) is not None:
            self._forget_groups(rid)

    def _ask_progress(
        self, rids: list[str], asked: dict[str, Any], timeout_s: float
    ) -> dict[str, tuple[dict | None, bool]]:
        """rid -> (progress or None, gone), every rid asked at once (not again while its question in
        `asked` is unanswered), waiting at most timeout_s. `gone`: Ray says the actor died; no
        answer yet, or unreachable for now, is (None, False)."""
        for rid in rids:
            if rid not in asked and rid not in self.gone:
                asked[rid] = self.handles[rid].progress.remote()
        refs = {rid: asked[rid] for rid in rids if rid in asked}
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
        out = {}
        for rid, ref in refs.items():
            if ref not in ready:
                out[rid] = (None, False)
                continue
            del asked[rid]
            try:
                out[rid] = (ray.get(ref, timeout=1.0), False)
            except ActorDiedError:
                if restarts_exhausted(self.handles[rid]):
                    self.gone.add(rid)
                out[rid] = (None, True)
            except RayActorError as err:
                out[rid] = (None, not isinstance(err, ActorUnavailableError))
            except Exception:  # noqa: BLE001 — no answer in time: silent
                out[rid] = (None, False)
        return out
