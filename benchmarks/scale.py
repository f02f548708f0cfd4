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

2. The Ray control plane per round (real Ray). A local Ray (`ray.init(num_cpus=4)`, token auth as
   by default) holds lightweight replica actors (`LightReplica`, `num_cpus=0`): each answers the
   replica API the round runner uses — run_inner, outer_reduce, outer_commit, progress,
   request_yield, send_state/receive_state — at once, with the answers of benchmarks/fake_ray.py's
   `Replica` (its own small state: committed round and step, a digest chain of the commits it
   applied), no model, no torch. The same round (bench_plan's `FakeRun`: a RoundMachine and
   `RoundRunner(machine, RunnerPorts(...)).drive()`) runs over the real actor handles with the
   real `ray.wait` / `ray.get` — nothing patched — at 4, 8, 16, 32 and 64 actors (2x2, 4x2, 8x2,
   16x2, 16x4). Per size: the first round (every group formed), `--rounds` fault-free rounds
   (`round_ms_median`: their wall, machine build to the end of `drive()`; `round_ms_spread`:
   max - min of them, ms; `driver_cpu_ms_median`: the supervisor process's CPU in them, Ray's
   threads in it included), then one round after one replica restarted (its state back at (0, 0),
   as Ray restarting it: a `full` heal over its cluster, the state passed from actor to actor).
   The actors share this machine's cores with Ray and the supervisor; on a cluster they would not,
   so the wall here is an upper bound of what the supervisor waits on.

Growth order: the least-squares slope of log(time) against log(replicas), `growth_exponent`
(1.0: linear; ~0: a fixed cost dominates), with `coefficient_ms` (time = coefficient x
replicas^exponent) and r2. The Ray side is extrapolated to 10,000 replicas with its own fit
(`ray_extrapolated_10000_ms`), and with an affine fit (a fixed cost plus a cost per replica) for
comparison. `budget_ms` (600: 1 % of a 60-s round) is a figure to compare, never an assert.

Every round must commit with the replicas' digests agreeing (bench_plan's checks), and the round
after a restart must heal, or the bench stops: a timing of a broken run means nothing. Writes
`<out>/scale.json` (the header of benchmarks/report.py, then `decisions`, `decisions_fit`,
`ray_control_plane`, `ray_fit`, `ray_extrapolated_10000_ms`, `budget_ms`) and `<out>/scale.png`
(log-log time vs replicas with the fits). `--quick` (a smoke run): the two smallest decision sizes,
one round a case; Ray at 4 and 8 actors.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import ray  # the actor below is defined at import; nothing heavier is imported here (the actors import this module)

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
    from hsgd.core.topology import Topology
    from benchmarks.plan import plan_bench

    report = plan_bench(clusters, per_cluster, rounds=rounds, spr=STEPS_PER_ROUND, train_s=0.0, seed=seed)
    cases = {}
    for case, label in (("first_round", "first_round"), ("fault_free", "fault_free"),
                        ("few_failures", "with_failures")):
        records = [r for r in report["rounds"] if r["case"] == case]
        cases[label] = {"rounds": len(records), **{key: statistics.median(r[key] for r in records)
                                                  for key in ("machine_ms", "runner_ms", "machine_plus_runner_ms")}}
    checks = report["checks"]
    return {"clusters": clusters, "replicas_per_cluster": per_cluster, "replicas": clusters * per_cluster,
            **{key: cases["fault_free"][key] for key in ("machine_ms", "runner_ms", "machine_plus_runner_ms")},
            **cases, **pure_decisions_ms(Topology(clusters, per_cluster)),
            "checks": {"rounds": checks["rounds"], "committed": checks["committed"],
                       "digests_agree": checks["digests_agree"], "failures_fired": checks["failures_fired"]}}


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
    return {"plan_ms": _per_call_ms(lambda: live_plan(topology, live, dict(leaders), 7)),
            "heal_assignment_ms": _per_call_ms(lambda: heals_at_rest(topology, progress)),
            "outer_plan_ms": _per_call_ms(
                lambda: shard_holders(members, holders, shard_count([len(m) for m in members], "sharded")))}


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
    """A fake Ref's answer, as the actor's reply (the Ray side arms no fault, so nothing is held)."""
    if ref.error is not None:
        raise ref.error
    assert ref.at == 0.0, "a light replica answers at once"
    return ref.value


@ray.remote(num_cpus=0)
class LightReplica:
    """A replica actor that skips the model work: benchmarks/fake_ray.py's Replica answers behind real
    Ray calls. `reset` gives it an id and a fresh state (round 0, step 0) and the handles of its
    cluster's members (a heal target takes its source's state from the source's actor)."""

    def __init__(self):
        self.replica, self.world, self.peers = None, None, {}

    def reset(self, rid: str, steps_per_round: int, peers: dict) -> dict:
        from benchmarks.fake_ray import Replica  # ray.exceptions and hsgd's topology and events: no torch

        self.world = _OwnWorld(steps_per_round)
        self.replica = Replica(self.world, rid, pid=os.getpid())
        self.peers = peers
        return _value(self.replica.progress())

    def restart(self) -> dict:
        """As Ray restarting the actor: a new incarnation at (0, 0). Its answer to the probe."""
        return self.replica.restart()

    # -- the replica API the round runner calls ------------------------------------------------------------
    def progress(self) -> dict:
        return _value(self.replica.progress())

    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> dict:
        return _value(self.replica.request_yield(epoch, round_index, step_in_round))

    def run_inner(self, round_index: int, faults=None, join=None, overlap=None, steps=None, store_addr=None) -> dict:
        return _value(self.replica.run_inner(round_index, faults, join, overlap, steps))

    def outer_reduce(self, round_index: int, epoch: int, faults=None, join=None, shard: int = 0,
                     shards: int = 1, weights: tuple = ()) -> dict:
        return _value(self.replica.outer_reduce(round_index, epoch, faults, join, shard, shards, weights))

    def outer_commit(self, round_index: int, roots: tuple, faults=None) -> dict:
        return _value(self.replica.outer_commit(round_index, roots, faults))

    def send_state(self, round_index: int, join: tuple, chunk_mb: float, faults=None) -> dict:
        return _value(self.replica.send_state(round_index, join, chunk_mb, faults))

    def receive_state(self, round_index: int, join: tuple, faults=None) -> dict:
        """The source's state, from its actor (the prefix names the source: actors/heals.py
        `.../heal/r<round>/<source>/<token>`), once its send_state ran; within STATE_WAIT_S."""
        prefix = join[2]
        source = self.peers[prefix.split("/")[-2]]
        deadline = time.monotonic() + STATE_WAIT_S
        while (state := ray.get(source.sent_state.remote(prefix), timeout=STATE_WAIT_S)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prefix}: the source's send_state never ran")
            time.sleep(0.001)
        self.world.heal_sources[prefix] = tuple(state)
        return _value(self.replica.receive_state(round_index, join, faults))

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


def start_actors(n: int) -> list:
    actors = [LightReplica.options(num_cpus=0).remote() for _ in range(n)]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=CALL_S)
    return actors


def ray_rounds(actors: list, clusters: int, per_cluster: int, rounds: int, seed: int) -> dict:
    """One size over the first clusters x per_cluster actors: the first round, `rounds`
    fault-free rounds, then one round after a replica restarted (it heals)."""
    from hsgd.core.outer_plan import holds_outer_group
    from hsgd.core.topology import Topology
    from benchmarks.plan import FakeRun

    topology = Topology(clusters, per_cluster)
    handles = dict(zip(topology.replica_ids(), actors))
    answers = ray.get([h.reset.remote(rid, STEPS_PER_ROUND,
                                      {p: handles[p] for p in topology.cluster_members(topology.cluster_of(rid))})
                       for rid, h in handles.items()], timeout=CALL_S)
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
    return {"replicas": topology.num_replicas, "clusters": clusters, "replicas_per_cluster": per_cluster,
            "rounds": rounds, "round_ms_median": statistics.median(walls), "round_ms_spread": max(walls) - min(walls),
            "round_ms_min": min(walls), "round_ms_max": max(walls),
            "machine_ms_median": statistics.median(r["machine_ms"] for r in fault_free),
            "driver_cpu_ms_median": statistics.median(r["driver_cpu_ms"] for r in fault_free),
            "first_round_ms": first["machine_plus_runner_ms"], "heal_round_ms": healed["machine_plus_runner_ms"],
            "heals": run.log.counts["heal_begin"] - heals0,
            "committed": sum(r["outcome"] == "committed" for r in [first, *fault_free, healed]),
            "events": dict(run.log.counts)}


def ray_side(sizes, rounds: int, seed: int, on_size) -> list[dict]:
    repo = str(Path(__file__).resolve().parent.parent)
    from benchmarks.report import bench_ray  # here, not at import: the actors import this module

    with bench_ray(num_cpus=4, namespace="hsgd-bench-scale",
                   runtime_env={"env_vars": {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}}):
        t0 = time.monotonic()
        actors = start_actors(max(c * n for c, n in sizes))
        try:
            print(f"scale: {len(actors)} light replica actors up in {time.monotonic() - t0:.1f} s", flush=True)
            results = []
            for clusters, per_cluster in sizes:
                results.append(ray_rounds(actors, clusters, per_cluster, rounds, seed))
                on_size(results[-1])
            return results
        finally:
            for actor in actors:
                ray.kill(actor)  # in a Ray the caller keeps running, nothing of ours stays behind


# -- fits --------------------------------------------------------------------------------------------------
def power_fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares of log(y) on log(x): y = coefficient * x ** growth_exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    if len(xs) < 2 or sxx == 0:
        raise ValueError(f"a growth order needs two sizes or more: {xs}")
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx
    syy = sum((b - my) ** 2 for b in ly)
    residual = sum((b - (my + k * (a - mx))) ** 2 for a, b in zip(lx, ly))
    return {"growth_exponent": k, "coefficient_ms": math.exp(my - k * mx),
            "r2": 1.0 - residual / syy if syy > 0 else 1.0, "sizes": len(xs)}


def at(fit: dict, replicas: float) -> float:
    return fit["coefficient_ms"] * replicas ** fit["growth_exponent"]


def affine_fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares of y = fixed + per_replica * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_ms": my - b * mx, "per_replica_ms": b}


def decisions_fit(rows: list[dict]) -> dict:
    """The headline (fault-free machine + runner per round) and each figure's own growth order."""
    xs = [r["replicas"] for r in rows]
    figures = {f"fault_free_{key}": [r[key] for r in rows]
               for key in ("machine_plus_runner_ms", "machine_ms", "runner_ms")}
    figures["with_failures_machine_plus_runner_ms"] = [r["with_failures"]["machine_plus_runner_ms"] for r in rows]
    figures.update({key: [r[key] for r in rows] for key in ("plan_ms", "heal_assignment_ms", "outer_plan_ms")})
    by_figure = {name: power_fit(xs, ys) for name, ys in figures.items()}
    return {**by_figure["fault_free_machine_plus_runner_ms"], "figure": "fault_free_machine_plus_runner_ms",
            "by_figure": by_figure}


def ray_fit(rows: list[dict]) -> dict:
    xs = [r["replicas"] for r in rows]
    fit = power_fit(xs, [r["round_ms_median"] for r in rows])
    affine = affine_fit(xs, [r["round_ms_median"] for r in rows])
    cpu = power_fit(xs, [max(r["driver_cpu_ms_median"], 1e-3) for r in rows])
    return {**fit, "figure": "round_ms_median", "affine": {**affine, "at_10000_ms": affine["fixed_ms"] +
                                                          affine["per_replica_ms"] * AT},
            "driver_cpu": {**cpu, "at_10000_ms": at(cpu, AT)}}


# -- the suite ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for scale.json and scale.png")
    parser.add_argument("--quick", action="store_true",
                        help="the two smallest decision sizes, one round a case; Ray at 4 and 8 actors")
    parser.add_argument("--rounds", type=int, default=5, help="rounds timed per case and size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from benchmarks.report import header, write_suite

    decision_sizes, ray_sizes, rounds = DECISION_SIZES, RAY_SIZES, args.rounds
    ray_rounds_n = args.rounds
    if args.quick:
        decision_sizes, ray_sizes, rounds, ray_rounds_n = QUICK_DECISION_SIZES, QUICK_RAY_SIZES, 1, 2
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-scale-")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for clusters, per_cluster in decision_sizes:
        rows.append(decisions(clusters, per_cluster, rounds, args.seed))
        d = rows[-1]
        print(f"scale decisions {d['replicas']:>6,} replicas / {clusters:>4} clusters: machine + runner per round "
              f"{d['machine_plus_runner_ms']:8.2f} ms fault-free (machine {d['machine_ms']:.2f}), "
              f"{d['with_failures']['machine_plus_runner_ms']:8.2f} ms with failures; plan {d['plan_ms']:.3f}, "
              f"heal assignment {d['heal_assignment_ms']:.3f}, outer plan {d['outer_plan_ms']:.3f} ms", flush=True)
    fit = decisions_fit(rows)

    def on_size(r: dict) -> None:
        print(f"scale ray {r['replicas']:>3} actors / {r['clusters']:>2} clusters: "
              f"round {r['round_ms_median']:7.1f} ms "
              f"median (spread {r['round_ms_spread']:.1f}, driver CPU {r['driver_cpu_ms_median']:.1f} ms), first "
              f"{r['first_round_ms']:.1f} ms, after a restart {r['heal_round_ms']:.1f} ms", flush=True)

    ray_rows = ray_side(ray_sizes, ray_rounds_n, args.seed, on_size)
    rfit = ray_fit(ray_rows)
    report = {**header("scale", argv, args.quick), "budget_ms": BUDGET_MS,
              "note": "ms per round on this machine; compare growth exponents and the extrapolation with the budget "
                      "(1 % of a 60-s round), never as an assert",
              "steps_per_round": STEPS_PER_ROUND, "decisions": rows, "decisions_fit": fit,
              "ray_control_plane": ray_rows, "ray_fit": rfit, "ray_extrapolated_10000_ms": at(rfit, AT)}
    write_suite(out, report)
    plot(report, out / "scale.png")
    print(f"scale: decisions grow as replicas^{fit['growth_exponent']:.2f} "
          f"({rows[-1]['machine_plus_runner_ms']:.1f} ms "
          f"at {rows[-1]['replicas']:,}); Ray per round grows as replicas^{rfit['growth_exponent']:.2f}, "
          f"{report['ray_extrapolated_10000_ms']:.0f} ms at {AT:,} (affine {rfit['affine']['at_10000_ms']:.0f} ms); "
          f"budget {BUDGET_MS:.0f} ms; scale.json and scale.png in {out}", flush=True)
    return 0


def plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    rows, ray_rows = report["decisions"], report["ray_control_plane"]
    span = [min(r["replicas"] for r in ray_rows + rows), AT]
    grid = [span[0] * (span[1] / span[0]) ** (i / 40) for i in range(41)]
    series = [("decisions, fault-free round", [r["machine_plus_runner_ms"] for r in rows], "#3b75af", "o"),
              ("decisions, round with failures", [r["with_failures"]["machine_plus_runner_ms"] for r in rows],
               "#c44e52", "s"),
              ("plan + heal assignment + outer plan", [r["plan_ms"] + r["heal_assignment_ms"] + r["outer_plan_ms"]
                                                       for r in rows], "#55a868", "^")]
    for label, ys, color, marker in series:
        ax.plot([r["replicas"] for r in rows], ys, marker, color=color, label=label)
    fit = report["decisions_fit"]
    ax.plot(grid, [at(fit, x) for x in grid], "-", color="#3b75af", lw=1,
            label=f"fit ∝ replicas^{fit['growth_exponent']:.2f}")
    rfit = report["ray_fit"]
    ax.plot([r["replicas"] for r in ray_rows], [r["round_ms_median"] for r in ray_rows], "D", color="#8172b2",
            label="Ray control plane, fault-free round (median)")
    ax.plot(grid, [at(rfit, x) for x in grid], "--", color="#8172b2", lw=1,
            label=f"fit ∝ replicas^{rfit['growth_exponent']:.2f}, extrapolated")
    ax.plot([AT], [report["ray_extrapolated_10000_ms"]], "D", mfc="none", color="#8172b2")
    ax.axhline(report["budget_ms"], color="#888", lw=1, ls=":", label=f"budget {report['budget_ms']:.0f} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("ms per round")
    ax.set_title("hsgd control plane vs size", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
