"""Plan benchmark: `python -m benchmarks plan [--out DIR] [--rounds N] [--quick]`.

The supervisor's control plane per round at 10,000 replicas in 1,000 clusters: the round machine
(hsgd/core/round) AND its runner (actors/round_runner.py), driven as the supervisor drives them —
`RoundRunner(machine, RunnerPorts(...)).drive()` — against a fake Ray whose replicas answer at once
(benchmarks/fake_ray.py: handles, ray.wait/get/kill, a roster, a log, an injector). Per round:

    machine_plus_runner_ms  the round's wall (building the machine and the runner, then `drive()`),
                            less the fake's own time (building answers, scanning refs) and its
                            waits (nothing ready: a held call, a round that trains)
    machine_ms              the machine's own calls within it (construction, start, observe,
                            observe_all, tick)
    runner_ms               the rest: the runner, its RoundRecord and Heals, its reads of the
                            machine's state, the status it builds
    machine_one_call_per_answer_ms  the same observations replayed into a fresh machine, one
                            `observe` call each (the machine is pure: the replay must end the same)

Cases, each round starting from the last one's view as the supervisor's does: the first round
(every group formed), fault-free rounds, and rounds with a few failures — replicas dying in
run_inner (Ray's error for the call; or a call Ray holds, the death read from the actor table), a
member dying as its group forms (its peers released: `join_aborted`), a cluster's collective
failing once, the leaders' outer reduce failing once; the dead come back at the next round's start
at step 0 and heal over the group. Then one round that trains `--train-s` seconds: its ticks (every
replica asked for its step each TICK_S) give the cost of one tick while everyone trains, and with
it an estimate for a 60-s round (its at-once cost plus 120 ticks).

Seam: the runner uses the module-level `ray` (ray.wait / ray.get / ray.kill) of
actors/round_runner.py, actors/replica_calls.py, actors/heals.py and actors/hang.py; for the
duration of the run each is swapped for the fake's (benchmarks.fake_ray.patched_ray), and restored.

Every round must commit with the replicas' digests agreeing, and every armed failure must have
fired, or the bench stops (a timing of a broken run means nothing). Writes plan.json. The budget —
under 1 % of a 60-s round, 600 ms for machine + runner — is a figure to compare, never an assert.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from actors.round_runner import TICK_S, RoundRunner, RunnerPorts
from benchmarks.fake_ray import PHASE_METHODS, FakeInjector, FakeLog, FakeRoster, World, patched_ray
from hsgd.core.deadlines import PhaseClock
from hsgd.core.round import RoundMachine, RoundSettings
from hsgd.core.topology import Topology
from hsgd.record.rundir import atomic_write_text

BUDGET_MS = 600.0  # 1 % of a 60-s round
ROUND_S = 60.0
AT_ONCE_CASES = ("first_round", "fault_free", "few_failures")
# failures armed in a few_failures round, one per cluster, in this order while clusters last
# (one cluster is always left clean); `die` on a cluster whose group forms comes first when there is one
FAILURES = ("die", "die_held", "collective", "die", "collective")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plan", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for plan.json")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--replicas-per-cluster", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5, help="rounds timed per case (fault-free, few failures)")
    parser.add_argument("--steps-per-round", type=int, default=100)
    parser.add_argument(
        "--train-s",
        type=float,
        default=3.0,
        help="how long run_inner takes in the round that trains (0: no such round)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 clusters x 3 replicas, 2 rounds, a 1-s training round")
    args = parser.parse_args(argv)
    if args.quick:
        args.clusters, args.replicas_per_cluster, args.rounds, args.train_s = 4, 3, 2, 1.0
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = plan_bench(
        args.clusters,
        args.replicas_per_cluster,
        rounds=args.rounds,
        spr=args.steps_per_round,
        train_s=args.train_s,
        seed=args.seed,
    )
    report.update(
        reference_ms=reference_ms(),
        args=vars(args),
        machine_note=f"one process, {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.machine()}; the fake Ray's own time and its waits are taken out",
    )
    atomic_write_text(out / "plan.json", json.dumps(report, indent=2))
    print(summary_line(report, out))
    return 0


def summary_line(report: dict, out: Path) -> str:
    per, cases, train = report["per_round_ms"], report["cases"], report.get("while_training")
    each = ", ".join(
        f"{case.replace('_', ' ')} {c['machine_plus_runner_ms']['mean']:.0f} (machine {c['machine_ms']['mean']:.0f})"
        for case, c in cases.items()
    )
    line = (
        f"plan at {report['replicas']:,} replicas / {report['clusters']:,} clusters, machine + runner per round, "
        f"mean ms: {each}; all rounds {per['machine_plus_runner']['mean']:.0f} mean, "
        f"{per['machine_plus_runner']['max']:.0f} max (machine one call per answer "
        f"{per['machine_one_call_per_answer']['mean']:.0f} mean); budget {BUDGET_MS:.0f} ms"
    )
    if train:
        line += (
            f"; while training {train['per_tick_ms']:.1f} ms per tick, a {ROUND_S:.0f}-s round "
            f"~{train['a_60s_round_ms_estimate']:.0f} ms"
        )
    return line + f"; reference workload {report['reference_ms']:.1f} ms; plan.json in {out}"


def reference_ms() -> float:
    """This interpreter's speed on a fixed pure-Python workload (dict and tuple churn like the
    machine's bookkeeping; best of 5), so plan times from different machines compare as ratios:
    the per-round figure divided by this one is machine-independent to within a few tens of %."""
    best = float("inf")
    keys = [f"c{c}r{i}" for c in range(100) for i in range(10)]
    for _ in range(5):
        t0 = time.perf_counter()
        table: dict = {}
        for k in range(10):
            for key in keys:
                table[key] = (k, len(key))
            pending = set(keys)
            for key in keys:
                pending.discard(key)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def plan_bench(clusters: int, per_cluster: int, *, rounds: int, spr: int, train_s: float, seed: int) -> dict:
    run = FakeRun(Topology(clusters, per_cluster), spr, random.Random(seed))
    records = []
    with patched_ray(run.world.ray) as patched:
        records.append(run.round("first_round"))
        records += [run.round("fault_free") for _ in range(rounds)]
        records += [run.round("few_failures") for _ in range(rounds)]
        if train_s > 0:
            records.append(run.round("while_training", train_s=train_s))
    report = {
        "suite": "plan",
        "replicas": clusters * per_cluster,
        "clusters": clusters,
        "steps_per_round": spr,
        "budget_ms_per_round": BUDGET_MS,
        "tick_s": TICK_S,
    }
    at_once = [r for r in records if r["case"] in AT_ONCE_CASES]
    report["per_round_ms"] = {
        "machine_plus_runner": _stats(at_once, "machine_plus_runner_ms"),
        "machine": _stats(at_once, "machine_ms"),
        "machine_one_call_per_answer": _stats(at_once, "machine_one_call_per_answer_ms"),
    }
    report["cases"] = {case: _case(rs) for case in AT_ONCE_CASES if (rs := [r for r in records if r["case"] == case])}
    training = [r for r in records if r["case"] == "while_training"]
    if training:
        report["while_training"] = _while_training(
            training[0], [r for r in records if r["case"] == "fault_free"], train_s
        )
    report["checks"] = {
        "rounds": len(records),
        "committed": sum(r["outcome"] == "committed" for r in records),
        "digests_agree": all(r["digests_agree"] for r in records),
        "failures_fired": dict(run.world.fired),
        "events": dict(run.log.counts),
        "fake_calls": dict(run.world.calls),
        "waits_fetching_local": run.world.fetch_local_waits,
        "ray_patched_in": patched,
    }
    report["rounds"] = records
    return report


class MachineTimer:
    """Times a machine's entry points (start, observe, observe_all, tick: wrappers set on the
    instance, shadowing its methods) and records every call made from outside, for the replay. A
    call made from within one of them (observe_all -> observe) counts as part of it."""

    ENTRIES = ("start", "observe", "observe_all", "tick")

    def __init__(self, machine: RoundMachine):
        self.seconds, self.inside = 0.0, False
        self.calls: list[tuple[str, tuple]] = []
        for name in self.ENTRIES:
            setattr(machine, name, self._timed(name, getattr(machine, name)))

    def _timed(self, name: str, method):
        def timed(*args):
            if self.inside:
                return method(*args)
            self.calls.append((name, args))
            self.inside, t0 = True, time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.inside = False

        return timed

    def observations(self) -> int:
        return sum(len(args[0]) if name == "observe_all" else name == "observe" for name, args in self.calls)


def replay(build: dict, calls: list[tuple[str, tuple]]) -> tuple[float, RoundMachine]:
    """The machine's inputs of a round, into a fresh machine, one `observe` per observation: its
    seconds (construction included, as in the round) and the machine."""
    t0 = time.perf_counter()
    m = RoundMachine(**build)
    for name, args in calls:
        if name == "observe_all":
            observations, now = args
            for o in observations:
                m.observe(o, now)
        else:
            getattr(m, name)(*args)
    return time.perf_counter() - t0, m


class FakeRun:
    """The supervisor's side between rounds (what actors/supervisor.py `_round` keeps: the epoch,
    leaders, standing groups, the committed round), over a fake world."""

    def __init__(self, topology: Topology, spr: int, rng: random.Random, world=None):
        """`world`: the replicas the rounds drive (default: a fake World); benchmarks/scale.py
        passes real Ray actors behind the same attributes."""
        from torch.distributed import HashStore  # a real store in this process: AbortJoin really aborts

        self.topology, self.spr, self.rng = topology, spr, rng
        self.world = world if world is not None else World(topology, spr)
        self.log = FakeLog()
        self.roster = FakeRoster(self.world, self.log)
        self.settings = RoundSettings(steps_per_round=spr)
        self.statuses = 0
        self.ports = RunnerPorts(
            roster=self.roster,
            log=self.log,
            injector=FakeInjector(),
            clock=PhaseClock(),
            set_status=self._set_status,
            save_epoch=self._save_epoch,
            store=HashStore(),
            store_addr="127.0.0.1:0/bench-secret",
            run_id="bench",
            run_dir=tempfile.gettempdir(),
            stack_dumps=False,
        )
        self.epoch = self.committed_round = 0
        self.leaders: dict[int, str] = {}
        self.configured: dict[int, tuple] = {}
        self.outer_configured = None
        self.returning: set[int] = set()  # clusters a restarted replica rejoins at this round's start

    def _set_status(self, **fields) -> None:  # the runner builds the view (timed); writing status.json is not
        self.statuses += 1

    def _save_epoch(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)

    def round(self, case: str, train_s: float = 0.0) -> dict:
        r, world = self.committed_round, self.world
        armed = self._arm_failures() if case == "few_failures" else []
        world.inner_s = train_s
        build = dict(
            topology=self.topology,
            settings=self.settings,
            round_index=r,
            progress=dict(self.roster.live),
            leaders=dict(self.leaders),
            epoch=self.epoch,
            committed_round=r,
            configured=dict(self.configured),
            outer_configured=self.outer_configured,
        )
        fake0, slept0, calls0 = world.fake_s, world.slept_s, world.calls.copy()
        t0 = time.perf_counter()
        machine = RoundMachine(**build)
        built_s = time.perf_counter() - t0
        timer = MachineTimer(machine)
        runner = RoundRunner(machine, self.ports)
        runner.drive()
        wall_s = time.perf_counter() - t0
        fake_s, slept_s = world.fake_s - fake0, world.slept_s - slept0
        world.inner_s = 0.0
        replay_s, again = replay(build, timer.calls)
        if (again.outcome, again.epoch, again.progress) != (machine.outcome, machine.epoch, machine.progress):
            raise RuntimeError(
                f"round {r} ({case}): the replayed machine ended {again.outcome!r}, not "
                f"{machine.outcome!r}: the machine is not a pure function of its inputs"
            )
        digests = set(runner.record.commit_digests.values())
        if machine.outcome != "committed" or len(digests) != 1:
            raise RuntimeError(
                f"round {r} ({case}) ended {machine.outcome!r} ({machine.reason}) with commit digests "
                f"{sorted(digests)}: the fake world or the runner is broken; no timing of it"
            )
        unfired = world.disarm()
        if unfired:
            raise RuntimeError(f"round {r} ({case}): armed failures never happened: {unfired}")
        self._between_rounds(machine)
        calls = world.calls - calls0
        total_s = wall_s - fake_s - slept_s
        machine_s = built_s + timer.seconds
        return {
            "case": case,
            "round": r,
            "outcome": machine.outcome,
            "digests_agree": True,
            "failures": armed,
            "machine_plus_runner_ms": total_s * 1e3,
            "machine_ms": machine_s * 1e3,
            "runner_ms": (total_s - machine_s) * 1e3,
            "machine_one_call_per_answer_ms": replay_s * 1e3,
            "fake_ray_ms": fake_s * 1e3,
            "waited_ms": slept_s * 1e3,
            "wall_ms": wall_s * 1e3,
            "ticks": sum(name == "tick" for name, _ in timer.calls),
            "observations": timer.observations(),
            "phase_calls": sum(calls[m] for m in PHASE_METHODS),
            "probes": calls["progress"],
            "deaths": len(machine.deaths),
        }

    def _arm_failures(self) -> list[str]:
        """This round's failures, on distinct clusters (one left clean), plus the outer reduce's."""
        armed = []
        forming = sorted(self.returning)
        if forming:  # its group forms this round: its first member dies in the rendezvous
            c = forming[0]
            self.world.arm("run_inner", c, "die", self.topology.cluster_members(c)[0])
            armed.append(f"die (forming) c{c}")
        steady = [c for c in range(self.topology.clusters) if c not in self.returning]
        room = max(0, self.topology.clusters - 1 - len(armed))
        for what, c in zip(
            FAILURES[:room], self.rng.sample(steady, min(room, len(steady), len(FAILURES))), strict=False
        ):
            members = [rid for rid in self.topology.cluster_members(c) if rid in self.roster.live]
            self.world.arm("run_inner", c, what, None if what == "collective" else self.rng.choice(members))
            armed.append(f"{what} c{c}")
        self.world.arm("outer_reduce", None, "collective")
        return armed + ["collective outer_reduce"]

    def _between_rounds(self, machine: RoundMachine) -> None:
        """As the supervisor: keep the machine's view; the dead come back (Ray restarted them)."""
        self.epoch, self.committed_round = machine.epoch, machine.round + 1
        self.leaders, self.configured = dict(machine.leaders), machine.configured_groups()
        self.outer_configured = machine.outer_configured
        self.returning = set()
        for rid in self.world.dead():
            answer = self.world.restart(rid)
            self.roster.note_up(rid, answer)
            self.roster.live[rid] = (answer["round"], answer["step"])
            self.returning.add(self.topology.cluster_of(rid))


def _stats(records: list[dict], key: str) -> dict:
    values = [r[key] for r in records]
    return {"mean": sum(values) / len(values), "max": max(values)}


def _case(records: list[dict]) -> dict:
    n = len(records)
    out = {"rounds": n}
    for key in (
        "machine_plus_runner_ms",
        "machine_ms",
        "runner_ms",
        "machine_one_call_per_answer_ms",
        "fake_ray_ms",
        "waited_ms",
    ):
        out[key] = _stats(records, key)
    for key in ("ticks", "observations", "phase_calls", "probes", "deaths"):
        out[f"{key}_per_round"] = sum(r[key] for r in records) / n
    return out


def _while_training(trained: dict, fault_free: list[dict], train_s: float) -> dict:
    """A tick's cost while every replica trains: what the training round cost beyond a fault-free
    round answered at once, per tick beyond its ticks (0 when lost in the noise, as at a few
    replicas); a 60-s round is its at-once cost plus a tick every TICK_S."""
    base_ms = sum(r["machine_plus_runner_ms"] for r in fault_free) / len(fault_free) if fault_free else 0.0
    base_ticks = sum(r["ticks"] for r in fault_free) / len(fault_free) if fault_free else 0.0
    per_tick_ms = max(0.0, trained["machine_plus_runner_ms"] - base_ms) / max(1.0, trained["ticks"] - base_ticks)
    ticks_60s = ROUND_S / TICK_S
    return {
        "train_s": train_s,
        "ticks": trained["ticks"],
        "machine_plus_runner_ms": trained["machine_plus_runner_ms"],
        "machine_ms": trained["machine_ms"],
        "per_tick_ms": per_tick_ms,
        "ticks_per_60s_round": ticks_60s,
        "a_60s_round_ms_estimate": base_ms + ticks_60s * per_tick_ms,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
