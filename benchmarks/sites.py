"""`python -m benchmarks sites [--quick] [--out DIR] [--rounds 12 --outer-every 20 --min-step-s 0.25 --seed 0]`:
two sites of different speeds, fixed steps per round (`sync.balance=none`) vs steps planned per
site (`sync.balance=steps`), on the same total tokens (issue 35, Acceptance 2).

Two real hsgd runs in one invocation, one after the other on one embedded Ray (the straggler
suite's launcher, benchmarks/straggler.py `run_arm`): model `tiny`, 2 sites of 1 replica each, the
second site's steps padded to twice the first's (`topology.sites[i].min_step_s`: `--min-step-s`
and 2×), DiLoCo every `--outer-every` steps, an eval of the global model after every round, the
same seed, no checkpoints, wandb off.

    none    `--rounds` R rounds of `outer_every` steps in each site: the fast site idles at every
            outer sync for half of the round
    steps   the slow site plans half the steps (n = round(spr · fastest step / its step)), so both
            inner phases take about as long; ceil(R · 2·spr / (spr + n)) rounds (R·4/3 here) train
            the same tokens as `none`

Figures per arm, read from the run's record (never from the console): tokens — the sum of
metrics.jsonl's `cluster_tokens` over the rounds (checked against summary.json
`tokens_per_cluster`); the training wall — from the first round's first `phase_begin` to the last
`commit` in events.jsonl (start-up and the final save are not counted); tokens/s — their ratio;
eval loss vs tokens and vs wall (each round's `eval_loss` at that round's `commit`, from the
initial eval at 0); the fast site's wait at the outer sync as a fraction of the round (the outer
`phase_begin` minus the site's last inner `phase_end`, over the round's first `phase_begin` to its
`commit`; median over rounds). Ratios: tokens/s steps/none (target ≥ 1.35), and time to the
`none` arm's final eval loss, none's wall / the wall at which `steps` first reaches it
(interpolated between evals; null if never; target ≥ 1.25; 1.5 is the ceiling before sync costs).
`sites.json`, `sites.png` (eval loss vs tokens, vs wall). `--quick`: 3 rounds of 4 short steps (a
smoke run; its figures are not results).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.report import bench_ray, header, write_suite
from benchmarks.straggler import run_arm

SLOW = 2.0  # the second site's step time / the first's
TARGETS = {"tokens_per_s": 1.35, "time_to_loss": 1.25}
CEILING = 1.5  # (spr + spr) / (spr + spr/2) rounds' worth of tokens per fast round: no sync, no eval


def planned_slow_steps(spr: int) -> int:
    """The slow site's steps per round under `balance=steps` (the round machine's own rule)."""
    from hsgd.core.round.balance import plan_steps

    return plan_steps(spr, [1.0, SLOW])[1]


def steps_rounds(rounds: int, spr: int) -> int:
    """Rounds of `balance=steps` that train at least the tokens of `rounds` rounds of `none`."""
    return math.ceil(rounds * 2 * spr / (spr + planned_slow_steps(spr)))


def arms(args) -> dict[str, list[str]]:
    fast, slow = args.min_step_s, args.min_step_s * SLOW
    sites = f"topology.sites=[{{replicas:1,min_step_s:{fast:g}}},{{replicas:1,min_step_s:{slow:g}}}]"
    common = [sites, f"seed={args.seed}", f"sync.outer_every={args.outer_every}", "train.eval_every=1"]
    return {
        "none": common + ["sync.balance=none", f"train.rounds={args.rounds}"],
        "steps": common + ["sync.balance=steps", f"train.rounds={steps_rounds(args.rounds, args.outer_every)}"],
    }


def _first(events: list[dict], pred) -> dict | None:
    return next((e for e in events if pred(e)), None)


def arm_figures(events: list[dict], metrics: list[dict], summary: dict) -> dict:
    """One arm's figures from its record (events in time order, metrics.jsonl, summary.json)."""
    start = _first(events, lambda e: e["event"] == "phase_begin")["t"]
    commits = {e["round"]: e["t"] for e in events if e["event"] == "commit"}  # a round's last commit wins
    rounds = sorted({m["round"]: m for m in metrics}.values(), key=lambda m: m["round"])
    tokens = 0
    curve = [{"round": None, "tokens": 0, "wall_s": 0.0, "eval_loss": summary["initial_eval_loss"]}]
    waits: dict[int, list[float]] = {}
    parts: dict[str, list[float]] = {"inner_s": [], "sync_s": [], "between_s": []}
    for i, m in enumerate(rounds):
        r = m["round"]
        tokens += sum(m["cluster_tokens"])
        if m.get("eval_loss") is not None:
            curve.append({"round": r, "tokens": tokens, "wall_s": commits[r] - start, "eval_loss": m["eval_loss"]})
        in_round = [e for e in events if e.get("round") == r and e["event"] in ("phase_begin", "phase_end")]
        begin = in_round[0]["t"]
        outer = _first(in_round, lambda e: e["event"] == "phase_begin" and e["phase"] == "outer")
        inner_ends = {}
        for e in in_round:
            if e["event"] == "phase_end" and e["phase"] == "inner" and e["cluster"] is not None:
                inner_ends[e["cluster"]] = e["t"]
        for c, t in inner_ends.items():
            waits.setdefault(c, []).append((outer["t"] - t) / (commits[r] - begin))
        parts["inner_s"].append(max(inner_ends.values()) - begin)
        parts["sync_s"].append(commits[r] - max(inner_ends.values()))
        if i + 1 < len(rounds):
            nxt = _first(events, lambda e: e.get("round") == rounds[i + 1]["round"] and e["event"] == "phase_begin")  # noqa: B023 — called within the iteration
            parts["between_s"].append(nxt["t"] - commits[r])
    wall = commits[rounds[-1]["round"]] - start
    return {
        "status": summary.get("status"),
        "rounds": len(rounds),
        "tokens": tokens,
        "tokens_per_cluster": summary.get("tokens_per_cluster"),
        "train_wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "final_eval_loss": summary.get("final_eval_loss"),
        "initial_eval_loss": summary.get("initial_eval_loss"),
        "cluster_steps": [m["cluster_steps"] for m in rounds],
        "outer_wait_fraction_median": {f"c{c}": statistics.median(w) for c, w in sorted(waits.items())},
        "round_parts_median_s": {k: statistics.median(v) if v else None for k, v in parts.items()},
        "curve": curve,
    }


def wall_to_loss(curve: list[dict], loss: float, key: str = "wall_s") -> float | None:
    """The first `key` (wall or tokens) at which `curve` reaches `loss`, linearly between evals; None if never."""
    for a, b in zip(curve, curve[1:], strict=False):
        if b["eval_loss"] <= loss:
            if a["eval_loss"] <= loss or a["eval_loss"] == b["eval_loss"]:
                return a[key] if a["eval_loss"] <= loss else b[key]
            return a[key] + (b[key] - a[key]) * (a["eval_loss"] - loss) / (a["eval_loss"] - b["eval_loss"])
    return None


def read_arm(run_dir: Path) -> dict:
    from hsgd.record.rundir import read_jsonl

    events = sorted(read_jsonl(run_dir / "events.jsonl"), key=lambda e: e["t"])
    summary = json.loads((run_dir / "summary.json").read_text())
    return arm_figures(events, read_jsonl(run_dir / "metrics.jsonl"), summary)


def compare(none: dict, steps: dict) -> dict:
    """The ratios (steps vs none) and whether each target holds."""
    target = none["curve"][-1]["eval_loss"]
    steps_wall = wall_to_loss(steps["curve"], target)
    ratios = {
        "tokens_per_s": steps["tokens_per_s"] / none["tokens_per_s"]
        if steps["tokens_per_s"] and none["tokens_per_s"]
        else None,
        "time_to_loss": none["train_wall_s"] / steps_wall if steps_wall else None,
    }
    steps_tokens = wall_to_loss(steps["curve"], target, key="tokens")
    return {
        "loss_target": target,
        "none_wall_to_loss_s": none["train_wall_s"],
        "steps_wall_to_loss_s": steps_wall,
        "steps_tokens_to_loss": steps_tokens,
        "ratios": ratios,
        "holds": {k: ratios[k] is not None and ratios[k] >= v for k, v in TARGETS.items()},
        "gap": gap(none, steps, steps_tokens),
    }


def gap(none: dict, steps: dict, steps_tokens: float | None) -> dict:
    """Where the figures fall short of the ceiling: tokens/s steps/none = (tokens per round ratio) x
    (none's round / steps' round), 1.5 only when a round is its inner steps alone; the per-round
    rest (outer sync, then the eval and the next round's start) weighs twice as much in the shorter
    balanced round. Time to loss loses, besides, the tokens `steps` needs to reach none's loss."""

    def split(a: dict) -> tuple[float, float]:
        p = a["round_parts_median_s"]
        return p["inner_s"], p["sync_s"] + (p["between_s"] or 0.0)

    (n_inner, n_rest), (s_inner, s_rest) = split(none), split(steps)
    tokens_ratio = steps_tokens / none["tokens"] if steps_tokens is not None else None
    figures = (
        f"per round, inner + the rest: none {n_inner:.2f} + {n_rest:.2f} s, steps {s_inner:.2f} + "
        f"{s_rest:.2f} s; tokens to the loss, steps / none: {_x(tokens_ratio)}"
    )
    sentence = (
        f"tokens/s: the outer sync and eval between rounds ({s_rest:.2f} s) are "
        f"{s_rest / (s_inner + s_rest):.0%} of a balanced round, {n_rest / (n_inner + n_rest):.0%} of an "
        f"unbalanced one, and the fast site still waits {steps['outer_wait_fraction_median']['c0']:.0%} of "
        f"a balanced round; time to loss scales, besides, with the tokens steps needs to reach none's "
        f"final loss: "
        + (
            "never reached"
            if tokens_ratio is None
            else f"{tokens_ratio:.2f}x none's ({steps['rounds']} outer steps against {none['rounds']})"
        )
    )
    return {
        "none_inner_s": n_inner,
        "none_rest_s": n_rest,
        "steps_inner_s": s_inner,
        "steps_rest_s": s_rest,
        "steps_tokens_to_loss_vs_none": tokens_ratio,
        "figures": figures,
        "sentence": sentence,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks sites", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of the `none` arm")
    parser.add_argument("--outer-every", type=int, default=20, help="inner steps per round (sync.outer_every)")
    parser.add_argument("--min-step-s", type=float, default=0.25, help="the fast site's min_step_s (the slow: 2x)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.outer_every, args.min_step_s = 3, 4, 0.05
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-sites-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with bench_ray(num_cpus=4):
        for name, overrides in arms(args).items():
            print(f"sites {name}: {' '.join(overrides)}", flush=True)
            run = run_arm(name, overrides, out / name)
            results[name] = {
                "name": name,
                "overrides": overrides,
                "run_dir": run["run_dir"],
                **read_arm(Path(run["run_dir"])),
            }
            a = results[name]
            print(
                f"sites {name}: {a['status']}, {a['tokens']} tokens in {a['train_wall_s']:.1f} s "
                f"({a['tokens_per_s']:.0f} tok/s), eval {a['final_eval_loss']:.4f}, fast site waits "
                f"{a['outer_wait_fraction_median']['c0']:.1%} of a round",
                flush=True,
            )
    for a in results.values():
        a["completed"] = a["status"] == "completed"
    cmp = compare(results["none"], results["steps"])
    report = {
        **header("sites", argv, args.quick),
        "settings": {
            "model": "tiny",
            "sites": [
                {"replicas": 1, "min_step_s": args.min_step_s},
                {"replicas": 1, "min_step_s": args.min_step_s * SLOW},
            ],
            "outer_every": args.outer_every,
            "rounds": {n: a["rounds"] for n, a in results.items()},
            "eval_every": 1,
            "seed": args.seed,
            "checkpoint_every": 0,
            "wandb": "disabled",
        },
        "sources": {
            "tokens": "metrics.jsonl cluster_tokens, summed over rounds",
            "train_wall_s": "events.jsonl: first round's first phase_begin -> last commit",
            "curve": "metrics.jsonl eval_loss at events.jsonl commit of the same round",
            "outer_wait_fraction": "events.jsonl: (outer phase_begin - the cluster's last inner "
            "phase_end) / (round's first phase_begin -> commit)",
        },
        "arms": list(results.values()),
        **cmp,
        "targets": TARGETS,
        "ceiling": CEILING,
    }
    write_suite(out, report)
    _plot(report, out / "sites.png")
    r = cmp["ratios"]
    print(
        f"sites: tokens/s steps/none {_x(r['tokens_per_s'])} (target {TARGETS['tokens_per_s']}x: "
        f"{'holds' if cmp['holds']['tokens_per_s'] else 'does not hold'}), time to eval "
        f"{cmp['loss_target']:.4f} none/steps {_x(r['time_to_loss'])} (target {TARGETS['time_to_loss']}x: "
        f"{'holds' if cmp['holds']['time_to_loss'] else 'does not hold'})"
    )
    print(f"sites.json and sites.png in {out}")
    return 0


def _x(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}x"


def _plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), dpi=110)
    colors = {"none": "#888", "steps": "#3b75af"}
    for ax, key, label in zip(axes, ("tokens", "wall_s"), ("tokens trained", "training wall (s)"), strict=True):
        for a in report["arms"]:
            ax.plot(
                [p[key] for p in a["curve"]],
                [p["eval_loss"] for p in a["curve"]],
                "o-",
                ms=3,
                color=colors[a["name"]],
                label=f"balance={a['name']}",
            )
        ax.axhline(report["loss_target"], color="#c44e52", lw=0.8, ls="--", label="none's final eval loss")
        after = [p["eval_loss"] for a in report["arms"] for p in a["curve"][1:]]  # the initial eval: off the top
        if after:
            ax.set_ylim(min(after) - 0.05 * (max(after) - min(after)), max(after) + 0.1 * (max(after) - min(after)))
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("eval loss", fontsize=9)
        ax.legend(fontsize=8)
    if report["steps_wall_to_loss_s"] is not None:
        axes[1].axvline(report["steps_wall_to_loss_s"], color="#3b75af", lw=0.8, ls=":")
    r = report["ratios"]
    fig.suptitle(
        f"2 sites, one {SLOW:g}x slower: tokens/s x{r['tokens_per_s'] or 0:.2f}, "
        f"time to loss x{r['time_to_loss'] or 0:.2f} (steps vs none)",
        fontsize=10,
    )
    save_png(fig, path)
