"""`python -m benchmarks recovery [--quick] [--out DIR] [--steps 120 --kill-at 20 --min-step-s 0.25] [--repeats 2]`:
one replica SIGKILLed from outside mid-inner-phase, on hsgd and on its peers, in one invocation.

Sides, each 3 replicas training hsgd's model (same config, batches, loss, AdamW; every step padded
to `--min-step-s` so 2 shared cores do not decide the result), run one after another and
interleaved over `--repeats`:

    hsgd_1x3        one cluster of 3, ddp every step: the same work as the flat peers
    hsgd_3x1        3 clusters of 1, DiLoCo every steps/4 (the hierarchy: the others keep training)
    hsgd_1x3_spare  hsgd_1x3 with one warm hot spare (`topology.spares_per_cluster=1`): the spare
                    takes the dead replica's id at once; Ray's restart of it becomes the next spare
    torchft_readme  torchft Manager + Lighthouse, DDP, the README's settings (benchmarks/peers/torchft_peer.py)
    torchft_fast    the same with a 100 ms join timeout and short heartbeats
    ray_train       Ray Train v2 TorchTrainer + FailureConfig, checkpoint every 10 steps
                    (benchmarks/peers/raytrain_peer.py)

The victim (hsgd `c0r1` / `c1r0`, the peers' `r1`) is SIGKILLed once it has committed step
`--kill-at`; each side's own recovery restarts it (Ray for hsgd and Ray Train, the bench for
torchft, as torchx would). From the step logs (benchmarks/peers/common.py): the survivors' stall (last
committed step before the kill to the next after it), the victim's rejoin (kill to its next
committed step) and the step time before the kill. `recovery.json`: per side and repeat those
figures, medians per side, and the ratios hsgd_1x3 / peer for stall and rejoin; `recovery.png`.
hsgd's sides add `detect_s` (the SIGKILL to hsgd's `replica_down` event: median, p95, each) and
`restart_breakdown` (the median of each stage of the victim's way back, benchmarks/peers/hsgd_peer.py).
`--quick`: 100 steps of 0.2 s, kill at 6, one repeat (the victim must have time to come back: ~19 s): a smoke run
(`--sides` picks the sides; the test suite runs hsgd_1x3 and torchft_fast).
The peers need the bench extra: `pip install -e ".[bench]"`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.report import bench_ray, header, write_suite

SIDES = ("hsgd_1x3", "hsgd_3x1", "hsgd_1x3_spare", "torchft_readme", "torchft_fast", "ray_train")
COLORS = {
    "hsgd_1x3": "#3b75af",
    "hsgd_3x1": "#6a9fd4",
    "hsgd_1x3_spare": "#234b73",
    "torchft_readme": "#c44e52",
    "torchft_fast": "#e07b7d",
    "ray_train": "#55a868",
}
VICTIM = {"hsgd_1x3": "c0r1", "hsgd_3x1": "c1r0", "hsgd_1x3_spare": "c0r1"}  # the peers': r1


def run_side(name: str, *, model: str, steps: int, kill_at: int, min_step_s: float, out: Path, seed: int) -> dict:
    kills = [(VICTIM.get(name, "r1"), kill_at)]
    common = dict(model=model, steps=steps, min_step_s=min_step_s, out=out, kills=kills, seed=seed)
    if name.startswith("hsgd"):
        from benchmarks.peers.hsgd_peer import run_hsgd

        clusters, per = (3, 1) if name == "hsgd_3x1" else (1, 3)
        spares = ["topology.spares_per_cluster=1"] if name.endswith("_spare") else []
        return run_hsgd(clusters=clusters, replicas_per_cluster=per, overrides=spares, **common)
    if name.startswith("torchft"):
        from benchmarks.peers.torchft_peer import run_torchft

        return run_torchft(replicas=3, settings=name.split("_", 1)[1], **common)
    from benchmarks.peers.raytrain_peer import run_raytrain

    return run_raytrain(replicas=3, **common)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _p95(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, max(0, -(-95 * len(values) // 100) - 1))] if values else None


def summarize(name: str, runs: list[dict]) -> dict:
    recs = [r["recoveries"][0] if r.get("recoveries") else {} for r in runs]
    out = {
        "name": name,
        "runs": runs,
        "recovery": {
            "survivors_stall_median_s": _median([x.get("survivors_stall_median_s") for x in recs]),
            "survivors_stall_max_s": _median([x.get("survivors_stall_max_s") for x in recs]),
            "rejoin_s": _median([x.get("rejoin_s") for x in recs]),
        },
        "step_time_s": _median([r.get("step_time_s") for r in runs]),
        "completed": all(r.get("result_error") is None for r in runs),
    }
    breakdowns = [b for r in runs for b in r.get("restart_breakdown") or []]
    if breakdowns:  # hsgd's sides: detection, and the median of each stage of the way back
        detect = [b.get("detect_s") for b in breakdowns]
        out["detect_s"] = {"median": _median(detect), "p95": _p95(detect), "each": detect}
        stages = [s for b in breakdowns for s in b["stages_s"]]
        out["restart_breakdown"] = {
            s: _median([b["stages_s"].get(s) for b in breakdowns]) for s in dict.fromkeys(stages)
        }
    return out


def ratios(sides: dict[str, dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    ours = sides.get("hsgd_1x3", {}).get("recovery", {})
    for peer in ("torchft_readme", "torchft_fast", "ray_train"):
        theirs = sides.get(peer, {}).get("recovery")
        if not theirs:
            continue
        for figure, key in (("stall", "survivors_stall_median_s"), ("rejoin", "rejoin_s")):
            a, b = ours.get(key), theirs.get(key)
            out[f"hsgd_1x3 / {peer} {figure}"] = a / b if a is not None and b else None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--min-step-s", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.kill_at, args.repeats, args.min_step_s = 100, 6, 1, 0.2
    names = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(names) - set(SIDES))
    if unknown:
        parser.error(f"--sides: unknown {', '.join(unknown)}; valid: {', '.join(SIDES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-recovery-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with bench_ray():
        for repeat in range(args.repeats):  # interleaved: each repeat runs every side once
            for name in names:
                run = run_side(
                    name,
                    model=args.model,
                    steps=args.steps,
                    kill_at=args.kill_at,
                    min_step_s=args.min_step_s,
                    out=out / f"{name}_{repeat}",
                    seed=args.seed,
                )
                runs[name].append(run)
                rec = (run.get("recoveries") or [{}])[0]
                print(
                    f"recovery {name} #{repeat}: stall {rec.get('survivors_stall_median_s')} s, "
                    f"rejoin {rec.get('rejoin_s')} s, step {run.get('step_time_s')} s, "
                    f"error {run.get('result_error')}",
                    flush=True,
                )
                for b in run.get("restart_breakdown") or []:
                    print(
                        f"  {name} #{repeat} way back (s): detect {_r(b['detect_s'])}, "
                        + ", ".join(f"{k} {_r(v)}" for k, v in b["stages_s"].items()),
                        flush=True,
                    )
    sides = {n: summarize(n, r) for n, r in runs.items()}
    report = {
        **header("recovery", argv, args.quick),
        "model": args.model,
        "steps": args.steps,
        "kill_at": args.kill_at,
        "min_step_s": args.min_step_s,
        "repeats": args.repeats,
        "sides": list(sides.values()),
        "ratios": ratios(sides),
    }
    write_suite(out, report)
    _plot(report, out / "recovery.png")
    for key, value in report["ratios"].items():
        print(f"{key}: {value if value is None else round(value, 3)}")
    print(f"recovery.json and recovery.png in {out}")
    return 0


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _plot(report: dict, path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    sides = report["sides"]
    names = [s["name"] for s in sides]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), dpi=110)
    for ax, key, label in zip(
        axes,
        ("survivors_stall_median_s", "rejoin_s"),
        ("survivors' stall (s)", "killed replica: kill to next committed step (s)"),
        strict=True,
    ):
        ax.bar(names, [s["recovery"][key] or 0 for s in sides], color=[COLORS.get(n, "#888888") for n in names])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"one SIGKILL at step {report['kill_at']} (step padded to {report['min_step_s']} s)", fontsize=10)
    save_png(fig, path)
