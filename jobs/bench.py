"""Benchmarks: `python -m jobs.bench [--out DIR] [--rounds N] [--outer-every H]`, or
`python -m jobs.bench plan [--out DIR]` (the round machine's own cost at 10,000 replicas; no Ray), or
`python -m jobs.bench goodput [--out DIR] [--rounds N] [--mtbf 30 10]` (wall time under faults vs
fault-free, with and without hot spares; see jobs/bench_goodput.py).

Runs, one after another on one embedded Ray, the same model and data as:
- `flat`: one cluster of all replicas, ddp every step (what a flat trainer does across the slow link);
- `hierarchical`: the same replicas as clusters x replicas, ddp inside, DiLoCo every H steps;
- `hierarchical+fault`: the same with one replica killed mid-round;
and writes `bench.json` (+ `bench.png`) with each run's throughput, bytes over the slow link,
eval loss and wall time, and the ratios against `flat` measured in this same invocation — never
absolute thresholds. Bytes over the slow link: for `flat`, every inner all-reduce crosses it (one
cluster spans the sites); for `hierarchical`, only the outer all-reduce does.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]


def run(name: str, overrides: list[str], out: Path) -> dict:
    from actors.launch import compose_config, run_training
    from hsgd.config import validate
    from hsgd.record.rundir import read_jsonl

    cfg = compose_config(SMALL + overrides)
    validate(cfg)
    run_dir = out / name
    start = time.monotonic()
    summary = run_training(cfg, str(run_dir))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tps = [m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    slow_link = sum(m["outer_bytes"] for m in metrics) if "topology.clusters=1" not in overrides \
        else sum(m["inner_bytes"] for m in metrics)
    return {"name": name, "overrides": overrides, "status": summary["status"], "wall_s": time.monotonic() - start,
            "tokens_per_s_median": sorted(tps)[len(tps) // 2] if tps else None,
            "slow_link_bytes": slow_link, "final_eval_loss": summary["final_eval_loss"],
            "initial_eval_loss": summary["initial_eval_loss"], "faults": summary.get("faults", [])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    if argv[:1] == ["goodput"]:
        from jobs.bench_goodput import main as goodput_main

        return goodput_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for bench.json, bench.png and the runs")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--outer-every", type=int, default=20)
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--replicas-per-cluster", type=int, default=2)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = args.clusters * args.replicas_per_cluster
    common = [f"train.rounds={args.rounds}", f"sync.outer_every={args.outer_every}"]
    hier = common + [f"topology.clusters={args.clusters}", f"topology.replicas_per_cluster={args.replicas_per_cluster}"]
    cases = [
        ("flat", common + ["topology.clusters=1", f"topology.replicas_per_cluster={n}", "sync.outer=average"]),
        ("hierarchical", hier),
        ("hierarchical+fault", hier + [f"faults.schedule=[{{kind:kill,target:c0r1,round:{args.rounds // 2},"
                                       f"phase:inner,step:{args.outer_every // 2}}}]"]),
    ]
    import ray

    ray.init(num_cpus=max(n + 1, 2), namespace="hsgd-bench", include_dashboard=False, log_to_driver=False)
    try:
        results = [run(name, overrides, out) for name, overrides in cases]
    finally:
        ray.shutdown()
    flat = results[0]
    for r in results:
        r["ratio_vs_flat"] = {
            "tokens_per_s": (r["tokens_per_s_median"] / flat["tokens_per_s_median"])
            if r["tokens_per_s_median"] and flat["tokens_per_s_median"] else None,
            "slow_link_bytes": r["slow_link_bytes"] / flat["slow_link_bytes"] if flat["slow_link_bytes"] else None,
            "wall_s": r["wall_s"] / flat["wall_s"],
            "final_eval_loss": r["final_eval_loss"] / flat["final_eval_loss"] if flat["final_eval_loss"] else None,
        }
    report = {"machine_note": "timings are this machine's; compare the ratios, measured in one invocation",
              "args": vars(args), "results": results}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    _plot(results, out / "bench.png")
    for r in results:
        ratio = r["ratio_vs_flat"]
        print(f"{r['name']:>20}: {r['tokens_per_s_median'] or 0:9.0f} tok/s  slow link {r['slow_link_bytes'] / 1e6:8.2f} MB "
              f"(x{ratio['slow_link_bytes'] or 0:.3f})  eval {r['final_eval_loss']:.4f}  wall {r['wall_s']:.1f}s")
    print(f"bench.json and bench.png in {out}")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), dpi=110)
    for ax, key, label in zip(axes, ("tokens_per_s_median", "slow_link_bytes", "final_eval_loss"),
                              ("tokens/s (median round)", "bytes over the slow link", "final eval loss")):
        ax.bar(names, [r[key] or 0 for r in results], color=["#888", "#3b75af", "#c44e52"])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.suptitle("hsgd bench: hierarchical vs flat, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- suite `plan`: the round machine's decisions, timed at scale -------------------------------------------

def plan_main(argv: list[str]) -> int:
    """`python -m jobs.bench plan`: the supervisor's planning cost per round at 10,000 replicas in
    1,000 clusters (hsgd.core.round.RoundMachine, no Ray, no processes). Answers come back at once
    in a seeded random order; only the machine's own calls are timed (construction, start, every
    on_result / on_tick, and the actions they return), per round: fault-free rounds, the first round
    (every group configured), and rounds with a few failures (replicas dying mid-inner, a collective
    failing, a hang found by on_tick, a leader dying in the outer reduce, a whole cluster lost, a
    commit broadcast breaking in one cluster). Writes `plan.json` and prints it. The issue's budget
    (< 50 ms per round at 10,000) is a figure to compare, never an assert."""
    parser = argparse.ArgumentParser(prog="python -m jobs.bench plan", description=plan_main.__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for plan.json")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--replicas-per-cluster", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10, help="rounds timed per case")
    parser.add_argument("--steps-per-round", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = plan_bench(args.clusters, args.replicas_per_cluster, rounds=args.rounds, spr=args.steps_per_round,
                        seed=args.seed)
    report["args"] = vars(args)
    text = json.dumps(report, indent=2)
    (out / "plan.json").write_text(text)
    print(text)
    print(f"plan.json in {out}", file=sys.stderr)
    return 0


def plan_bench(clusters: int, per_cluster: int, *, rounds: int, spr: int, seed: int) -> dict:
    import platform
    import random

    from hsgd.core.round import RoundMachine, RoundSettings
    from hsgd.core.topology import Topology

    topo = Topology(clusters, per_cluster)
    settings = RoundSettings(steps_per_round=spr)
    rng = random.Random(seed)
    state = {"progress": {rid: (0, 0) for rid in topo.replica_ids()}, "leaders": {}, "configured": {},
             "outer": None, "epoch": 0, "round": 0}
    cases: dict[str, list[dict]] = {"first_round": [], "fault_free": [], "few_failures": []}

    def one(case: str, faults: dict | None) -> None:
        m_args = dict(progress=dict(state["progress"]), leaders=state["leaders"], epoch=state["epoch"],
                      committed_round=state["round"], configured=state["configured"],
                      outer_configured=state["outer"])
        timing = _PlanTimer()
        m = timing.call(RoundMachine, topo, settings, state["round"], **m_args)
        _PlanDriver(m, timing, state["progress"], spr, rng, faults or {}).run()
        assert m.outcome == "committed", (case, m.outcome, m.reason)
        state.update(leaders=dict(m.leaders), configured=m.configured_groups(), outer=m.outer_configured,
                     epoch=m.epoch, round=m.round + 1)
        for rid in m.dead:  # they come back and heal at the next round's start
            state["progress"][rid] = (0, 0)
        cases[case].append({"ms": timing.total * 1e3, "start_ms": timing.start * 1e3, "calls": timing.calls,
                            "actions": timing.actions, "kills": timing.kills, "ticks": timing.ticks})

    one("first_round", None)
    for _ in range(rounds):
        one("fault_free", None)
    for _ in range(rounds):
        one("few_failures", _few_failures(topo, state["leaders"], spr, rng))
    tick = _tick_cost(topo, settings, state, spr)
    m = RoundMachine(topo, settings, state["round"], progress=dict(state["progress"]), leaders=state["leaders"],
                     epoch=state["epoch"], committed_round=state["round"], configured=state["configured"],
                     outer_configured=state["outer"])
    m.start(0.0)
    t0 = time.perf_counter()
    for _ in range(20):
        m.plan()
    plan_call_ms = (time.perf_counter() - t0) / 20 * 1e3
    summary = {}
    for case, runs in cases.items():
        ms = [r["ms"] for r in runs]
        summary[case] = {"rounds": len(runs), "mean_ms": sum(ms) / len(ms), "max_ms": max(ms), "min_ms": min(ms),
                         "start_mean_ms": sum(r["start_ms"] for r in runs) / len(runs),
                         "actions_per_round": sum(r["actions"] for r in runs) / len(runs),
                         "machine_calls_per_round": sum(r["calls"] for r in runs) / len(runs),
                         "kills_per_round": sum(r["kills"] for r in runs) / len(runs)}
    every = [r["ms"] for runs in cases.values() for r in runs]
    return {"suite": "plan", "replicas": topo.num_replicas, "clusters": clusters, "steps_per_round": spr,
            "budget_ms_per_round": 50.0,
            "per_round_plan_ms": {"mean": sum(every) / len(every), "max": max(every)},
            "cases": summary, "tick": tick, "plan_view_call_ms": plan_call_ms,
            "machine_note": f"one process, {platform.python_implementation()} {platform.python_version()} on "
                            f"{platform.machine()}; machine calls only (the simulated answers are not timed)"}


class _PlanTimer:
    def __init__(self):
        self.total, self.calls, self.actions, self.kills, self.ticks = 0.0, 0, 0, 0, 0
        self.start = 0.0  # construction + start

    def call(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.total += time.perf_counter() - t0
        self.calls += 1
        if isinstance(out, list):
            self.actions += len(out)
        return out


class _PlanDriver:
    """Answers a machine's actions at once, in a random order, like replicas would (run_inner ->
    (round, end), outer_commit -> round + 1, heals copy the source); `faults`: rid -> (kind, what)
    with what in die | hang | collective; a hang never answers and is found by on_tick."""

    def __init__(self, m, timer: _PlanTimer, progress: dict, spr: int, rng, faults: dict):
        self.m, self.t, self.progress, self.spr, self.rng, self.faults = m, timer, progress, spr, rng, dict(faults)
        self.pending: list[tuple] = []  # (action, rid, outcome, new position)
        self.now = 0.0

    def run(self) -> None:
        from hsgd.core.round import PhaseResult

        self.issue(self.t.call(self.m.start, self.now))
        self.t.start = self.t.total
        while not self.m.done:
            if not self.pending:  # only hung replicas are left: time passes until the machine kills them
                self.now += 3600.0
                self.t.ticks += 1
                self.issue(self.t.call(self.m.on_tick, self.now))
                continue
            i = self.rng.randrange(len(self.pending))
            self.pending[i], self.pending[-1] = self.pending[-1], self.pending[i]
            a, rid, outcome, new = self.pending.pop()
            if new is not None:
                self.progress[rid] = new
            r, s = self.progress[rid] if outcome.value != "died" else (-1, -1)
            self.now += 1e-3
            result = PhaseResult(a.id, rid, outcome, r, s)
            t0 = time.perf_counter()  # inline, not through _PlanTimer.call: ~20,000 calls a round
            actions = self.m.on_result(result, self.now)
            self.t.total += time.perf_counter() - t0
            self.t.calls += 1
            self.t.actions += len(actions)
            self.issue(actions)

    def issue(self, actions) -> None:
        from hsgd.core.round import Outcome

        for a in actions:
            if a.kind == "kill":
                self.t.kills += 1
                continue
            r, end = a.round, (a.round + 1) * self.spr
            hit = {rid: self.faults.pop(rid)[1] for rid in a.calls if self.faults.get(rid, ("",))[0] == a.kind}
            if hit and a.kind == "outer_commit":
                groups = {rid.split("r")[0] for rid in hit}
                broken = [rid for rid in a.calls if rid.split("r")[0] in groups]
            else:
                broken = list(a.calls) if hit else []
            mid = (r, r * self.spr + self.spr // 2)
            for rid in a.calls:
                if rid in hit:
                    if hit[rid] == "hang":
                        continue
                    outcome = Outcome.DIED if hit[rid] == "die" else Outcome.COLLECTIVE_FAILED
                    self.pending.append((a, rid, outcome, mid if a.kind == "run_inner" and hit[rid] != "die" else None))
                elif rid in broken:
                    self.pending.append((a, rid, Outcome.COLLECTIVE_FAILED, mid if a.kind == "run_inner" else None))
                else:
                    self.pending.append((a, rid, Outcome.DONE, self._done(a, rid, r, end)))

    def _done(self, a, rid: str, r: int, end: int):
        if a.kind == "run_inner":
            return (r, end)
        if a.kind == "outer_commit":
            return (r + 1, end)
        if a.kind == "heal":
            source, scope = a.calls[rid]
            src = self.progress[source]
            return src if scope == "full" else (src[0], src[0] * self.spr)
        return None


def _few_failures(topo, leaders: dict, spr: int, rng) -> dict:
    """A few failures of each class in one round, on distinct clusters."""
    picked = rng.sample(range(topo.clusters), 12)
    faults = {}
    for c in picked[:5]:  # a replica dies mid-inner
        faults[f"c{c}r{rng.randrange(1, topo.replicas_per_cluster)}"] = ("run_inner", "die")
    faults[f"c{picked[5]}r1"] = ("run_inner", "collective")
    faults[f"c{picked[6]}r2"] = ("run_inner", "hang")
    faults[leaders.get(picked[7], f"c{picked[7]}r0")] = ("outer_reduce", "die")
    for rid in topo.cluster_members(picked[8]):  # a whole cluster
        faults[rid] = ("run_inner", "die")
    faults[f"c{picked[9]}r1"] = ("outer_commit", "die")
    return faults


def _tick_cost(topo, settings, state: dict, spr: int) -> dict:
    """One supervisor tick while every replica is in its inner phase: a progress report from each
    (on_progress) and one on_tick."""
    from hsgd.core.round import RoundMachine

    m = RoundMachine(topo, settings, state["round"], progress=dict(state["progress"]), leaders=state["leaders"],
                     epoch=state["epoch"], committed_round=state["round"], configured=state["configured"],
                     outer_configured=state["outer"])
    m.start(0.0)
    base = state["round"] * spr
    samples_progress, samples_tick = [], []
    for k in range(1, 6):
        now = k * 0.5
        t0 = time.perf_counter()
        for rid in m.progress:
            m.on_progress(rid, base + k, now)
        t1 = time.perf_counter()
        actions = m.on_tick(now)
        t2 = time.perf_counter()
        assert not actions
        samples_progress.append((t1 - t0) * 1e3)
        samples_tick.append((t2 - t1) * 1e3)
    return {"replicas_in_inner": len(m.progress), "on_progress_all_ms": sum(samples_progress) / len(samples_progress),
            "on_tick_ms": sum(samples_tick) / len(samples_tick), "period_s": 0.5}


if __name__ == "__main__":
    sys.exit(main())
