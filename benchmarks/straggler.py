"""`python -m benchmarks straggler [--quick] [--out DIR] [--steps 300 --min-step-s 0.1 --p 0.01 --factor 10 --every 50]`:
time to a fixed number of steps with random stragglers — flat synchronous DDP vs hierarchical
local SGD vs DiLoCo (the setting of PyTorch's hierarchical SGD blog: each replica, at each step,
sleeps with probability 1 % for ten times a step's time: `train.straggle_p`, `train.straggle_factor`).

Arms, 4 replicas each, the same model, seed and steps, each step padded to `--min-step-s`:

    flat_ddp         1 cluster x 4, ddp every step: one straggler stalls all four
    local_sgd        2 x 2, params averaged inside a cluster every 5 steps (`sync.inner=localsgd`)
                     and across clusters every `--every` steps (`sync.outer=average`)
    diloco           2 x 2, ddp inside, DiLoCo across clusters every `--every` steps

A straggler stalls whoever syncs with it before its next step: everyone (flat), its cluster at its
next average (local SGD), its cluster each step but the other cluster only at the round's end
(DiLoCo). Time to the steps: from the first committed step of any replica to the last replica's
last one (read from `logging.step_times`; start-up is not counted), median over `--repeats`
interleaved repeats. `straggler.json`: per arm the times, the final eval loss (the price of
syncing less) and the speed-up vs flat (flat's time / the arm's);
`straggler.png`. `--quick`: 40 steps, p 0.05, every 20, one repeat (a smoke run).
"""  # noqa: E501 — its first line is the --help description (argparse reads __doc__'s first line)

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.report import bench_ray, header, write_suite

QUIET = [
    "logging.wandb.mode=disabled",
    "logging.progress=false",
    "checkpoint.every=0",
    "logging.step_times=true",
    "model=tiny",
]


def inner_every(every: int) -> int:
    """Local SGD's averages inside a cluster: every 5 steps, or the largest divisor of a round below it."""
    return next(k for k in (5, 4, 3, 2, 1) if every % k == 0)


def arms(every: int) -> dict[str, list[str]]:
    return {
        "flat_ddp": ["topology.clusters=1", "topology.replicas_per_cluster=4", "sync.inner=ddp", "sync.outer=average"],
        "local_sgd": [
            "topology.clusters=2",
            "topology.replicas_per_cluster=2",
            "sync.inner=localsgd",
            f"sync.inner_every={inner_every(every)}",
            "sync.outer=average",
        ],
        "diloco": ["topology.clusters=2", "topology.replicas_per_cluster=2", "sync.inner=ddp", "sync.outer=diloco"],
    }


def run_arm(name: str, overrides: list[str], out: Path) -> dict:
    from actors.launch import compose_config, run_training
    from benchmarks.peers.common import read_steps
    from hsgd.config import validate

    cfg = compose_config(QUIET + overrides)
    validate(cfg)
    summary = run_training(cfg, str(out))
    steps = read_steps(out / "steps")
    first = min(rows[0]["t"] for rows in steps.values() if rows)
    last = max(rows[-1]["t"] for rows in steps.values() if rows)
    return {
        "name": name,
        "overrides": overrides,
        "status": summary.get("status"),
        "train_s": last - first,
        "final_eval_loss": summary.get("final_eval_loss"),
        "run_dir": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks straggler", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50, help="steps between syncs across clusters")
    parser.add_argument("--min-step-s", type=float, default=0.1)
    parser.add_argument("--p", type=float, default=0.01, help="train.straggle_p")
    parser.add_argument("--factor", type=float, default=10.0, help="train.straggle_factor")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.p, args.repeats = 40, 20, 0.05, 1
    if args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every})")
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-straggler-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [
        f"train.rounds={args.steps // args.every}",
        f"sync.outer_every={args.every}",
        f"train.eval_every={args.steps // args.every}",
        f"train.min_step_s={args.min_step_s}",
        f"train.straggle_p={args.p}",
        f"train.straggle_factor={args.factor}",
    ]
    runs: dict[str, list[dict]] = {name: [] for name in arms(args.every)}
    with bench_ray():
        for repeat in range(args.repeats):  # interleaved: each repeat runs every arm once
            for name, overrides in arms(args.every).items():
                run = run_arm(name, common + overrides + [f"seed={args.seed + repeat}"], out / f"{name}_{repeat}")
                runs[name].append(run)
                print(
                    f"straggler {name} #{repeat}: {run['train_s']:.1f} s to {args.steps} steps, "
                    f"eval loss {run['final_eval_loss']}",
                    flush=True,
                )
    flat = statistics.median(r["train_s"] for r in runs["flat_ddp"])
    results = []
    for name, rs in runs.items():
        wall = statistics.median(r["train_s"] for r in rs)
        losses = [r["final_eval_loss"] for r in rs if r["final_eval_loss"] is not None]
        results.append(
            {
                "name": name,
                "wall_s": wall,
                "wall_each_s": [r["train_s"] for r in rs],
                "final_eval_loss": statistics.median(losses) if losses else None,
                "speedup_vs_flat": flat / wall if wall else None,
                "runs": rs,
                "completed": all(r["status"] == "completed" for r in rs),
            }
        )
    report = {
        **header("straggler", argv, args.quick),
        "steps": args.steps,
        "every": args.every,
        "min_step_s": args.min_step_s,
        "straggle_p": args.p,
        "straggle_factor": args.factor,
        "repeats": args.repeats,
        "arms": results,
    }
    write_suite(out, report)
    _plot(report, out / "straggler.png")
    for a in results:
        print(
            f"{a['name']:>10}: {a['wall_s']:.1f} s (x{a['speedup_vs_flat']:.2f} vs flat), eval {a['final_eval_loss']}"
        )
    print(f"straggler.json and straggler.png in {out}")
    return 0


def _plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    arms_ = report["arms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=110)
    names = [a["name"] for a in arms_]
    ax1.bar(names, [a["wall_s"] for a in arms_], color=["#888", "#55a868", "#3b75af"])
    for i, a in enumerate(arms_):
        ax1.plot([i] * len(a["wall_each_s"]), a["wall_each_s"], "k.", ms=4)
    ax1.set_title(
        f"seconds to {report['steps']} steps (p={report['straggle_p']:g}, x{report['straggle_factor']:g})", fontsize=9
    )
    ax2.bar(names, [a["final_eval_loss"] or 0 for a in arms_], color=["#888", "#55a868", "#3b75af"])
    ax2.set_title("final eval loss", fontsize=9)
    save_png(fig, path)
