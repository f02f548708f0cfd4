"""Scale benchmark: `python -m benchmarks scale [--quick] [--out DIR] [--rounds N]`.

How the supervisor's control plane grows with the number of replicas, two ways.

1. Decisions vs size (no Ray, no processes). For simulated topologies from 10 to 10,000 replicas
   in 1 to 1,000 clusters — (clusters, replicas per cluster) = (1,10), (10,10), (10,100),
   (100,10), (100,100), (1000,10) — `python -m benchmarks plan`'s own measurement (benchmarks/plan.py
   `plan_bench`, reused, not rewritten: the round machine AND its runner driven as the supervisor
   drives them, against a fake Ray whose replicas answer at once, the fake's own time taken out)
   gives per round:

       machine_ms               the round machine's own calls (hsgd/core/round: its plan, heal
                                assignment and outer plan happen inside them)
       runner_ms                the rest: actors/round_runner.py, its record, heals and status
       machine_plus_runner_ms   the two: the supervisor's cost of the round when every call
                                answers at once (a real round adds waiting, not deciding)

   each the median over the fault-free rounds (`fault_free`, the headline) and over the rounds
   with a few failures (`with_failures`: replicas dying in run_inner, a collective failing once,
   the leaders' outer reduce failing once, the dead healed at the next start), plus the first
   round (every group formed). Beside them the pure decisions on their own, per call (best of 3):
   `plan_ms` (hsgd.core.membership.live_plan over the live replicas, one cluster in ten missing
   its leader: the roster's plan), `heal_assignment_ms` (hsgd.core.round.heals_at_rest, the
   supervisor's heal assignment over the whole run at its end: one laggard per cluster healed
   `full`, one whole cluster behind healed `global`; a round's own heal assignment is per cluster,
   inside machine_ms) and `outer_plan_ms` (hsgd.core.outer_plan.shard_count + shard_holders on the
   sharded path).

2. The Ray control plane per round (real Ray). A local Ray (`ray.init(num_cpus=4)`, token auth as by
   default) holds lightweight replica actors (`LightReplica`, `num_cpus=0`, in actors/replica.py's
   concurrency groups): each answers the replica API the round runner uses — run_inner,
   outer_reduce, outer_commit, progress, request_yield, send_state/receive_state — at once, with the
   answers of benchmarks/fake_ray.py's `Replica` (its own small state: committed round and step, a
   digest chain of the commits it applied), no model, no torch. The same round (bench_plan's
   `FakeRun`: a RoundMachine and `RoundRunner(machine, RunnerPorts(...)).drive()`) runs over the
   real actor handles with the real `ray.wait` / `ray.get` — nothing patched — at 4, 8, 16, 32 and
   64 actors (2x2, 4x2, 8x2, 16x2, 16x4). Per size: the first round (every group formed), `--rounds`
   fault-free rounds (`round_ms_median`: their wall, machine build to the end of `drive()`;
   `round_ms_spread`: max - min of them, ms; `driver_cpu_ms_median`: the supervisor process's CPU in
   them, Ray's threads in it included), then one round after one replica restarted (its state back
   at (0, 0), as Ray restarting it: a `full` heal over its cluster, the state passed from actor to
   actor). The actors share this machine's cores with Ray and the supervisor; on a cluster they
   would not, so the wall here is an upper bound of what the supervisor waits on.

3. Lasting rounds: the supervisor's polling while replicas train (real Ray, issue 36). The same
   light actors and the same `RoundRunner.drive()`, but each run_inner answers `--inner-s` seconds
   after its call (default 5 s; --quick: 2 s), held in the actor's "phase" thread as training would
   hold it, while its "control" thread answers `progress` (the light actor's concurrency groups are
   actors/replica.py's). The runner has a real store, as the supervisor's (hsgd.train.comm
   start_store, a rendezvous address under a fresh secret), and polls as it does for real: the
   steps of replicas in run_inner read off the progress board (hsgd/train/progress_board.py) with
   one multi_get per tick, idle-liveness calls to idle replicas only where the table cannot tell,
   and Ray's real actor table read once per tick (`TableRoster`: a real actors.lifecycle.ActorWatch
   over the light actors' names, behind bench_plan's FakeRoster). The replicas' side of the board —
   each replica's `round,step` written to the store every 0.5 s, the Publisher's interval, over
   its own connection — is `BoardWriter`, one process for all (torch imported once, not 64 times).
   Per size (the sizes of part 2): the first round (groups formed; not reported), then an instant
   round (inner_s = 0) and a lasting round on two paths: the progress board (the product's default;
   the headline figures) and `by_calls` (the runner without a store: its fallback, a `progress`
   call to each replica in run_inner every TICK_S — the path before issue 36's Build 1). Each
   round counted BY THE ACTORS — every light actor counts its own invocations of the replica API
   per method (progress, run_inner, outer_reduce, outer_commit, ...), read and cleared after the
   round; the bench's own calls (reset, set_inner_s, the counters) are not counted:

       calls_per_round / instant_calls_per_round   every actor call of the round, and by method
       extra_calls_per_round     lasting - instant: what a lasting inner phase costs in calls
       ticks                     inner_s / TICK_S (actors.round_runner); machine_ticks: counted
       progress_calls_lasting / idle_liveness_calls_lasting   the lasting round's `progress` calls
                                 split by why (the runner's progress probes of replicas in
                                 run_inner; idle-liveness probes the actor table could not tell);
                                 idle_liveness_calls_skipped_lasting: those the table told
       board_writes              the replicas' writes to the progress board in the round
       progress_seen_lasting     the observations the machine took in the lasting round beyond the
                                 instant one's: its `Progress` (board values or progress calls;
                                 0 would mean the runner saw no step while replicas trained)
       supervisor_cpu_per_inner_s   time.process_time() of the driver process (the one running
                                 drive(): every thread in it — the runner's, Ray's core-worker
                                 threads and the store's server; not the raylet, the GCS or the
                                 actors) over the lasting round's inner phase (its first run_inner
                                 phase_begin to its last run_inner phase_end, from the round's own
                                 events), per wall second: a fraction of one core;
                                 supervisor_main_thread_cpu_per_inner_s: time.thread_time() of
                                 drive()'s thread alone. driver_idle_cpu_per_s: the driver process's
                                 CPU per second at rest (its main thread asleep)

   `lasting_fit` (and its `by_calls`): affine fits vs replicas of the extra calls (per replica, per
   replica per tick, at 10,000) and of the CPU fraction (at 10,000, the size where it reaches one
   core). The issue's targets as figures, never asserts (`lasting_holds`, and its `by_calls`):
   extra calls per round <= 2 x clusters x ticks at every size, and the CPU at the largest size
   (64 actors) <= 5 % of one core.

Growth order: the least-squares slope of log(time) against log(replicas), `growth_exponent`
(1.0: linear; ~0: a fixed cost dominates), with `coefficient_ms` (time = coefficient x
replicas^exponent) and r2. The Ray side is extrapolated to 10,000 replicas with its own fit
(`ray_extrapolated_10000_ms`), and with an affine fit (a fixed cost plus a cost per replica) for
comparison. `budget_ms` (600: 1 % of a 60-s round) is a figure to compare, never an assert.

Every round must commit with the replicas' digests agreeing (bench_plan's checks), and the round
after a restart must heal, or the bench stops: a timing of a broken run means nothing. Writes
`<out>/scale.json` (the header of benchmarks/report.py, then `decisions`, `decisions_fit`,
`ray_control_plane`, `ray_fit`, `ray_extrapolated_10000_ms`, `budget_ms`, and part 3's
`lasting_inner_s`, `lasting_rounds`, `lasting_fit`, `lasting_targets`, `lasting_holds`,
`driver_idle_cpu_per_s`) and `<out>/scale.png` (log-log time vs replicas with the fits; part 3's
calls per round and CPU fraction vs replicas beside it). `--quick` (a smoke run): the two smallest
decision sizes, one round a case; Ray at 4 and 8 actors; 2-s lasting rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import ray  # the actor below is defined at import; nothing heavier is imported here (the actors import this module)

if TYPE_CHECKING:
    from hsgd.core.round import GroupJoin

BUDGET_MS = 600.0  # 1 % of a 60-s round
AT = 10_000  # the size the Ray side is extrapolated to
DECISION_SIZES = ((1, 10), (10, 10), (10, 100), (100, 10), (100, 100), (1000, 10))
RAY_SIZES = ((2, 2), (4, 2), (8, 2), (16, 2), (16, 4))
QUICK_DECISION_SIZES, QUICK_RAY_SIZES = DECISION_SIZES[:2], RAY_SIZES[:2]
STEPS_PER_ROUND = 100
STATE_WAIT_S = 30.0  # a heal target waits this long at most for its source's send_state to have run
CALL_S = 120.0  # actors' start and resets (64 worker processes starting on 2 cores)


# -- 1. decisions vs size ----------------------------------------------------------------------------------
def decisions(clusters: int, per_cluster: int, rounds: int, seed: int) -> dict:
    """One simulated size: bench_plan's per-round figures (medians per case) and the pure decisions."""
    from benchmarks.plan import plan_bench
    from hsgd.core.topology import Topology

    report = plan_bench(clusters, per_cluster, rounds=rounds, spr=STEPS_PER_ROUND, train_s=0.0, seed=seed)
    cases = {}
    for case, label in (
        ("first_round", "first_round"),
        ("fault_free", "fault_free"),
        ("few_failures", "with_failures"),
    ):
        records = [r for r in report["rounds"] if r["case"] == case]
        cases[label] = {
            "rounds": len(records),
            **{
                key: statistics.median(r[key] for r in records)
                for key in ("machine_ms", "runner_ms", "machine_plus_runner_ms")
            },
        }
    checks = report["checks"]
    return {
        "clusters": clusters,
        "replicas_per_cluster": per_cluster,
        "replicas": clusters * per_cluster,
        **{key: cases["fault_free"][key] for key in ("machine_ms", "runner_ms", "machine_plus_runner_ms")},
        **cases,
        **pure_decisions_ms(Topology(clusters, per_cluster)),
        "checks": {
            "rounds": checks["rounds"],
            "committed": checks["committed"],
            "digests_agree": checks["digests_agree"],
            "failures_fired": checks["failures_fired"],
        },
    }


def pure_decisions_ms(topology) -> dict:
    """The plan, the heal assignment and the outer plan on their own, ms per call."""
    from hsgd.core.membership import live_plan
    from hsgd.core.outer_plan import shard_count, shard_holders
    from hsgd.core.round import heals_at_rest

    leaders = {c: topology.cluster_members(c)[0] for c in range(topology.clusters)}
    live = set(topology.replica_ids()) - {leaders[c] for c in range(0, topology.clusters, 10)}
    plan = live_plan(topology, live, dict(leaders), 7)
    r, spr = 5, STEPS_PER_ROUND
    progress = {rid: (r, (r + 1) * spr) for rid in plan.live}
    for members in plan.members.values():
        progress[members[-1]] = (r, r * spr + spr // 2)  # a laggard per cluster: a `full` heal
    if len(plan.members) > 1:  # a whole cluster a round behind: a `global` heal
        progress.update({rid: (r - 1, r * spr) for rid in plan.members[min(plan.members)]})
    if not heals_at_rest(topology, progress):
        raise RuntimeError("the heal assignment's case heals nobody: it times nothing")
    members = [plan.members[c] for c in plan.outer_clusters]
    holders = [plan.leaders[c] for c in plan.outer_clusters]
    return {
        "plan_ms": _per_call_ms(lambda: live_plan(topology, live, dict(leaders), 7)),
        "heal_assignment_ms": _per_call_ms(lambda: heals_at_rest(topology, progress)),
        "outer_plan_ms": _per_call_ms(
            lambda: shard_holders(members, holders, shard_count([len(m) for m in members], "sharded"))
        ),
    }


def _per_call_ms(fn, target_s: float = 0.005) -> float:
    """ms per call of fn: enough calls in a batch to take target_s, best of 3 batches."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= target_s or n >= 1 << 16:
            break
        n *= 4
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e3


# -- 2. the Ray control plane ------------------------------------------------------------------------------
class _OwnWorld:
    """What a fake_ray.Replica reads of its World, for one actor: no faults armed (the failures of
    the Ray side are real restarts), answers at once, heal states by group prefix."""

    def __init__(self, steps_per_round: int):
        self.spr, self.inner_s = steps_per_round, 0.0
        self.heal_sources: dict[str, tuple] = {}
        self.unseen: list[str] = []

    def fault(self, method: str, rid: str, attempt: tuple) -> None:
        return None


def _value(ref):
    """A fake Ref's answer, as the actor's reply (the Ray side arms no fault, so nothing is held). A
    Ref ready later (a run_inner while `inner_s` > 0: a round that trains) is waited for here, in the
    actor's phase thread, as a replica's training would hold it."""
    if ref.error is not None:
        raise ref.error
    if ref.at > 0.0:
        assert math.isfinite(ref.at), "the Ray side holds no call forever"
        time.sleep(max(0.0, ref.at - time.monotonic()))
    return ref.value


@ray.remote(num_cpus=0, concurrency_groups={"phase": 1, "control": 2})
class LightReplica:
    """A replica actor that skips the model work: benchmarks/fake_ray.py's Replica answers behind real
    Ray calls. `reset` gives it an id and a fresh state (round 0, step 0) and the handles of its
    cluster's members (a heal target takes its source's state from the source's actor).

    Its concurrency groups are actors/replica.py's: phase methods one at a time in the "phase" group,
    the control channel (progress, request_yield) in "control", so `progress` answers while a
    lasting run_inner holds the phase thread (`set_inner_s`: how long each run_inner lasts, from its
    call). It counts its own invocations of the replica API per method (`calls`); the bench's own
    calls (reset, restart, set_inner_s, calls, sent_state: a heal target's, actor to actor) are not
    counted."""

    def __init__(self):
        self.replica, self.world, self.peers = None, None, {}
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def _count(self, method: str) -> None:
        with self.lock:
            self.counts[method] += 1

    @ray.method(concurrency_group="control")
    def reset(self, rid: str, steps_per_round: int, peers: dict) -> dict:
        from benchmarks.fake_ray import Replica  # ray.exceptions and hsgd's topology and events: no torch

        self.world = _OwnWorld(steps_per_round)
        self.replica = Replica(self.world, rid, pid=os.getpid())
        self.peers = peers
        with self.lock:
            self.counts.clear()
        return _value(self.replica.progress())

    @ray.method(concurrency_group="control")
    def restart(self) -> dict:
        """As Ray restarting the actor: a new incarnation at (0, 0). Its answer to the probe."""
        return self.replica.restart()

    @ray.method(concurrency_group="control")
    def set_inner_s(self, seconds: float) -> None:
        """Each run_inner from now on answers `seconds` after its call (0: at once)."""
        self.world.inner_s = float(seconds)

    @ray.method(concurrency_group="control")
    def calls(self, clear: bool = True) -> dict:
        """Its invocations per method since the last clear (the replica API only)."""
        with self.lock:
            counts = dict(self.counts)
            if clear:
                self.counts.clear()
        return counts

    # -- the replica API the round runner calls ------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        self._count("progress")
        return _value(self.replica.progress())

    @ray.method(concurrency_group="control")
    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> dict:
        self._count("request_yield")
        return _value(self.replica.request_yield(epoch, round_index, step_in_round))

    @ray.method(concurrency_group="phase")
    def run_inner(self, round_index: int, faults=None, join=None, overlap=None, steps=None, store_addr=None) -> dict:
        """(`store_addr`: where a replica publishes its steps; part 3's `BoardWriter` does it for the light ones.)"""
        self._count("run_inner")
        return _value(self.replica.run_inner(round_index, faults, join, overlap, steps))

    @ray.method(concurrency_group="phase")
    def outer_reduce(
        self, round_index: int, epoch: int, faults=None, join=None, shard: int = 0, shards: int = 1, weights: tuple = ()
    ) -> dict:
        self._count("outer_reduce")
        return _value(self.replica.outer_reduce(round_index, epoch, faults, join, shard, shards, weights))

    @ray.method(concurrency_group="phase")
    def outer_commit(self, round_index: int, roots: tuple, faults=None) -> dict:
        self._count("outer_commit")
        return _value(self.replica.outer_commit(round_index, roots, faults))

    @ray.method(concurrency_group="phase")
    def send_state(self, round_index: int, join: GroupJoin, chunk_mb: float, faults=None) -> dict:
        self._count("send_state")
        return _value(self.replica.send_state(round_index, join, chunk_mb, faults))

    @ray.method(concurrency_group="phase")
    def receive_state(self, round_index: int, join: GroupJoin, faults=None) -> dict:
        """The source's state, from its actor (the prefix names the source: actors/heals.py
        `.../heal/r<round>/<source>/<token>`), once its send_state ran; within STATE_WAIT_S."""
        self._count("receive_state")
        prefix = join.prefix
        source = self.peers[prefix.split("/")[-2]]
        deadline = time.monotonic() + STATE_WAIT_S
        while (state := ray.get(source.sent_state.remote(prefix), timeout=STATE_WAIT_S)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prefix}: the source's send_state never ran")
            time.sleep(0.001)
        self.world.heal_sources[prefix] = tuple(state)
        return _value(self.replica.receive_state(round_index, join, faults))

    @ray.method(concurrency_group="control")
    def sent_state(self, prefix: str):
        return self.world.heal_sources.get(prefix)


class RayWorld:
    """What bench_plan's FakeRun and FakeRoster read of a fake World, over real actor handles:
    the runner's calls go to Ray itself (nothing here counts or times them: fake_s and slept_s
    stay 0, so FakeRun's machine_plus_runner_ms is the round's whole wall). `down`: replicas to
    restart after the round (FakeRun's between-rounds calls `dead` and `restart`)."""

    def __init__(self, topology, handles: dict, answers: dict):
        self.topology, self.handles = topology, handles
        self.replicas = {rid: SimpleNamespace(pid=a["pid"], incarnation=a["incarnation"]) for rid, a in answers.items()}
        self.unseen: list[str] = []  # deaths only Ray's actor table shows: none here
        self.calls, self.fired = Counter(), Counter()
        self.fake_s = self.slept_s = 0.0
        self.inner_s = 0.0
        self.fetch_local_waits = 0
        self.down: list[str] = []

    def disarm(self) -> list[str]:
        return []

    def dead(self) -> list[str]:
        return list(self.down)

    def restart(self, rid: str) -> dict:
        self.down.remove(rid)
        answer = ray.get(self.handles[rid].restart.remote(), timeout=CALL_S)
        self.replicas[rid].pid, self.replicas[rid].incarnation = answer["pid"], answer["incarnation"]
        return answer


def start_actors(n: int) -> tuple[list, list[str]]:
    """n light actors, named (Ray's actor table lists them by name: part 3's ActorWatch reads it)."""
    names = [f"hsgd-bench-scale-{os.getpid()}-{i}" for i in range(n)]
    actors = [LightReplica.options(num_cpus=0, name=name).remote() for name in names]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=CALL_S)
    return actors, names


def ray_rounds(actors: list, clusters: int, per_cluster: int, rounds: int, seed: int) -> dict:
    """One size over the first clusters x per_cluster actors: the first round, `rounds`
    fault-free rounds, then one round after a replica restarted (it heals)."""
    from benchmarks.plan import FakeRun
    from hsgd.core.outer_plan import holds_outer_group
    from hsgd.core.topology import Topology

    topology = Topology(clusters, per_cluster)
    handles = dict(zip(topology.replica_ids(), actors, strict=False))
    answers = ray.get(
        [
            h.reset.remote(
                rid, STEPS_PER_ROUND, {p: handles[p] for p in topology.cluster_members(topology.cluster_of(rid))}
            )
            for rid, h in handles.items()
        ],
        timeout=CALL_S,
    )
    world = RayWorld(topology, handles, {a["rid"]: a for a in answers})
    run = FakeRun(topology, STEPS_PER_ROUND, random.Random(seed), world=world)
    victim = topology.cluster_members(clusters - 1)[-1]  # not a leader: the leaders' group stands

    def timed(case: str) -> dict:
        cpu0 = time.process_time()
        record = run.round(case)
        return {**record, "driver_cpu_ms": (time.process_time() - cpu0) * 1e3}

    first = timed("first_round")
    fault_free = []
    for i in range(rounds):
        if i == rounds - 1:
            world.down.append(victim)  # restarted after this round (FakeRun's between-rounds)
        fault_free.append(timed("fault_free"))
    # its process restarted: its inner group is gone (the supervisor's roster sees the new incarnation)
    run.configured.pop(topology.cluster_of(victim), None)
    if holds_outer_group(run.outer_configured, victim):
        run.outer_configured = None
    heals0 = run.log.counts["heal_begin"]
    healed = timed("after_restart")
    if run.log.counts["heal_begin"] - heals0 < 1:
        raise RuntimeError(f"{victim} restarted at (0, 0) but the next round healed nobody: the bench is broken")
    walls = [r["machine_plus_runner_ms"] for r in fault_free]
    return {
        "replicas": topology.num_replicas,
        "clusters": clusters,
        "replicas_per_cluster": per_cluster,
        "rounds": rounds,
        "round_ms_median": statistics.median(walls),
        "round_ms_spread": max(walls) - min(walls),
        "round_ms_min": min(walls),
        "round_ms_max": max(walls),
        "machine_ms_median": statistics.median(r["machine_ms"] for r in fault_free),
        "driver_cpu_ms_median": statistics.median(r["driver_cpu_ms"] for r in fault_free),
        "first_round_ms": first["machine_plus_runner_ms"],
        "heal_round_ms": healed["machine_plus_runner_ms"],
        "heals": run.log.counts["heal_begin"] - heals0,
        "committed": sum(r["outcome"] == "committed" for r in [first, *fault_free, healed]),
        "events": dict(run.log.counts),
    }


def driver_idle_cpu_per_s(seconds: float = 2.0) -> float:
    """This process's CPU per second while its main thread sleeps: Ray's own threads in the driver."""
    t0, cpu0 = time.monotonic(), time.process_time()
    time.sleep(seconds)
    return (time.process_time() - cpu0) / (time.monotonic() - t0)


def ray_side(
    sizes, rounds: int, seed: int, on_size, inner_s: float, on_lasting
) -> tuple[list[dict], list[dict], float]:
    """Parts 2 and 3 in one Ray over the same actors: part 2's rows, part 3's rows, and the driver's
    CPU per second at rest (measured between them)."""
    repo = str(Path(__file__).resolve().parent.parent)
    from benchmarks.report import bench_ray  # here, not at import: the actors import this module

    with bench_ray(
        num_cpus=4,
        namespace="hsgd-bench-scale",
        runtime_env={"env_vars": {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    ):
        t0 = time.monotonic()
        actors, names = start_actors(max(c * n for c, n in sizes))
        try:
            print(f"scale: {len(actors)} light replica actors up in {time.monotonic() - t0:.1f} s", flush=True)
            results = []
            for clusters, per_cluster in sizes:
                results.append(ray_rounds(actors, clusters, per_cluster, rounds, seed))
                on_size(results[-1])
            idle = driver_idle_cpu_per_s()
            print(
                f"scale lasting: the driver at rest uses {idle:.1%} of a core (Ray's threads in it); "
                f"rounds whose inner phase lasts {inner_s:g} s next",
                flush=True,
            )
            writer = BoardWriter.options(num_cpus=0).remote()
            actors.append(writer)  # killed with them (the light actors are the first ones: zip stops before it)
            lasting = []
            for clusters, per_cluster in sizes:
                lasting.append(lasting_rounds(actors, names, writer, clusters, per_cluster, inner_s, seed))
                on_lasting(lasting[-1])
            return results, lasting, idle
        finally:
            for actor in actors:
                ray.kill(actor)  # in a Ray the caller keeps running, nothing of ours stays behind


# -- 3. lasting rounds: the supervisor's polling while replicas train -------------------------------------
TARGET_CPU_FRACTION = 0.05  # the target: the supervisor's CPU during the inner phase at 64 actors
TARGET_CALLS_PER_CLUSTER_TICK = 2  # the target: extra calls per round <= 2 x clusters x ticks
INNER_S, QUICK_INNER_S = 5.0, 2.0
API = ("progress", "run_inner", "outer_reduce", "outer_commit", "request_yield", "send_state", "receive_state")


class TableRoster:
    """bench_plan's FakeRoster with Ray's real actor table behind it, as actors/roster.py reads it:
    a real `actors.lifecycle.ActorWatch` over the light actors' names, polled once per tick
    (`deaths`), and `table_tells` from its last poll (actors/round_runner.py `_ask` skips an idle
    replica's liveness call when the table lists its actor). Counts the table's reads and the idle
    liveness probes the machine wanted (`idle_wanted`) and those the table could not tell
    (`idle_untold`: a call was made, unless one was outstanding)."""

    def __init__(self, fake_roster, names: dict):
        from ray._private.state import state as gcs

        from actors.lifecycle import ActorWatch

        self.fake, self.names = fake_roster, names
        self.table_reads = self.idle_wanted = self.idle_untold = 0

        def table():
            self.table_reads += 1
            return gcs.actor_table(None).values()

        self.watch = ActorWatch(dict(names), {}, {}, table=table)

    def __getattr__(self, name):  # handles, live, pids, gone, spares, note_up, died, promote_spare: the fake's
        return getattr(self.fake, name)

    def __setattr__(self, name, value):
        if name == "live":  # the runner and FakeRun keep the live view on the roster
            setattr(self.fake, name, value)
        else:
            object.__setattr__(self, name, value)

    def deaths(self, live, round_index: int, phase: str | None) -> list[str]:
        lost = []
        for d in self.watch.poll():  # the light actors never die here: a death is a broken bench
            raise RuntimeError(f"a light actor died ({d}): the bench is broken")
        return lost + self.fake.deaths(live, round_index, phase)

    def table_tells(self, rid: str) -> bool:
        self.idle_wanted += 1
        tells = self.watch.tells(self.names.get(rid))
        self.idle_untold += not tells
        return tells


class InnerPhaseClock:
    """The supervisor process's clocks at the inner phase's ends, from the round's own events: the
    first `phase_begin` of run_inner (its calls issued) and the last run_inner `phase_end` (every
    cluster's answers in). `process_time`: every thread of this process (the runner's, and Ray's
    core-worker threads in it: gRPC, its event loops); `thread_time`: the thread running drive()."""

    def __init__(self, log):
        self.event, self.open, self.begun, self.ended = log.event, set(), None, None
        log.event = self._event

    @staticmethod
    def now() -> tuple[float, float, float]:
        return time.monotonic(), time.process_time(), time.thread_time()

    def _event(self, name: str, **fields) -> None:
        if fields.get("phase") == "inner" and name in ("phase_begin", "phase_end"):
            if name == "phase_begin":
                self.open.add(fields["cluster"])
                if self.begun is None:
                    self.begun = self.now()
            else:
                self.open.discard(fields["cluster"])
                if not self.open:
                    self.ended = self.now()
        self.event(name, **fields)

    def reset(self) -> None:
        self.open, self.begun, self.ended = set(), None, None

    def figures(self) -> dict:
        if self.begun is None or self.ended is None:
            raise RuntimeError("the round had no inner phase: the bench is broken")
        wall, cpu, thread = (b - a for a, b in zip(self.begun, self.ended, strict=True))
        return {
            "inner_wall_s": wall,
            "supervisor_cpu_s": cpu,
            "supervisor_main_thread_cpu_s": thread,
            "supervisor_cpu_per_inner_s": cpu / wall if wall > 0 else 0.0,
            "supervisor_main_thread_cpu_per_inner_s": thread / wall if wall > 0 else 0.0,
        }


def actor_calls(handles: dict) -> dict:
    """Each light actor's own count of the replica API's invocations since the last read (cleared)."""
    total: Counter = Counter()
    for counts in ray.get([h.calls.remote() for h in handles.values()], timeout=CALL_S):
        total.update(counts)
    return {**{m: 0 for m in ("progress", "run_inner", "outer_reduce", "outer_commit")}, **dict(sorted(total.items()))}


@ray.remote(num_cpus=0)
class BoardWriter:
    """The light replicas' progress publishers (hsgd/train/progress_board.py `Publisher`), in one
    process: one store client per replica (a connection each, as each replica holds its own), each
    replica's `round,step,pid` written every `interval_s` (the Publisher's default, 0.5 s; a training
    replica's step changes faster, so every interval writes) while its inner phase lasts, to the
    supervisor's store under the run's secret, as the Publisher writes it: the pid is the light
    actor's own (the runner drops a value whose pid is not the one the roster knows for the
    replica). One process imports torch for all: 64 light actors importing it would take ~10 GB
    here. The supervisor's side — its store's server taking the writes, its one multi_get per
    tick — is the product's."""

    def __init__(self):
        self.clients: dict = {}
        self.writes = 0
        self.thread = None

    def connect(self, store_addr: str, rids: list[str]) -> int:
        from torchft.process_group import create_store_client

        from hsgd.train.progress_board import KEYS

        for rid in rids:
            if (store_addr, rid) not in self.clients:
                self.clients[(store_addr, rid)] = create_store_client(
                    f"{store_addr}/{KEYS}", timeout=timedelta(seconds=CALL_S)
                )
        return len(self.clients)

    def start(
        self, store_addr: str, round_index: int, pids: dict[str, int], spr: int, inner_s: float, interval_s: float = 0.5
    ) -> None:
        """Publish the steps of round_index of each replica in `pids` (rid -> its actor's pid), from its
        first step to its last over inner_s, from now."""
        if self.thread is not None:
            self.thread.join()
        clients = [(rid, pid, self.clients[(store_addr, rid)]) for rid, pid in pids.items()]

        def loop():
            t0 = time.monotonic()
            while (elapsed := time.monotonic() - t0 + interval_s) < inner_s:
                time.sleep(interval_s)
                step = round_index * spr + int(elapsed / inner_s * spr)
                for rid, pid, client in clients:
                    client.set(rid, f"{round_index},{step},{pid}")
                    self.writes += 1

        self.thread = threading.Thread(target=loop, name="board-writer", daemon=True)
        self.thread.start()

    def written(self) -> int:
        """Writes since the last read (after the last start's thread ended)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        writes, self.writes = self.writes, 0
        return writes


def lasting_rounds(
    actors: list, names: list, writer, clusters: int, per_cluster: int, inner_s: float, seed: int
) -> dict:
    """One size over the first clusters x per_cluster actors, the runner given a real store (the
    supervisor's: hsgd.train.comm.start_store, a rendezvous address under a fresh secret): the first
    round (groups formed; not reported), then an instant round (run_inner answers at once) and a
    lasting round (each run_inner answers inner_s after its call) twice — the product's default
    (steps read off the progress board, which `writer` fills) and by calls (the runner's fallback
    without a store, the path before issue 36's Build 1: a `progress` call per replica per tick).
    Each round counted by the actors; the lasting rounds' inner phase timed on the supervisor
    process's clocks."""
    from actors.round_runner import IDLE_POLL_S, TICK_S
    from benchmarks.plan import FakeRun
    from hsgd.core.topology import Topology
    from hsgd.train.comm import new_run_secret, rendezvous_address, start_store

    topology = Topology(clusters, per_cluster)
    rids = topology.replica_ids()
    handles = dict(zip(rids, actors, strict=False))
    answers = ray.get(
        [
            h.reset.remote(
                rid, STEPS_PER_ROUND, {p: handles[p] for p in topology.cluster_members(topology.cluster_of(rid))}
            )
            for rid, h in handles.items()
        ],
        timeout=CALL_S,
    )
    world = RayWorld(topology, handles, {a["rid"]: a for a in answers})
    run = FakeRun(topology, STEPS_PER_ROUND, random.Random(seed), world=world)
    roster = TableRoster(run.roster, dict(zip(rids, names, strict=False)))
    run.roster = run.ports.roster = roster
    host = ray.util.get_node_ip_address()
    store = start_store(host, CALL_S)
    run.ports.store, run.ports.store_addr = store, rendezvous_address(host, store.port, new_run_secret())
    ray.get(writer.connect.remote(run.ports.store_addr, rids), timeout=CALL_S)
    clock = InnerPhaseClock(run.log)

    def counted(case: str, seconds: float, board: bool) -> dict:
        ray.get([h.set_inner_s.remote(seconds) for h in handles.values()], timeout=CALL_S)
        actor_calls(handles)  # cleared: this round's calls only
        run.ports.store = store if board else None  # no store: the runner asks by calls
        if board and seconds > 0:
            pids = {rid: roster.pids.get(rid) for rid in rids}  # as the roster knows them (the runner checks)
            ray.get(
                writer.start.remote(run.ports.store_addr, run.committed_round, pids, STEPS_PER_ROUND, seconds),
                timeout=CALL_S,
            )
        reads0, wanted0, untold0 = roster.table_reads, roster.idle_wanted, roster.idle_untold
        events0 = run.log.counts.copy()
        clock.reset()
        t0, cpu0 = time.monotonic(), time.process_time()
        record = run.round(case)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        calls = actor_calls(handles)
        writes = ray.get(writer.written.remote(), timeout=CALL_S)
        run.ports.store = store
        events = run.log.counts - events0
        if record["outcome"] != "committed" or events["commit_decision"] != 1:
            raise RuntimeError(f"{case} round at {topology.num_replicas} actors did not commit: the bench is broken")
        return {
            "round_wall_s": wall,
            "round_supervisor_cpu_s": cpu,
            "machine_ticks": record["ticks"],
            "observations": record["observations"],
            "calls_per_round": sum(calls.values()),
            "calls_by_method": calls,
            "board_writes": writes,
            "table_reads": roster.table_reads - reads0,
            "idle_probes_wanted": roster.idle_wanted - wanted0,
            "idle_probes_untold": roster.idle_untold - untold0,
            **clock.figures(),
        }

    try:
        counted("first_round", 0.0, True)  # every group formed: no figure is of it
        board = summary(counted("instant", 0.0, True), counted("lasting", inner_s, True), clusters, inner_s, TICK_S)
        by_calls = summary(
            counted("instant", 0.0, False), counted("lasting", inner_s, False), clusters, inner_s, TICK_S
        )
    finally:
        ray.get([h.set_inner_s.remote(0.0) for h in handles.values()], timeout=CALL_S)
        run.ports.store = None  # the store's server stops with its last reference, at the return
    return {
        "replicas": topology.num_replicas,
        "clusters": clusters,
        "replicas_per_cluster": per_cluster,
        "inner_s": inner_s,
        "tick_s": TICK_S,
        "idle_poll_s": IDLE_POLL_S,
        "ticks": inner_s / TICK_S,
        **board,
        "by_calls": by_calls,
    }


def summary(instant: dict, lasting: dict, clusters: int, inner_s: float, tick_s: float) -> dict:
    """A size's figures from its instant and lasting rounds (counted the same way)."""
    ticks = inner_s / tick_s
    target = TARGET_CALLS_PER_CLUSTER_TICK * clusters * ticks
    extra = lasting["calls_per_round"] - instant["calls_per_round"]
    extra_by_method = {
        m: lasting["calls_by_method"].get(m, 0) - instant["calls_by_method"].get(m, 0)
        for m in sorted(set(lasting["calls_by_method"]) | set(instant["calls_by_method"]))
    }
    # progress calls: the runner's progress probes of replicas in run_inner (none while the board
    # answers), plus the idle liveness probes the actor table could not tell (both call `progress`;
    # `up` probes: none, nobody is down)
    idle_calls = lasting["idle_probes_untold"]
    return {
        "lasting": lasting,
        "instant": instant,
        "calls_per_round": lasting["calls_per_round"],
        "instant_calls_per_round": instant["calls_per_round"],
        "extra_calls_per_round": extra,
        "extra_calls_by_method": extra_by_method,
        "progress_seen_lasting": lasting["observations"] - instant["observations"],
        "progress_calls_lasting": lasting["calls_by_method"].get("progress", 0) - idle_calls,
        "idle_liveness_calls_lasting": idle_calls,
        "idle_liveness_calls_skipped_lasting": lasting["idle_probes_wanted"] - lasting["idle_probes_untold"],
        "target_extra_calls": target,
        "extra_calls_hold": extra <= target,
        "supervisor_cpu_per_inner_s": lasting["supervisor_cpu_per_inner_s"],
        "supervisor_main_thread_cpu_per_inner_s": lasting["supervisor_main_thread_cpu_per_inner_s"],
    }


def affine(xs: list[float], ys: list[float]) -> dict:
    """Least squares of y = fixed + slope * x, with r2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if len(xs) < 2 or sxx == 0:
        raise ValueError(f"a fit needs two sizes or more: {xs}")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    syy = sum((y - my) ** 2 for y in ys)
    residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"fixed": a, "per_replica": b, "r2": 1.0 - residual / syy if syy > 0 else 1.0, "sizes": len(xs)}


def lasting_fit(rows: list[dict], by_calls: bool = False) -> dict:
    """Extra calls per round and the supervisor's CPU per second of inner phase, each affine in
    replicas; the board path's (the product's default) with the by-calls path's beside it."""
    xs = [r["replicas"] for r in rows]
    figs = [r["by_calls"] if by_calls else r for r in rows]
    calls = affine(xs, [f["extra_calls_per_round"] for f in figs])
    cpu = affine(xs, [f["supervisor_cpu_per_inner_s"] for f in figs])
    ticks = rows[0]["ticks"]
    fit = {
        "extra_calls": {
            **calls,
            "per_replica_per_tick": calls["per_replica"] / ticks if ticks else None,
            "at_10000": calls["fixed"] + calls["per_replica"] * AT,
        },
        "supervisor_cpu_per_inner_s": {
            **cpu,
            "at_10000": cpu["fixed"] + cpu["per_replica"] * AT,
            "one_core_at_replicas": (1.0 - cpu["fixed"]) / cpu["per_replica"] if cpu["per_replica"] > 0 else None,
        },
        "calls_per_round": affine(xs, [f["calls_per_round"] for f in figs]),
        "instant_calls_per_round": affine(xs, [f["instant_calls_per_round"] for f in figs]),
    }
    return fit if by_calls else {**fit, "by_calls": lasting_fit(rows, by_calls=True)}


def lasting_holds(rows: list[dict], by_calls: bool = False) -> dict:
    """The issue's targets as figures, never asserts: extra calls <= 2 x clusters x ticks at every
    size; the supervisor's CPU per second of inner phase <= 5 % of a core at the largest size (64
    actors). The board path's (the product's default), and the by-calls path's beside it."""
    figs = [(r["replicas"], r["by_calls"] if by_calls else r) for r in rows]
    top = max(figs, key=lambda rf: rf[0])
    holds = {
        "extra_calls_le_2_clusters_ticks": all(f["extra_calls_hold"] for _, f in figs),
        "extra_calls_le_2_clusters_ticks_by_size": {str(n): f["extra_calls_hold"] for n, f in figs},
        "cpu_le_5pct_at_largest": top[1]["supervisor_cpu_per_inner_s"] <= TARGET_CPU_FRACTION,
        "largest_replicas": top[0],
    }
    return holds if by_calls else {**holds, "by_calls": lasting_holds(rows, by_calls=True)}


# -- fits --------------------------------------------------------------------------------------------------
def power_fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares of log(y) on log(x): y = coefficient * x ** growth_exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    if len(xs) < 2 or sxx == 0:
        raise ValueError(f"a growth order needs two sizes or more: {xs}")
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sxx
    syy = sum((b - my) ** 2 for b in ly)
    residual = sum((b - (my + k * (a - mx))) ** 2 for a, b in zip(lx, ly, strict=True))
    return {
        "growth_exponent": k,
        "coefficient_ms": math.exp(my - k * mx),
        "r2": 1.0 - residual / syy if syy > 0 else 1.0,
        "sizes": len(xs),
    }


def at(fit: dict, replicas: float) -> float:
    return fit["coefficient_ms"] * replicas ** fit["growth_exponent"]


def affine_fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares of y = fixed + per_replica * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_ms": my - b * mx, "per_replica_ms": b}


def decisions_fit(rows: list[dict]) -> dict:
    """The headline (fault-free machine + runner per round) and each figure's own growth order."""
    xs = [r["replicas"] for r in rows]
    figures = {
        f"fault_free_{key}": [r[key] for r in rows] for key in ("machine_plus_runner_ms", "machine_ms", "runner_ms")
    }
    figures["with_failures_machine_plus_runner_ms"] = [r["with_failures"]["machine_plus_runner_ms"] for r in rows]
    figures.update({key: [r[key] for r in rows] for key in ("plan_ms", "heal_assignment_ms", "outer_plan_ms")})
    by_figure = {name: power_fit(xs, ys) for name, ys in figures.items()}
    return {
        **by_figure["fault_free_machine_plus_runner_ms"],
        "figure": "fault_free_machine_plus_runner_ms",
        "by_figure": by_figure,
    }


def ray_fit(rows: list[dict]) -> dict:
    xs = [r["replicas"] for r in rows]
    fit = power_fit(xs, [r["round_ms_median"] for r in rows])
    affine = affine_fit(xs, [r["round_ms_median"] for r in rows])
    cpu = power_fit(xs, [max(r["driver_cpu_ms_median"], 1e-3) for r in rows])
    return {
        **fit,
        "figure": "round_ms_median",
        "affine": {**affine, "at_10000_ms": affine["fixed_ms"] + affine["per_replica_ms"] * AT},
        "driver_cpu": {**cpu, "at_10000_ms": at(cpu, AT)},
    }


# -- the suite ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for scale.json and scale.png")
    parser.add_argument(
        "--quick", action="store_true", help="the two smallest decision sizes, one round a case; Ray at 4 and 8 actors"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds timed per case and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--inner-s",
        type=float,
        default=None,
        help=f"how long each run_inner of part 3's lasting rounds lasts (default {INNER_S:g} s; "
        f"--quick: {QUICK_INNER_S:g} s)",
    )
    args = parser.parse_args(argv)
    from benchmarks.report import header, write_suite

    decision_sizes, ray_sizes, rounds = DECISION_SIZES, RAY_SIZES, args.rounds
    ray_rounds_n = args.rounds
    if args.quick:
        decision_sizes, ray_sizes, rounds, ray_rounds_n = QUICK_DECISION_SIZES, QUICK_RAY_SIZES, 1, 2
    inner_s = args.inner_s if args.inner_s is not None else QUICK_INNER_S if args.quick else INNER_S
    if inner_s <= 0:
        parser.error("--inner-s must be > 0 (the instant round is measured beside it)")
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-scale-")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for clusters, per_cluster in decision_sizes:
        rows.append(decisions(clusters, per_cluster, rounds, args.seed))
        d = rows[-1]
        print(
            f"scale decisions {d['replicas']:>6,} replicas / {clusters:>4} clusters: machine + runner per round "
            f"{d['machine_plus_runner_ms']:8.2f} ms fault-free (machine {d['machine_ms']:.2f}), "
            f"{d['with_failures']['machine_plus_runner_ms']:8.2f} ms with failures; plan {d['plan_ms']:.3f}, "
            f"heal assignment {d['heal_assignment_ms']:.3f}, outer plan {d['outer_plan_ms']:.3f} ms",
            flush=True,
        )
    fit = decisions_fit(rows)

    def on_size(r: dict) -> None:
        print(
            f"scale ray {r['replicas']:>3} actors / {r['clusters']:>2} clusters: "
            f"round {r['round_ms_median']:7.1f} ms "
            f"median (spread {r['round_ms_spread']:.1f}, driver CPU {r['driver_cpu_ms_median']:.1f} ms), first "
            f"{r['first_round_ms']:.1f} ms, after a restart {r['heal_round_ms']:.1f} ms",
            flush=True,
        )

    def on_lasting(r: dict) -> None:
        for path, f in (("board", r), ("by calls", r["by_calls"])):
            by = ", ".join(f"{m} {n}" for m, n in f["lasting"]["calls_by_method"].items())
            holds = "holds" if f["extra_calls_hold"] else "does not hold"
            print(
                f"scale lasting {r['replicas']:>3} actors / {r['clusters']:>2} clusters, {path:>8}: actor calls per "
                f"round {f['calls_per_round']} with a {r['inner_s']:g}-s inner phase ({by}), "
                f"{f['instant_calls_per_round']} instant: extra {f['extra_calls_per_round']} vs target "
                f"2 x clusters x ticks = {f['target_extra_calls']:.0f} ({holds}); "
                f"idle-liveness calls {f['idle_liveness_calls_lasting']} (skipped, the table tells: "
                f"{f['idle_liveness_calls_skipped_lasting']}), table reads {f['lasting']['table_reads']}, board "
                f"writes {f['lasting']['board_writes']}, progress seen {f['progress_seen_lasting']}; "
                f"supervisor CPU {f['supervisor_cpu_per_inner_s']:.1%} of a "
                f"core over the inner phase (main thread {f['supervisor_main_thread_cpu_per_inner_s']:.1%})",
                flush=True,
            )

    ray_rows, lasting_rows, idle_cpu = ray_side(ray_sizes, ray_rounds_n, args.seed, on_size, inner_s, on_lasting)
    rfit = ray_fit(ray_rows)
    lfit = lasting_fit(lasting_rows)
    holds = lasting_holds(lasting_rows)
    report = {
        **header("scale", argv, args.quick),
        "budget_ms": BUDGET_MS,
        "note": "ms per round on this machine; compare growth exponents and the extrapolation with the budget "
        "(1 % of a 60-s round), never as an assert",
        "steps_per_round": STEPS_PER_ROUND,
        "decisions": rows,
        "decisions_fit": fit,
        "ray_control_plane": ray_rows,
        "ray_fit": rfit,
        "ray_extrapolated_10000_ms": at(rfit, AT),
        "lasting_inner_s": inner_s,
        "lasting_rounds": lasting_rows,
        "lasting_fit": lfit,
        "lasting_targets": {
            "extra_calls_per_cluster_tick": TARGET_CALLS_PER_CLUSTER_TICK,
            "cpu_fraction_at_largest": TARGET_CPU_FRACTION,
        },
        "lasting_holds": holds,
        "driver_idle_cpu_per_s": idle_cpu,
        "lasting_note": "actor calls counted by the actors themselves (the replica API only); CPU: "
        "time.process_time() of the driver process running drive() (every thread: the runner's "
        "and Ray's core-worker threads; not the raylet, GCS or actors) over the lasting round's "
        "inner phase, first run_inner phase_begin to last phase_end, per wall second; "
        "targets are figures, never asserts",
    }
    write_suite(out, report)
    plot(report, out / "scale.png")
    print(
        f"scale: decisions grow as replicas^{fit['growth_exponent']:.2f} "
        f"({rows[-1]['machine_plus_runner_ms']:.1f} ms "
        f"at {rows[-1]['replicas']:,}); Ray per round grows as replicas^{rfit['growth_exponent']:.2f}, "
        f"{report['ray_extrapolated_10000_ms']:.0f} ms at {AT:,} (affine {rfit['affine']['at_10000_ms']:.0f} ms); "
        f"budget {BUDGET_MS:.0f} ms",
        flush=True,
    )
    for path, fit, hold in (("board", lfit, holds), ("by calls", lfit["by_calls"], holds["by_calls"])):
        print(
            f"scale lasting, {path}: extra calls per round = {fit['extra_calls']['fixed']:.1f} + "
            f"{fit['extra_calls']['per_replica']:.2f} x replicas ({fit['extra_calls']['per_replica_per_tick']:.2f} "
            f"per replica per tick); supervisor CPU per inner second = "
            f"{fit['supervisor_cpu_per_inner_s']['fixed']:.2%} + "
            f"{fit['supervisor_cpu_per_inner_s']['per_replica']:.3%} x replicas; "
            f"targets: extra calls <= 2 x clusters x ticks "
            f"{'holds' if hold['extra_calls_le_2_clusters_ticks'] else 'does not hold'}, CPU at "
            f"{hold['largest_replicas']} actors <= {TARGET_CPU_FRACTION:.0%} "
            f"{'holds' if hold['cpu_le_5pct_at_largest'] else 'does not hold'}",
            flush=True,
        )
    print(f"scale: scale.json and scale.png in {out}", flush=True)
    return 0


def plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    lasting = report.get("lasting_rounds") or []
    if lasting:
        fig, (ax, calls_ax, cpu_ax) = plt.subplots(1, 3, figsize=(17, 4.5), dpi=110)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    rows, ray_rows = report["decisions"], report["ray_control_plane"]
    span = [min(r["replicas"] for r in ray_rows + rows), AT]
    grid = [span[0] * (span[1] / span[0]) ** (i / 40) for i in range(41)]
    series = [
        ("decisions, fault-free round", [r["machine_plus_runner_ms"] for r in rows], "#3b75af", "o"),
        (
            "decisions, round with failures",
            [r["with_failures"]["machine_plus_runner_ms"] for r in rows],
            "#c44e52",
            "s",
        ),
        (
            "plan + heal assignment + outer plan",
            [r["plan_ms"] + r["heal_assignment_ms"] + r["outer_plan_ms"] for r in rows],
            "#55a868",
            "^",
        ),
    ]
    for label, ys, color, marker in series:
        ax.plot([r["replicas"] for r in rows], ys, marker, color=color, label=label)
    fit = report["decisions_fit"]
    ax.plot(
        grid,
        [at(fit, x) for x in grid],
        "-",
        color="#3b75af",
        lw=1,
        label=f"fit ∝ replicas^{fit['growth_exponent']:.2f}",
    )
    rfit = report["ray_fit"]
    ax.plot(
        [r["replicas"] for r in ray_rows],
        [r["round_ms_median"] for r in ray_rows],
        "D",
        color="#8172b2",
        label="Ray control plane, fault-free round (median)",
    )
    ax.plot(
        grid,
        [at(rfit, x) for x in grid],
        "--",
        color="#8172b2",
        lw=1,
        label=f"fit ∝ replicas^{rfit['growth_exponent']:.2f}, extrapolated",
    )
    ax.plot([AT], [report["ray_extrapolated_10000_ms"]], "D", mfc="none", color="#8172b2")
    ax.axhline(report["budget_ms"], color="#888", lw=1, ls=":", label=f"budget {report['budget_ms']:.0f} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("ms per round")
    ax.set_title("hsgd control plane vs size", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    if lasting:
        plot_lasting(report, calls_ax, cpu_ax)
        fig.tight_layout()
    save_png(fig, path)


def plot_lasting(report: dict, calls_ax, cpu_ax) -> None:
    """Part 3: actor calls per round vs replicas (lasting, instant, their difference, the target) and
    the supervisor's CPU per second of inner phase vs replicas (the 5 % target); the progress board's
    path (solid) and the by-calls path (dashed)."""
    rows = report["lasting_rounds"]
    xs = [r["replicas"] for r in rows]
    inner_s = report["lasting_inner_s"]
    paths = [("board", "-", rows)] + (
        [("by calls", "--", [r["by_calls"] for r in rows])] if all(r.get("by_calls") for r in rows) else []
    )
    for name, ls, figs in paths:
        calls_ax.plot(
            xs,
            [f["calls_per_round"] for f in figs],
            "o" + ls,
            color="#c44e52",
            label=f"{name}: lasting round ({inner_s:g}-s inner phase)",
        )
        calls_ax.plot(
            xs, [f["instant_calls_per_round"] for f in figs], "s" + ls, color="#3b75af", label=f"{name}: instant round"
        )
        calls_ax.plot(
            xs,
            [f["extra_calls_per_round"] for f in figs],
            "^" + ls,
            color="#8172b2",
            label=f"{name}: extra (lasting - instant)",
        )
        cpu_ax.plot(
            xs,
            [100 * f["supervisor_cpu_per_inner_s"] for f in figs],
            "o" + ls,
            color="#c44e52",
            label=f"{name}: driver process (all its threads)",
        )
        cpu_ax.plot(
            xs,
            [100 * f["supervisor_main_thread_cpu_per_inner_s"] for f in figs],
            "s" + ls,
            color="#55a868",
            label=f"{name}: drive()'s thread only",
        )
    calls_ax.plot(
        xs,
        [r["target_extra_calls"] for r in rows],
        ":",
        color="#888",
        marker="x",
        label="target for extra: 2 x clusters x ticks",
    )
    calls_ax.set_xlabel("replicas (light actors)")
    calls_ax.set_ylabel("actor calls per round (counted by the actors)")
    calls_ax.set_title("supervisor's actor calls per round", fontsize=10)
    calls_ax.legend(fontsize=7, loc="upper left")
    if report.get("driver_idle_cpu_per_s") is not None:
        cpu_ax.axhline(
            100 * report["driver_idle_cpu_per_s"], color="#888", lw=1, ls="-.", label="driver process at rest"
        )
    cpu_ax.axhline(
        100 * report["lasting_targets"]["cpu_fraction_at_largest"],
        color="#888",
        lw=1,
        ls=":",
        label="target at 64 actors",
    )
    cpu_ax.set_xlabel("replicas (light actors)")
    cpu_ax.set_ylabel("% of one core")
    cpu_ax.set_title(f"supervisor CPU per second of inner phase ({inner_s:g}-s phase)", fontsize=10)
    cpu_ax.set_ylim(bottom=0)
    cpu_ax.legend(fontsize=7, loc="upper left")


if __name__ == "__main__":
    sys.exit(main())
