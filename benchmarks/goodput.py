"""Goodput benchmark: `python -m benchmarks goodput [--quick] [--out DIR] [--mtbf 30 10] [--peers torchft]
[--spares 0 1 --rounds N]`.

hsgd vs torchft (and with `--peers torchft ray_train` Ray Train, which loses the steps since its
last checkpoint at each failure) under the same failure process (issue 23, Build 3; `--peers none`
skips it): each
side trains 3 replicas of hsgd's model for `--steps` steps padded to `--min-step-s` (so 2 shared
cores do not decide the result: a missing replica must not look like a speed-up) — hsgd as one
cluster of 3 (ddp every step, the flat peers' work), torchft with its fast settings
(benchmarks/peers/torchft_peer.py) — once fault-free, then at each MTBF with replicas SIGKILLed from
outside at the same seeded times (exponential gaps of mean MTBF, victims drawn uniformly, the same
draw for both sides). Per run: goodput = fault-free span / span (the same side's; `span_s`: from
the first committed step to the last replica's last, the window the failures are timed in), and the
committed-step efficiency (distinct steps committed / steps committed, a redone step counted
twice). `goodput.json` `runs` and `goodput.png`.

With `--spares` (hsgd alone, its fault injector), one embedded Ray, the same config (default 2 x 2,
tiny model): a fault-free run for each spare count, then runs with random kill/crash faults at each
mean time between failures, without and with one hot spare per cluster. Fault times map to step boundaries using the
fault-free run's measured seconds per step, so `--mtbf 30` means one fault per ~30 s of this
machine's training. Writes `goodput.json` (wall time, goodput = wall of the fault-free run with the
same spares / wall, the ratio to the fault-free run without spares, and per fault the median
detection, re-plan, restart, heal and rejoin seconds) and `goodput.png` (where the time went).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.fault_costs import fault_costs, goodput, summarize_costs
from benchmarks.report import bench_ray, header, write_suite
from hsgd.record.rundir import read_jsonl

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]


def _run(name: str, overrides: list[str], out: Path) -> dict:
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    cfg = compose_config(QUIET + overrides)
    validate(cfg)
    run_dir = out / name
    summary = run_training(cfg, str(run_dir))
    costs = fault_costs(read_jsonl(run_dir / "faults_fired.jsonl"), read_jsonl(run_dir / "events.jsonl"))
    return {
        "name": name,
        "overrides": overrides,
        "status": summary["status"],
        "train_wall_s": summary.get("wall_s"),
        "rounds_committed": summary.get("rounds_committed"),
        "final_eval_loss": summary.get("final_eval_loss"),
        "costs": costs,
        "cost_medians": summarize_costs(costs),
    }


def failure_process(
    mtbf_s: float, span_s: float, replicas: int, seed: int, start_s: float = 3.0
) -> list[tuple[float, int]]:
    """(seconds after the first committed step, replica index) of each failure: exponential gaps of
    mean mtbf_s from start_s up to span_s, victims drawn uniformly — one seeded draw, used by every side."""
    rng = random.Random(f"{seed}:{mtbf_s}")
    times, t = [], start_s
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= span_s:
            return times
        times.append((round(t, 3), rng.randrange(replicas)))


def training_span_s(run: dict, steps: int) -> float | None:
    """Seconds from the first step any replica committed to the moment the last replica that got there
    committed step `steps`: the span the failure process is timed in, on every side alike. Not the
    runner's wall: that one also holds each side's start-up (the first run in this process starts
    Ray's workers: tens of seconds more for hsgd's fault-free run, a goodput above 1) and shut-down."""
    from benchmarks.peers.common import read_steps

    rows = read_steps(run["steps_dir"])
    first = min((row["t"] for replica in rows.values() for row in replica), default=None)
    reached = [next((row["t"] for row in replica if row["step"] >= steps), None) for replica in rows.values()]
    reached = [t for t in reached if t is not None]
    return max(reached) - first if first is not None and reached else None


def step_efficiency(run: dict) -> float | None:
    """Distinct (replica, step) committed / every step committed: a step redone after a rollback or
    a restart counts twice below the line."""
    from benchmarks.peers.common import read_steps

    rows = read_steps(run["steps_dir"])
    total = sum(len(r) for r in rows.values())
    return sum(len({x["step"] for x in r}) for r in rows.values()) / total if total else None


def _side(
    side: str, *, replicas: int, steps: int, min_step_s: float, out: Path, kills: list[tuple[float, int]], seed: int
) -> dict:
    if side == "hsgd":
        from benchmarks.peers.hsgd_peer import run_hsgd

        run = run_hsgd(
            model="tiny",
            clusters=1,
            replicas_per_cluster=replicas,
            steps=steps,
            min_step_s=min_step_s,
            out=out,
            kill_times_s=[(t, f"c0r{i}") for t, i in kills],
            seed=seed,
        )
        run["steps_dir"] = str(Path(run["run_dir"]) / "steps")
    elif side == "torchft":
        from benchmarks.peers.torchft_peer import run_torchft

        run = run_torchft(
            model="tiny",
            replicas=replicas,
            steps=steps,
            min_step_s=min_step_s,
            settings="fast",
            out=out,
            kill_times_s=[(t, f"r{i}") for t, i in kills],
            seed=seed,
        )
        run["steps_dir"] = str(Path(out) / "steps")
    else:  # ray_train: the peer that loses steps (a restart resumes from its last checkpoint)
        from benchmarks.peers.raytrain_peer import run_raytrain

        run = run_raytrain(
            model="tiny",
            replicas=replicas,
            steps=steps,
            min_step_s=min_step_s,
            out=out,
            kill_times_s=[(t, f"r{i}") for t, i in kills],
            seed=seed,
        )
        run["steps_dir"] = str(Path(out) / "steps")
    run["step_efficiency"] = step_efficiency(run)
    run["span_s"] = training_span_s(run, steps)
    return run


def compare_peers(args, out: Path) -> list[dict]:
    """hsgd and each peer: fault-free, then every MTBF under the same failure process."""
    sides = ["hsgd"] + [p for p in args.peers if p != "none"]
    if len(sides) == 1:
        return []
    runs, free = [], {}
    for side in sides:
        free[side] = _side(
            side,
            replicas=args.replicas,
            steps=args.steps,
            min_step_s=args.min_step_s,
            out=out / f"{side}_fault_free",
            kills=[],
            seed=args.seed,
        )
        runs.append(
            {
                "side": side,
                "mtbf_s": None,
                "goodput": 1.0,
                "faults": 0,
                "wall_s": free[side]["wall_s"],
                "span_s": free[side]["span_s"],
                "step_efficiency": free[side]["step_efficiency"],
                "result_error": free[side].get("result_error"),
            }
        )
        print(f"goodput {side} fault-free: {free[side]['span_s']:.1f} s from the first step to the last", flush=True)
    span = 0.8 * args.steps * args.min_step_s  # failures while every side still trains (times count from step 1)
    for mtbf in args.mtbf:
        kills = failure_process(mtbf, span, args.replicas, args.seed)
        for side in sides:  # interleaved: one MTBF, every side, then the next
            run = _side(
                side,
                replicas=args.replicas,
                steps=args.steps,
                min_step_s=args.min_step_s,
                out=out / f"{side}_mtbf{mtbf:g}",
                kills=kills,
                seed=args.seed,
            )
            runs.append(
                {
                    "side": side,
                    "mtbf_s": mtbf,
                    "faults": len(run["kills"]),
                    "failure_process": kills,
                    "wall_s": run["wall_s"],
                    "span_s": run["span_s"],
                    "goodput": goodput(free[side]["span_s"], run["span_s"]) if run["span_s"] else 0.0,
                    "step_efficiency": run["step_efficiency"],
                    "recoveries": run["recoveries"],
                    "result_error": run.get("result_error"),
                    # torchft's run ends when its first replica finishes: a victim still restarting then is
                    # left behind (benchmarks/peers/torchft_peer.py), a replica never killed never is
                    "killed": sorted({k["replica"] for k in run["kills"]}),
                    "unfinished": run.get("unfinished", []),
                }
            )
            print(
                f"goodput {side} MTBF {mtbf:g} s: {len(run['kills'])} kills, goodput {runs[-1]['goodput']:.3f}, "
                f"step efficiency {run['step_efficiency']}",
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 steps, one MTBF of 4 s")
    parser.add_argument("--mtbf", type=float, nargs="+", default=[30.0, 10.0])
    parser.add_argument(
        "--peers",
        nargs="+",
        default=["torchft"],
        choices=["torchft", "ray_train", "none"],
        help="torchft and/or ray_train (steps lost to rollbacks: its committed-step efficiency), or none",
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--min-step-s", type=float, default=0.3)
    parser.add_argument(
        "--spares",
        type=int,
        nargs="*",
        default=[],
        help="also hsgd alone with its fault injector, without and with these hot spares per cluster",
    )
    parser.add_argument("--rounds", type=int, default=60, help="(--spares) rounds")
    parser.add_argument("--outer-every", type=int, default=20, help="(--spares) steps per round")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.mtbf, args.min_step_s = 60, [4.0], 0.2
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-goodput-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    with bench_ray():
        runs = compare_peers(args, out)
        if args.spares:
            cases, step_s = _with_spares(args, out)
    report = {
        **header("goodput", argv, args.quick),
        "replicas": args.replicas,
        "steps": args.steps,
        "min_step_s": args.min_step_s,
        "runs": runs,
    }
    if cases:
        report.update(seconds_per_step=step_s, cases=cases)
    write_suite(out, report)
    _plot(runs, cases, out / "goodput.png")
    for c in cases:
        m = c["cost_medians"]
        parts = " ".join(
            f"{k[:-2]} {m[k]:.2f}s"
            for k in ("detection_s", "replan_s", "restart_s", "heal_s", "rejoin_s")
            if m.get(k) is not None
        )
        print(
            f"{c['name']:>20}: wall {c['train_wall_s']:7.1f}s goodput {c['goodput']:.3f} "
            f"(vs no-spare fault-free {c['vs_fault_free_without_spares']:.3f}) faults {m['faults']:2d}  {parts}"
        )
    print(f"goodput.json and goodput.png in {out}")
    return 0


def _with_spares(args, out: Path) -> tuple[list[dict], float]:
    """hsgd alone, its fault injector's random kill/crash faults, without and with hot spares."""
    base = [
        f"train.rounds={args.rounds}",
        f"sync.outer_every={args.outer_every}",
        "train.eval_every=1000",
        "supervisor.rejoin=fast",
    ]
    # one fault-free baseline per spare count: the same config, so spares' own cost is not
    # counted as fault cost (goodput) — and the ratio to the no-spare baseline says what they cost
    free = {}
    for spares in sorted(set(args.spares) | {0}):
        name = "fault_free" if spares == 0 else f"fault_free_spares{spares}"
        free[spares] = _run(name, base + [f"topology.spares_per_cluster={spares}"], out)
    step_s = free[0]["train_wall_s"] / (args.rounds * args.outer_every)
    cases = [free[spares] for spares in sorted(free)]
    for mtbf in args.mtbf:
        for spares in args.spares:
            case = _run(
                f"mtbf{mtbf:g}_spares{spares}",
                base
                + [
                    f"faults.mtbf_s={mtbf}",
                    f"faults.step_s={step_s:.4f}",
                    f"faults.seed={args.seed}",
                    "faults.kinds=[kill,crash]",
                    f"topology.spares_per_cluster={spares}",
                ],
                out,
            )
            case["spares"] = spares
            cases.append(case)
    for c in cases:
        baseline = free[c.get("spares", 0)] if c["name"].startswith("mtbf") else c
        c["goodput"] = goodput(baseline["train_wall_s"], c["train_wall_s"])
        c["vs_fault_free_without_spares"] = goodput(free[0]["train_wall_s"], c["train_wall_s"])
    return cases, step_s


def _plot(runs: list[dict], cases: list[dict], path: Path) -> None:
    """goodput.png: the peer comparison (or, without one, the spares runs); goodput_spares.png:
    the spares runs when both ran."""
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()
    if runs:
        save_png(_plot_peers(runs, plt), path)
        path = path.with_name("goodput_spares.png")
    if cases:
        save_png(_plot_spares(cases, plt), path)


def _plot_spares(cases: list[dict], plt):
    names = [c["name"] for c in cases]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), dpi=110)
    ax1.bar(names, [c["goodput"] for c in cases], color="#3b75af")
    ax1.axhline(0.95, color="#c44e52", ls="--", lw=1, label="0.95")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("goodput (fault-free wall / wall)", fontsize=9)
    ax1.legend(fontsize=8)
    bottom = [0.0] * len(cases)
    for part, color in (
        ("detection_s", "#c44e52"),
        ("replan_s", "#dd8452"),
        ("heal_s", "#55a868"),
        ("restart_s", "#8172b3"),
    ):
        values = [c["cost_medians"].get(part) or 0.0 for c in cases]
        ax2.bar(names, values, bottom=bottom, color=color, label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax2.plot(names, [c["cost_medians"].get("rejoin_s") or 0.0 for c in cases], "ko-", label="fault -> training again")
    ax2.set_title("median seconds per fault", fontsize=9)
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    return fig


def _plot_peers(runs: list[dict], plt):
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    sides = sorted({r["side"] for r in runs}, key=lambda x: x != "hsgd")
    mtbfs = sorted({r["mtbf_s"] for r in runs if r["mtbf_s"]}, reverse=True)
    width = 0.8 / max(1, len(sides))
    for i, side in enumerate(sides):
        values = [next((r["goodput"] for r in runs if r["side"] == side and r["mtbf_s"] == m), 0) for m in mtbfs]
        ax.bar([j + i * width for j in range(len(mtbfs))], values, width, label=side)
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(mtbfs))], [f"MTBF {m:g} s" for m in mtbfs])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fault-free span / span")
    ax.set_title("goodput under the same failure process (SIGKILL from outside)", fontsize=9)
    ax.legend(fontsize=8)
    return fig
