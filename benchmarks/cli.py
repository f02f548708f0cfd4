"""Benchmarks: `python -m benchmarks [--quick] [--out DIR] [--rounds N] [--outer-every H]`, or
`python -m benchmarks {overhead,recovery,goodput,scale,straggler} [--quick] [--out DIR]` (hsgd against
its peers — plain DDP, torchft, Ray Train — in one invocation; each writes <suite>.json and a PNG),
`python -m benchmarks report [--from DIR ...]` (BENCHMARKS.md from those JSONs; benchmarks/report.py;
`--quick` accepted), or
`python -m benchmarks plan [--out DIR]` (the round machine and its runner per round at 10,000 replicas,
against a fake Ray), or
`python -m benchmarks goodput [--out DIR] [--rounds N] [--mtbf 30 10]` (wall time under faults vs
fault-free, with and without hot spares; see benchmarks/goodput.py), or
`python -m benchmarks inner [--quick] [--out DIR]` (hsgd's inner step vs plain and tuned PyTorch
loops, one process, no Ray; see benchmarks/inner.py), or
`python -m benchmarks ddp [--quick] [--out DIR] [--steps N] [--repeats R]` (hsgd's inner ddp, 1 cluster x 2
replicas, vs torch's DistributedDataParallel over gloo, interleaved; see benchmarks/ddp.py), or
`python -m benchmarks convergence [--quick] [--model small] [--steps 2000] [--out DIR]` (flat DDP,
LocalSGD and DiLoCo arms — H, codecs, fragments, sharded — on the same tokens: final eval loss vs
slow-link bytes, wall-clock under a simulated slow link; see benchmarks/convergence.py), or
`python -m benchmarks sites [--quick] [--out DIR] [--rounds 12]` (2 sites, one 2x slower: fixed steps per round
vs steps planned per site, `sync.balance` none vs steps, on the same tokens; see benchmarks/sites.py), or
`python -m benchmarks sites --transient [--quick] [--out DIR]` (3 sites, one at a time slowed 3x for two rounds:
`sync.balance` none vs steps vs time; see benchmarks/sites_transient.py), or
`python -m benchmarks outer_exchange [--quick] [--out DIR]` (slow-link bytes per site of sync.outer_exchange's
gather and reduce_scatter at 2, 4, 8 sites, each codec, in process; see benchmarks/outer_exchange.py).

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

from hsgd.record.rundir import atomic_write_text

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
    slow_link = (
        sum(m["outer_bytes"] for m in metrics)
        if "topology.clusters=1" not in overrides
        else sum(m["inner_bytes"] for m in metrics)
    )
    return {
        "name": name,
        "overrides": overrides,
        "status": summary["status"],
        "wall_s": time.monotonic() - start,
        "tokens_per_s_median": sorted(tps)[len(tps) // 2] if tps else None,
        "slow_link_bytes": slow_link,
        "final_eval_loss": summary["final_eval_loss"],
        "initial_eval_loss": summary["initial_eval_loss"],
        "faults": summary.get("faults", []),
    }


SUITES = (
    "overhead",
    "recovery",
    "goodput",
    "scale",
    "straggler",
    "plan",
    "inner",
    "ddp",
    "convergence",
    "sites",
    "outer_sweep",
    "outer_exchange",
    "report",
)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks <suite> [args]` (and its alias `python -m jobs.bench`): the suite's own
    `main` (a module of this package named as the suite), or with no suite the default one below."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUITES:
        import importlib

        suite = "sites_transient" if argv[0] == "sites" and "--transient" in argv else argv[0]  # (issue 48)
        return importlib.import_module(f"benchmarks.{suite}").main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for bench.json, bench.png and the runs")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--outer-every", type=int, default=20)
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--replicas-per-cluster", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.outer_every = 2, 4
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = args.clusters * args.replicas_per_cluster
    common = [f"train.rounds={args.rounds}", f"sync.outer_every={args.outer_every}"]
    hier = common + [f"topology.clusters={args.clusters}", f"topology.replicas_per_cluster={args.replicas_per_cluster}"]
    cases = [
        ("flat", common + ["topology.clusters=1", f"topology.replicas_per_cluster={n}", "sync.outer=average"]),
        ("hierarchical", hier),
        (
            "hierarchical+fault",
            hier
            + [
                f"faults.schedule=[{{kind:kill,target:c0r1,round:{args.rounds // 2},"
                f"phase:inner,step:{args.outer_every // 2}}}]"
            ],
        ),
    ]
    import ray

    ray.init(
        address="local", num_cpus=max(n + 1, 2), namespace="hsgd-bench", include_dashboard=False, log_to_driver=False
    )
    try:
        results = [run(name, overrides, out) for name, overrides in cases]
    finally:
        ray.shutdown()
    flat = results[0]
    for r in results:
        r["ratio_vs_flat"] = {
            "tokens_per_s": (r["tokens_per_s_median"] / flat["tokens_per_s_median"])
            if r["tokens_per_s_median"] and flat["tokens_per_s_median"]
            else None,
            "slow_link_bytes": r["slow_link_bytes"] / flat["slow_link_bytes"] if flat["slow_link_bytes"] else None,
            "wall_s": r["wall_s"] / flat["wall_s"],
            "final_eval_loss": r["final_eval_loss"] / flat["final_eval_loss"] if flat["final_eval_loss"] else None,
        }
    report = {
        "machine_note": "timings are this machine's; compare the ratios, measured in one invocation",
        "args": vars(args),
        "results": results,
    }
    atomic_write_text(out / "bench.json", json.dumps(report, indent=2))
    _plot(results, out / "bench.png")
    for r in results:
        ratio = r["ratio_vs_flat"]
        print(
            f"{r['name']:>20}: {r['tokens_per_s_median'] or 0:9.0f} tok/s  "
            f"slow link {r['slow_link_bytes'] / 1e6:8.2f} MB "
            f"(x{ratio['slow_link_bytes'] or 0:.3f})  eval {r['final_eval_loss']:.4f}  wall {r['wall_s']:.1f}s"
        )
    print(f"bench.json and bench.png in {out}")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    names = [r["name"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), dpi=110)
    for ax, key, label in zip(
        axes,
        ("tokens_per_s_median", "slow_link_bytes", "final_eval_loss"),
        ("tokens/s (median round)", "bytes over the slow link", "final eval loss"),
        strict=True,
    ):
        ax.bar(names, [r[key] or 0 for r in results], color=["#888", "#3b75af", "#c44e52"])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.suptitle("hsgd bench: hierarchical vs flat, same run", fontsize=10)
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
