"""A fake Ray world for timing the supervisor's control plane (benchmarks/plan.py): what the round
runner (actors/round_runner.py, through its RunnerPorts) touches — replica handles, `ray.wait`,
`ray.get`, `ray.kill`, the roster, the log, the fault injector — with every call answered at once
by a dict, as actors/replica.py would answer it. No processes, no Ray.

The replicas (`Replica`): each holds its committed (round, step), its global params' lineage
(`global_digest`: a hash chain of the commits it applied, so replicas that disagree on the state
show it), its pid and incarnation. They answer:

    run_inner     done at the round's end (`report`: steps, tokens, bytes, losses); `behind` when
                  the replica has not reached the round. With World.inner_s > 0 the answer is
                  ready only that many seconds after the call, and `progress` meanwhile reports
                  the step reached so far (a round that trains).
    outer_reduce  done with `outer_bytes`; outer_commit: done at round + 1 with its digests
    progress      its (round, step), phase, pid and incarnation (the control channel)
    send_state /  a `full` heal over the process group: the target takes the source's state
    receive_state
    request_yield answered, nothing else (the fake's run_inner has already answered)

Faults (`World.arm`), each fired on one call attempt of one level's group (the first attempt of
that kind in that cluster after it was armed), as a real group fails — every member's call fails:

    die           the victim's call raises ActorDiedError; its peers answer collective_failed
                  (`peer_gone`, or `join_aborted` when the call was forming its group)
    die_held      the victim's call is held forever (Ray holds calls to a restarting actor); only
                  Ray's actor table tells (`FakeRoster.deaths`); its peers answer peer_gone
    collective    every member's call answers collective_failed (kind `wait`), once
A dead replica answers probes with ActorUnavailableError (Ray is restarting it) until `restart`.

Time: answers never wait. When nothing the caller waits on is ready (a held call; a round that
trains), `wait` sleeps until the soonest answer or its timeout, and counts that sleep
(`slept_s`), so a caller can take it out of a wall-clock figure; `fake_s` counts the time spent
inside the fake itself (building answers, scanning refs).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import ray.exceptions
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from hsgd.core.round import GroupJoin
from hsgd.core.topology import Topology
from hsgd.record.events import check_event

# the modules whose module-level `ray` the round's runner reaches (the ones present are patched)
RAY_USERS = ("actors.round_runner", "actors.replica_calls", "actors.heals", "actors.hang")
TOKENS_PER_STEP = 4096
INNER_BYTES_PER_STEP = 1 << 20
OUTER_BYTES = 1 << 22
STATE_BYTES = 1 << 24


class Ref:
    """An object ref: its answer (`value`, or `error` to raise), ready from monotonic time `at`
    (0.0: at once; inf: never — a held call)."""

    __slots__ = ("value", "error", "at")

    def __init__(self, value: Any = None, error: Exception | None = None, at: float = 0.0):
        self.value, self.error, self.at = value, error, at


class World:
    """The fake replicas of a topology, the fake `ray` functions over their refs, and counters."""

    def __init__(self, topology: Topology, steps_per_round: int):
        self.topology, self.spr = topology, steps_per_round
        self.replicas = {rid: Replica(self, rid, pid=1000 + i) for i, rid in enumerate(topology.replica_ids())}
        self.handles = {rid: Handle(self, r) for rid, r in self.replicas.items()}
        self.ray = SimpleNamespace(wait=self.wait, get=self.get, kill=self.kill, exceptions=ray.exceptions)
        self.inner_s = 0.0  # how long a run_inner takes (0: it answers at once)
        self.armed: dict[tuple[str, int | None], dict] = {}  # (method, cluster or None) -> a fault
        self.unseen: list[str] = []  # deaths only Ray's actor table shows (die_held)
        self.heal_sources: dict[str, tuple] = {}  # a heal group's prefix -> its source's state
        self.calls: Counter = Counter()  # method -> calls made
        self.fired: Counter = Counter()  # fault -> times fired
        self.fetch_local_waits = 0  # waits that would pull answers into the caller (never wanted)
        self.fake_s = self.slept_s = 0.0

    # -- ray.wait / ray.get / ray.kill -------------------------------------------------------------------
    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True):
        t0 = time.perf_counter()
        self.calls["ray.wait"] += 1
        self.fetch_local_waits += bool(fetch_local)
        ready = self._ready(refs, num_returns)
        if not ready and timeout:  # as Ray: block until the soonest answer, at most `timeout`
            soonest = min((r.at for r in refs), default=math.inf)
            pause = min(timeout, max(0.0, soonest - time.monotonic()))
            self.fake_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            time.sleep(pause)
            self.slept_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            ready = self._ready(refs, num_returns)
        taken = set(map(id, ready))
        rest = [r for r in refs if id(r) not in taken]
        self.fake_s += time.perf_counter() - t0
        return ready, rest

    @staticmethod
    def _ready(refs: list, num_returns: int) -> list:
        now, ready = time.monotonic(), []
        for r in refs:
            if r.at <= now:
                ready.append(r)
                if len(ready) == num_returns:
                    break
        return ready

    def get(self, ref: Ref, *, timeout: float | None = None):
        t0 = time.perf_counter()
        self.calls["ray.get"] += 1
        try:
            if ref.at > time.monotonic():
                raise GetTimeoutError("the fake's answer is not ready")  # the caller fetches only ready answers
            if ref.error is not None:
                raise ref.error
            return ref.value
        finally:
            self.fake_s += time.perf_counter() - t0

    def kill(self, handle: Handle, *, no_restart: bool = True) -> None:
        self.calls["ray.kill"] += 1
        handle.replica.die()

    # -- faults and restarts ---------------------------------------------------------------------------
    def arm(self, method: str, cluster: int | None, what: str, victim: str | None = None) -> None:
        """`what` on the next call attempt of `method` in `cluster` (None: the leaders' group)."""
        self.armed[(method, cluster)] = {"what": what, "victim": victim, "attempt": None}

    def fault(self, method: str, rid: str, attempt: tuple) -> dict | None:
        """The fault this call of `method` by rid answers, if any (one attempt of its group's)."""
        key = (method, None if method == "outer_reduce" else self.topology.cluster_of(rid))
        fault = self.armed.get(key)
        if fault is None:
            return None
        if fault["attempt"] is None:
            fault["attempt"] = attempt
            self.fired[fault["what"]] += 1
        elif fault["attempt"] != attempt:  # a later attempt: the fault fired once, on the first
            del self.armed[key]
            return None
        return fault

    def disarm(self) -> list[str]:
        """Drop every armed fault; returns those that never fired (their case did not happen)."""
        unfired = [
            f"{f['what']} in {method} of {'the leaders' if c is None else f'c{c}'}"
            for (method, c), f in self.armed.items()
            if f["attempt"] is None
        ]
        self.armed.clear()
        return unfired

    def dead(self) -> list[str]:
        return [rid for rid, r in self.replicas.items() if not r.alive]

    def restart(self, rid: str) -> dict:
        """Ray restarted rid's actor: a new process at (0, 0) (rebuilt from the seed). Its answer
        to the supervisor's probe."""
        return self.replicas[rid].restart()


class Replica:
    """One fake replica: the answers actors/replica.py gives, built at once."""

    def __init__(self, world: World, rid: str, pid: int):
        self.world, self.rid, self.pid = world, rid, pid
        self.round = self.step = self.incarnation = 0
        self.global_digest = "g0"
        self.alive = True
        # a run_inner that trains: (started, seconds it takes, from step, to step)
        self.running: tuple[float, float, int, int] | None = None

    # -- control channel -------------------------------------------------------------------------------
    def progress(self) -> Ref:
        if not self.alive:  # Ray is restarting it: unreachable for now, not known dead
            return Ref(error=ActorUnavailableError("restarting", None))
        step, phase = self.step, "idle"
        if self.running is not None:
            started, seconds, first, last = self.running
            done = (time.monotonic() - started) / seconds
            if done < 1.0:
                step, phase = first + int(done * (last - first)), "inner"
        return Ref(
            {
                "rid": self.rid,
                "round": self.round,
                "step": step,
                "epoch": 0,
                "phase": phase,
                "spare": False,
                "incarnation": self.incarnation,
                "pid": self.pid,
                "node_id": "fake",
            }
        )

    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> Ref:
        return Ref({"rid": self.rid, "step": self.step})

    # -- phases ------------------------------------------------------------------------------------------
    def _answer(self, outcome: str = "done", **fields) -> dict:
        return {"outcome": outcome, "rid": self.rid, **fields, "round": self.round, "step": self.step}

    def _faulted(self, method: str, join: GroupJoin | None, round_index: int) -> Ref | None:
        """The answer of a call hit by an armed fault (None: not hit)."""
        fault = self.world.fault(method, self.rid, (round_index, join.prefix if join else "standing"))
        if fault is None:
            return None
        what, end_of_half = fault["what"], (round_index, round_index * self.world.spr + self.world.spr // 2)
        if self.rid == fault["victim"]:
            self.die()
            if what == "die_held":
                self.world.unseen.append(self.rid)
                return Ref(at=math.inf)
            return Ref(error=ActorDiedError())
        # a collective: the group broke while in flight; else a peer died: its connection closed, or
        # (forming) the supervisor released the rendezvous
        kind = "wait" if what == "collective" else "join_aborted" if join and what == "die" else "peer_gone"
        if method == "run_inner" and self.round == round_index:
            self.step = max(self.step, end_of_half[1])  # it committed the steps before its group broke
        return Ref(self._answer("collective_failed", error=f"fake {what} in {method}", error_kind=kind))

    def run_inner(
        self,
        round_index: int,
        faults=None,
        join: GroupJoin | None = None,
        overlap: tuple | None = None,
        steps: int | None = None,
        store_addr: str | None = None,
    ) -> Ref:
        failed = self._faulted("run_inner", join, round_index)
        if failed is not None:
            return failed
        if self.round < round_index:
            return Ref(self._answer("behind", error=f"{self.rid} holds round {self.round}"))
        end = round_index * self.world.spr + (steps or self.world.spr)  # steps: sync.balance's plan
        steps = max(0, end - self.step)
        report = {
            "steps_done": steps,
            "tokens": steps * TOKENS_PER_STEP,
            "inner_bytes": steps * INNER_BYTES_PER_STEP,
            "losses": [2.5] * steps,
            "yielded": False,
        }
        first, self.step = self.step, end
        at = 0.0
        if self.world.inner_s > 0:
            self.running = (time.monotonic(), self.world.inner_s, first, end)
            at = time.monotonic() + self.world.inner_s
        return Ref(self._answer(report=report, join_s=0.0), at=at)

    def outer_reduce(
        self,
        round_index: int,
        epoch: int,
        faults=None,
        join: GroupJoin | None = None,
        shard: int = 0,
        shards: int = 1,
        weights: tuple = (),
    ) -> Ref:
        failed = self._faulted("outer_reduce", join, round_index)
        return failed or Ref(self._answer(outer_bytes=OUTER_BYTES, join_s=0.0))

    def outer_commit(self, round_index: int, roots: tuple, faults=None) -> Ref:
        if self.round == round_index:
            self.round = round_index + 1
            self.step = self.round * self.world.spr
            self.global_digest = hashlib.sha256(f"{self.global_digest}/{round_index}".encode()).hexdigest()[:16]
        self.running = None
        return Ref(
            self._answer(digest=f"{self.global_digest}@{self.step}", global_digest=self.global_digest, inner_bytes=0)
        )

    def send_state(self, round_index: int, join: GroupJoin, chunk_mb: float, faults=None) -> Ref:
        self.world.heal_sources[join.prefix] = (self.round, self.step, self.global_digest)
        return Ref(self._answer(bytes=STATE_BYTES, join_s=0.0, transfer_s=0.0, pid=self.pid))

    def receive_state(self, round_index: int, join: GroupJoin, faults=None) -> Ref:
        self.round, self.step, self.global_digest = self.world.heal_sources[join.prefix]
        return Ref(self._answer(bytes=STATE_BYTES, transport="group", join_s=0.0, transfer_s=0.0))

    # -- its process -------------------------------------------------------------------------------------
    def die(self) -> None:
        self.alive, self.running = False, None

    def restart(self) -> dict:
        self.alive, self.running = True, None
        self.incarnation += 1
        self.pid += 100_000
        self.round = self.step = 0
        self.global_digest = "g0"
        return {
            "rid": self.rid,
            "round": 0,
            "step": 0,
            "phase": "idle",
            "spare": False,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "node_id": "fake",
        }


PHASE_METHODS = ("run_inner", "outer_reduce", "outer_commit", "send_state", "receive_state")
CONTROL_METHODS = ("progress", "request_yield")


class _Method:
    __slots__ = ("world", "name", "fn")

    def __init__(self, world: World, name: str, fn):
        self.world, self.name, self.fn = world, name, fn

    def remote(self, *args):
        t0 = time.perf_counter()
        self.world.calls[self.name] += 1
        ref = self.fn(*args)
        self.world.fake_s += time.perf_counter() - t0
        return ref


class Handle:
    """A replica's actor handle: `handle.<method>.remote(...)` -> Ref. A method the fake does not
    know raises AttributeError naming it (teach the fake its answer, from actors/replica.py)."""

    def __init__(self, world: World, replica: Replica):
        self.replica = replica
        for name in PHASE_METHODS + CONTROL_METHODS:
            setattr(self, name, _Method(world, name, getattr(replica, name)))


# -- the runner's other ports ------------------------------------------------------------------------------
class FakeLog:
    """Counts events, refusing what the run's log refuses (hsgd.record.events.check_event)."""

    def __init__(self):
        self.counts: Counter = Counter()

    def event(self, name: str, **fields) -> None:
        check_event(name, fields)
        self.counts[name] += 1

    def write_file(self, path, text: str, make_parent: bool = False) -> None:
        self.counts["file_written"] += 1


class FakeInjector:
    """No scheduled faults (the world arms its own)."""

    def pending(self, round_index: int, phases: tuple[str, ...]) -> bool:
        return False

    def supervisor_faults(self, round_index: int, phase: str) -> None:
        return None


class FakeRoster:
    """What the runner reads of actors/roster.py: handles, the live view, pids, deaths (each
    logged once: from a call, or from Ray's actor table — here the world's `unseen`)."""

    def __init__(self, world: World, log: FakeLog):
        self.world, self.log, self.topology = world, log, world.topology
        self.handles = world.handles
        self.gone: set[str] = set()
        self.spares = None  # no hot spares
        self.live = {rid: (0, 0) for rid in world.replicas}
        self.pids = {rid: r.pid for rid, r in world.replicas.items()}
        self.replica_info: dict[str, dict] = {}
        self.reported: set[tuple[str, int]] = set()  # (rid, incarnation) whose death was logged
        self.late: dict = {}  # (sync.balance=time's held-out replicas: none here)

    def note_up(self, rid: str, answer: dict) -> None:
        self.replica_info[rid] = {"pid": answer.get("pid"), "node_id": answer.get("node_id")}
        if self.pids.get(rid) != answer.get("pid"):
            self.pids[rid] = answer.get("pid")
            self.log.event(
                "replica_up",
                rid=rid,
                round=answer["round"],
                step=answer["step"],
                pid=answer.get("pid"),
                incarnation=answer.get("incarnation"),
            )

    def died(self, rid: str, cause: str, phase: str | None, round_index: int, detail: str = "") -> bool:
        seen = (rid, self.world.replicas[rid].incarnation)
        if seen in self.reported:
            return False
        self.reported.add(seen)
        self.log.event(
            "replica_down",
            rid=rid,
            cluster=self.topology.cluster_of(rid),
            cause=cause,
            phase=phase,
            round=round_index,
            incarnation=seen[1],
        )
        return True

    def deaths(self, live, round_index: int, phase: str | None) -> list[str]:
        # (one no longer live was given up on already: its death is logged through `died`)
        lost, self.world.unseen = [rid for rid in self.world.unseen if rid in live], []
        for rid in lost:
            self.died(rid, "died", phase, round_index)
        return lost

    def table_tells(self, rid: str) -> bool:
        return True  # the world's `unseen` is its actor table: every death shows there

    def promote_spare(self, rid: str, wait_s: float = 0.0) -> None:
        return None


@contextmanager
def patched_ray(fake) -> Iterator[list[str]]:
    """Swap the module-level `ray` of the runner's modules (RAY_USERS, those present) for `fake`
    for the duration; yields the modules patched. Restored on exit, whatever happened."""
    saved = []
    try:
        for name in RAY_USERS:
            if importlib.util.find_spec(name) is None:
                continue
            module = importlib.import_module(name)
            if hasattr(module, "ray"):
                saved.append((module, module.ray))
                module.ray = fake
        yield [m.__name__ for m, _ in saved]
    finally:
        for module, real in saved:
            module.ray = real
