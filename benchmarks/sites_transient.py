"""`python -m benchmarks sites --transient [--quick] [--out DIR] [--rounds 8 --outer-every 40 --min-step-s 0.25
--slow 3 --seed 0]`: a site slowed for a while (issue 48), `sync.balance` none vs steps vs time.

Three real hsgd runs in one invocation, one after the other on one embedded Ray (benchmarks/straggler.py
`run_arm`): model `tiny`, 3 sites of 2 replicas, every step padded to `--min-step-s` (a 10-s round of
`--outer-every` steps), an eval after every round, the same seed, no checkpoints, wandb off. From round 1
on, one site at a time is slowed `--slow`x for two rounds (20 s), rotating c0, c1, c2, c0, ... on a fixed
schedule: a `slow` fault on `cluster:c<i>` at step 0 of each of its rounds (`seconds` = (slow - 1) x
min_step_s per step, the rest of the round). Round 0 is never slowed: `steps` and `time` learn the step
times there.

    none    every site runs `outer_every` steps: a round lasts as long as the slowed site's
    steps    each site its own steps, planned at the round's start from learned step times: a slowdown
             that starts inside the round is not in its plan
    time     the round closes at the fastest site's learned time for its steps (`sync.round_s` null):
             the slowed site yields at the close with the steps it took

The prediction, before measuring: per round, none and steps train 3 sites' steps in `slow` x T (T: a
round's inner time unslowed), time trains 2 + 1/slow sites' steps in T; with R, the rest of a round
(its outer sync, eval, the next start), time / steps tokens/s = ((2 + 1/slow) / 3) x (slow x T + R) / (T + R):
2.33x with R = 0, at slow 3. Figures per arm as the `sites` suite reads them (benchmarks/sites.py
`arm_figures`: tokens from metrics.jsonl `cluster_tokens`, the training wall from the first
`phase_begin` to the last `commit`, each site's idle share at the outer sync); eval loss at equal
tokens (the fewest any arm trained) and at equal wall (the shortest), interpolated between the
evals. `sites_transient.json`, `sites_transient.png`. `--quick`: 3 rounds of 8 short steps (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.report import bench_ray, header, write_suite
from benchmarks.sites import read_arm
from benchmarks.straggler import run_arm

SITES = 3
REPLICAS = 2
WINDOW = 2  # rounds a site stays slowed
ARMS = ("none", "steps", "time")
TARGET = 1.3  # tokens/s, time vs steps (issue 48, Acceptance 1)
LOSS_TOLERANCE = 0.01  # eval loss at equal tokens, time vs steps


def slowed_site(round_index: int) -> int | None:
    """The site slowed in a round: none in round 0, then each for WINDOW rounds in turn."""
    return None if round_index == 0 else (round_index - 1) // WINDOW % SITES


def schedule(rounds: int, min_step_s: float, slow: float) -> str:
    entries = [
        f"{{kind:slow,target:cluster:c{site},round:{r},phase:inner,step:0,seconds:{(slow - 1) * min_step_s:g}}}"
        for r in range(rounds)
        if (site := slowed_site(r)) is not None
    ]
    return f"faults.schedule=[{','.join(entries)}]"


def arms(args) -> dict[str, list[str]]:
    site = f"{{replicas:{REPLICAS},min_step_s:{args.min_step_s:g}}}"
    common = [
        f"topology.sites=[{','.join([site] * SITES)}]",
        f"seed={args.seed}",
        f"sync.outer_every={args.outer_every}",
        f"train.rounds={args.rounds}",
        "train.eval_every=1",
        schedule(args.rounds, args.min_step_s, args.slow),
    ]
    return {name: [*common, f"sync.balance={name}"] for name in ARMS}


def predicted(slow: float, inner_s: float, rest_s: float) -> float:
    """time / steps tokens/s the schedule predicts (the module docstring's formula)."""
    return (SITES - 1 + 1 / slow) / SITES * (slow * inner_s + rest_s) / (inner_s + rest_s)


def at(curve: list[dict], key: str, x: float) -> float | None:
    """The eval loss a curve reaches at `key` = x, linearly between evals; None past its end."""
    for a, b in zip(curve, curve[1:], strict=False):
        if a[key] <= x <= b[key]:
            share = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a["eval_loss"] + share * (b["eval_loss"] - a["eval_loss"])
    return None


def compare(results: dict[str, dict], args) -> dict:
    tokens = min(a["tokens"] for a in results.values())
    wall = min(a["train_wall_s"] for a in results.values())
    loss_at_tokens = {n: at(a["curve"], "tokens", tokens) for n, a in results.items()}
    loss_at_wall = {n: at(a["curve"], "wall_s", wall) for n, a in results.items()}
    steps, time = results["steps"], results["time"]
    ratio = time["tokens_per_s"] / steps["tokens_per_s"]
    parts = time["round_parts_median_s"]
    rest = parts["sync_s"] + (parts["between_s"] or 0.0)
    expect = predicted(args.slow, args.outer_every * args.min_step_s, rest)
    gap = loss_at_tokens["time"] / loss_at_tokens["steps"] - 1 if loss_at_tokens["steps"] else None
    return {
        "equal_tokens": tokens,
        "equal_wall_s": wall,
        "eval_loss_at_equal_tokens": loss_at_tokens,
        "eval_loss_at_equal_wall": loss_at_wall,
        "tokens_per_s_time_vs_steps": ratio,
        "tokens_per_s_time_vs_none": time["tokens_per_s"] / results["none"]["tokens_per_s"],
        "predicted_time_vs_steps": expect,
        "predicted_from": f"slow {args.slow:g}x, inner {args.outer_every * args.min_step_s:.1f} s, "
        f"rest of a round {rest:.2f} s (the time arm's median)",
        "loss_gap_at_equal_tokens": gap,
        "holds": {
            "tokens_per_s": ratio >= TARGET,
            "loss_at_equal_tokens": gap is not None and abs(gap) <= LOSS_TOLERANCE,
        },
    }


def notes(report: dict) -> list[str]:
    """What the prediction leaves out, from the run's own figures."""
    time = next(a for a in report["arms"] if a["name"] == "time")
    spr, slow = report["settings"]["outer_every"], report["settings"]["slow"]
    slowed = [
        steps[site]
        for steps, site in zip(time["cluster_steps"], report["settings"]["slowed"], strict=True)
        if site is not None
    ]
    slowed_steps = sorted(slowed)[len(slowed) // 2] if slowed else None
    return [
        f"The prediction takes a slowed site's steps as {spr}/{slow:g} and a `time` round's inner phase as the "
        f"fastest site's {spr} steps. Measured, the close comes a second after them (the yield's lead) and the "
        f"yields land a step later: the `time` arm's inner phase lasted {time['round_parts_median_s']['inner_s']:.1f} "
        f"s a round (median), and the slowed site took {slowed_steps} steps; round 0, never slowed, is as long in "
        f"every arm.",
        "`steps` plans from step times learned over earlier rounds (a median): a slowdown of two rounds does not "
        "move it, so it runs as `none` here.",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks sites --transient", description=__doc__.splitlines()[1].strip()
    )
    parser.add_argument("--transient", action="store_true", help="(this suite)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--outer-every", type=int, default=40, help="inner steps per round (sync.outer_every)")
    parser.add_argument("--min-step-s", type=float, default=0.25, help="every site's padded step time")
    parser.add_argument("--slow", type=float, default=3.0, help="how much slower a slowed site steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.outer_every, args.min_step_s = 3, 8, 0.05
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-sites-transient-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with bench_ray(num_cpus=8):
        for name, overrides in arms(args).items():
            print(f"sites --transient {name}: {' '.join(overrides)}", flush=True)
            run = run_arm(name, overrides, out / name)
            results[name] = {"name": name, "overrides": overrides, "run_dir": run["run_dir"]}
            results[name].update(read_arm(Path(run["run_dir"])))
            a = results[name]
            print(
                f"sites --transient {name}: {a['status']}, {a['tokens']} tokens in {a['train_wall_s']:.1f} s "
                f"({a['tokens_per_s']:.0f} tok/s), eval {a['final_eval_loss']:.4f}",
                flush=True,
            )
    cmp = compare(results, args)
    report = {
        **header("sites", argv, args.quick),  # (the command as typed: `sites --transient`)
        "suite": "sites_transient",
        "settings": {
            "model": "tiny",
            "sites": [{"replicas": REPLICAS, "min_step_s": args.min_step_s}] * SITES,
            "outer_every": args.outer_every,
            "rounds": args.rounds,
            "slow": args.slow,
            "slowed": [slowed_site(r) for r in range(args.rounds)],
            "seed": args.seed,
        },
        "arms": list(results.values()),
        **cmp,
        "targets": {"tokens_per_s_time_vs_steps": TARGET, "loss_at_equal_tokens": LOSS_TOLERANCE},
        "plots": ["sites_transient.png"],
    }
    report["notes"] = notes(report)
    write_suite(out, report)
    _plot(report, out / "sites_transient.png")
    print(
        f"sites --transient: tokens/s time/steps {cmp['tokens_per_s_time_vs_steps']:.2f}x "
        f"(predicted {cmp['predicted_time_vs_steps']:.2f}x; target {TARGET}x: "
        f"{'holds' if cmp['holds']['tokens_per_s'] else 'does not hold'}), eval loss at equal tokens "
        f"time vs steps {cmp['loss_gap_at_equal_tokens']:+.2%} (within {LOSS_TOLERANCE:.0%}: "
        f"{'holds' if cmp['holds']['loss_at_equal_tokens'] else 'does not hold'})"
    )
    print(f"sites_transient.json and sites_transient.png in {out}")
    return 0


def _plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5), dpi=110)
    colors = {"none": "#888", "steps": "#3b75af", "time": "#55a868"}
    for ax, key, label in zip(axes, ("tokens", "wall_s"), ("tokens trained", "training wall (s)"), strict=False):
        for a in report["arms"]:
            ax.plot([p[key] for p in a["curve"][1:]], [p["eval_loss"] for p in a["curve"][1:]], "o-", ms=3,
                    color=colors[a["name"]], label=f"balance={a['name']}")  # fmt: skip
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("eval loss", fontsize=9)
        ax.legend(fontsize=8)
    waits = axes[2]
    for i, a in enumerate(report["arms"]):
        shares = a["outer_wait_fraction_median"]
        waits.bar([j + 0.25 * i for j in range(len(shares))], list(shares.values()), 0.25, color=colors[a["name"]],
                  label=a["name"])  # fmt: skip
    waits.set_xticks([j + 0.25 for j in range(SITES)], [f"c{j}" for j in range(SITES)])
    waits.set_ylabel("idle share of a round at the outer sync (median)", fontsize=8)
    waits.legend(fontsize=8)
    fig.suptitle(
        f"one of 3 sites slowed {report['settings']['slow']:g}x for {WINDOW} rounds at a time: tokens/s time / steps "
        f"x{report['tokens_per_s_time_vs_steps']:.2f} (predicted x{report['predicted_time_vs_steps']:.2f})",
        fontsize=10,
    )
    save_png(fig, path)
