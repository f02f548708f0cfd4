"""`python -m benchmarks overhead [--quick] [--out DIR] [--models tiny small] [--steps N] [--repeats R]`:
what hsgd's orchestration costs a step, against plain `torch.distributed` DDP.

For each model, `python -m benchmarks ddp` (issue 20's comparison, reused, not rewritten: two processes over
gloo, hsgd's `hsgd.train.trainer.ReplicaTrainer.run_inner` on a 2-member inner group vs
`torch.nn.parallel.DistributedDataParallel`, same model, batches, loss, clipping and AdamW, warmed
up, then interleaved repeats) runs into `<out>/ddp_<model>/ddp.json`. `overhead.json` holds per
model the tokens/s of each side (median of the repeats), the ratio hsgd / DDP (median) and its
spread over the repeats (min, max of the per-repeat ratios); `overhead.png` plots them. A ratio
near 1 means the orchestration costs nothing per step; timings are this machine's, the ratio is the
figure. `--quick` (a smoke run): the tiny model, 3 steps, 1 repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.report import header, write_suite


def measure(model: str, steps: int, repeats: int, out: Path) -> dict:
    from benchmarks.ddp import main as ddp_main

    folder = out / f"ddp_{model}"
    if ddp_main(["--out", str(folder), "--model", model, "--steps", str(steps), "--repeats", str(repeats)]) != 0:
        raise RuntimeError(f"benchmarks ddp failed for model {model}")
    ddp = json.loads((folder / "ddp.json").read_text())
    each = ddp["ratio_each_repeat"]
    return {
        "model": model,
        "params": ddp["params"],
        "steps": steps,
        "repeats": repeats,
        "hsgd_tokens_per_s": ddp["cases"]["hsgd"]["tokens_per_s"],
        "torch_ddp_tokens_per_s": ddp["cases"]["torch_ddp"]["tokens_per_s"],
        "ratio_median": statistics.median(each),
        "ratio_min": min(each),
        "ratio_max": max(each),
        "ratio_each_repeat": each,
        "ddp_json": str(folder / "ddp.json"),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.repeats = ["tiny"], 3, 1
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-overhead-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = []
    for model in args.models:
        models.append(measure(model, args.steps, args.repeats, out))
        m = models[-1]
        print(
            f"overhead {model}: hsgd {m['hsgd_tokens_per_s']:.0f} tok/s, torch DDP {m['torch_ddp_tokens_per_s']:.0f} "
            f"tok/s, ratio {m['ratio_median']:.3f} ({m['ratio_min']:.3f}-{m['ratio_max']:.3f})",
            flush=True,
        )
    report = {**header("overhead", argv, args.quick), "models": models}
    write_suite(out, report)
    _plot(models, out / "overhead.png")
    print(f"overhead.json and overhead.png in {out}")
    return 0


def _plot(models: list[dict], path: Path) -> None:
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
    names = [m["model"] for m in models]
    ax.bar(names, [m["ratio_median"] for m in models], color="#3b75af")
    ax.errorbar(
        names,
        [m["ratio_median"] for m in models],
        yerr=[
            [m["ratio_median"] - m["ratio_min"] for m in models],
            [m["ratio_max"] - m["ratio_median"] for m in models],
        ],
        fmt="none",
        color="k",
        capsize=4,
    )
    ax.axhline(1.0, color="#888", lw=1, ls="--")
    ax.set_ylabel("tokens/s, hsgd / torch DDP")
    ax.set_title("hsgd 1x2 ddp vs torch DDP (median, spread over repeats)", fontsize=9)
    save_png(fig, path)
