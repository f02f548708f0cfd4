"""Goodput benchmark: `python -m jobs.bench goodput [--out DIR] [--rounds N] [--mtbf 30 10]`.

One invocation, one embedded Ray, the same config (default 2 x 2, tiny model): a fault-free run
for each spare count, then runs with random kill/crash faults at each mean time between failures,
without and with one hot spare per cluster. Fault times map to step boundaries using the
fault-free run's measured seconds per step, so `--mtbf 30` means one fault per ~30 s of this
machine's training. Writes `goodput.json` (wall time, goodput = wall of the fault-free run with the
same spares / wall, the ratio to the fault-free run without spares, and per fault the median
detection, re-plan, restart, heal and rejoin seconds) and `goodput.png` (where the time went).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hsgd.record.goodput import fault_costs, goodput, summarize_costs
from hsgd.record.rundir import atomic_write_text, read_jsonl


QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]


def _run(name: str, overrides: list[str], out: Path) -> dict:
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    cfg = compose_config(QUIET + overrides)
    validate(cfg)
    run_dir = out / name
    summary = run_training(cfg, str(run_dir))
    costs = fault_costs(read_jsonl(run_dir / "faults_fired.jsonl"), read_jsonl(run_dir / "events.jsonl"))
    return {"name": name, "overrides": overrides, "status": summary["status"], "train_wall_s": summary.get("wall_s"),
            "rounds_committed": summary.get("rounds_committed"), "final_eval_loss": summary.get("final_eval_loss"),
            "costs": costs, "cost_medians": summarize_costs(costs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--outer-every", type=int, default=20)
    parser.add_argument("--mtbf", type=float, nargs="+", default=[30.0, 10.0])
    parser.add_argument("--spares", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-goodput-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = [f"train.rounds={args.rounds}", f"sync.outer_every={args.outer_every}", "train.eval_every=1000",
            "supervisor.rejoin=fast"]
    import ray

    ray.init(num_cpus=8, namespace="hsgd-bench", include_dashboard=False, log_to_driver=False)
    try:
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
                case = _run(f"mtbf{mtbf:g}_spares{spares}",
                            base + [f"faults.mtbf_s={mtbf}", f"faults.step_s={step_s:.4f}", f"faults.seed={args.seed}",
                                    "faults.kinds=[kill,crash]", f"topology.spares_per_cluster={spares}"], out)
                case["spares"] = spares
                cases.append(case)
    finally:
        ray.shutdown()
    for c in cases:
        baseline = free[c.get("spares", 0)] if c["name"].startswith("mtbf") else c
        c["goodput"] = goodput(baseline["train_wall_s"], c["train_wall_s"])
        c["vs_fault_free_without_spares"] = goodput(free[0]["train_wall_s"], c["train_wall_s"])
    report = {"machine_note": "goodput is a ratio to the fault-free run of this same invocation",
              "args": vars(args), "seconds_per_step": step_s, "cases": cases}
    atomic_write_text(out / "goodput.json", json.dumps(report, indent=2, default=str))
    _plot(cases, out / "goodput.png")
    for c in cases:
        m = c["cost_medians"]
        parts = " ".join(f"{k[:-2]} {m[k]:.2f}s" for k in ("detection_s", "replan_s", "restart_s", "heal_s", "rejoin_s")
                         if m.get(k) is not None)
        print(f"{c['name']:>20}: wall {c['train_wall_s']:7.1f}s goodput {c['goodput']:.3f} "
              f"(vs no-spare fault-free {c['vs_fault_free_without_spares']:.3f}) faults {m['faults']:2d}  {parts}")
    print(f"goodput.json and goodput.png in {out}")
    return 0


def _plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in cases]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), dpi=110)
    ax1.bar(names, [c["goodput"] for c in cases], color="#3b75af")
    ax1.axhline(0.95, color="#c44e52", ls="--", lw=1, label="0.95")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("goodput (fault-free wall / wall)", fontsize=9)
    ax1.legend(fontsize=8)
    bottom = [0.0] * len(cases)
    for part, color in (("detection_s", "#c44e52"), ("replan_s", "#dd8452"), ("heal_s", "#55a868"),
                        ("restart_s", "#8172b3")):
        values = [c["cost_medians"].get(part) or 0.0 for c in cases]
        ax2.bar(names, values, bottom=bottom, color=color, label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.plot(names, [c["cost_medians"].get("rejoin_s") or 0.0 for c in cases], "ko-", label="fault -> training again")
    ax2.set_title("median seconds per fault", fontsize=9)
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
