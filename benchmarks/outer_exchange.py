"""`python -m benchmarks outer_exchange [--quick] [--out DIR] [--sites 2 4 8] [--rounds 3] [--gbps 1]
[--link 1:50 --link 0.1:10] [--loss-steps 2000 1000] [--no-loss] [--jobs 2]`: issue 47's slow-link bytes per site of the
two outer exchanges (sync.outer_exchange, hsgd/train/exchange.py), in one process per job, no Ray: the sweep
tool's `simulate` (benchmarks/outer_sweep.py), where the trainers' own outer_reduce runs over an in-process
group that counts bytes as hsgd.train.comm.LevelGroup does.

1. Bytes: N sites of one replica (tiny model, H 5, `--rounds` outer steps) for each N of `--sites`, each codec
   and each exchange that applies to it (none: the all-reduce; topk: gather). Per site and outer step: the
   bytes it sent + received (the busiest site: chunks are cut at codec blocks, so shares differ by a block),
   and the time they take on each modeled link (`hsgd.train.simulate.LinkModel` at `--link GBPS:LATENCY_MS`,
   full duplex: its time for the larger direction, plus one latency per further sequential message,
   `hsgd.train.exchange.link_messages`; the tiny model's payload is small, so latency weighs heavily).
2. Re-encoding: reduce_scatter's owner re-encodes the reduced chunk and keeps no residual; the relative L2
   distance of its mean from gather's, beside the codec's own error, for N pseudo-gradient-like vectors.
3. Loss (int4 only, issue 47 Acceptance 2): the final eval loss, reduce_scatter vs gather, everything else
   the same: 4 x 1 at `--loss-steps`[0] steps and 8 x 1 at `--loss-steps`[1], H 50, seed 12.

Writes `<out>/outer_exchange.json` (benchmarks/report.py's header; BENCHMARKS.md's section is rendered from
it) and `<out>/outer_exchange.png`, one progress line per job.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

CODECS = ("none", "bf16", "int8", "int4", "topk")
H_BYTES, H_LOSS = 5, 50
TARGETS = {4: 1.6, 8: 2.0}  # Acceptance 1: bytes per site at N sites over those at 2, int4 and int8
LOSS_GAP = 0.005  # Acceptance 2: reduce_scatter's final eval loss within 0.5 % of gather's


def exchanges_of(codec: str) -> tuple[str, ...]:
    return {"none": ("allreduce",), "topk": ("gather",)}.get(codec, ("gather", "reduce_scatter"))


def _overrides(sites: int, every: int, rounds: int, codec: str, exchange: str) -> list[str]:
    chosen = [] if exchange == "allreduce" else [f"sync.outer_exchange={exchange}"]
    return [
        "model=tiny",
        "seed=12",
        f"topology.clusters={sites}",
        "topology.replicas_per_cluster=1",
        f"sync.outer_every={every}",
        f"train.rounds={rounds}",
        f"sync.outer_compress={codec}",
        *chosen,
    ]


def bytes_row(sites: int, codec: str, exchange: str, rounds: int, links: list[tuple[float, float]]) -> dict:
    """One bytes job (part 1): the busiest site's bytes per outer step and their modeled seconds on each
    link (gbps, latency ms)."""
    from benchmarks.outer_sweep import simulate
    from hsgd.train.exchange import link_messages
    from hsgd.train.simulate import LinkModel

    res = simulate(_overrides(sites, H_BYTES, rounds, codec, exchange) + ["train.eval_batches=1"])
    sent = [b / rounds for b in res["site_sent_bytes"]]
    received = [b / rounds for b in res["site_received_bytes"]]
    both = [s + r for s, r in zip(sent, received, strict=True)]
    busiest = max(range(sites), key=lambda k: both[k])
    messages = link_messages(exchange, sites)
    larger = int(max(sent[busiest], received[busiest]))  # full duplex: the larger direction
    seconds = [LinkModel(gbps, ms).seconds(larger) + (messages - 1) * ms / 1e3 for gbps, ms in links]
    return {
        "sites": sites,
        "codec": codec,
        "exchange": res["outer_exchange"] or exchange,
        "bytes_per_site": both[busiest],
        "bytes_per_site_mean": sum(both) / sites,
        "sent_per_site": sent[busiest],
        "received_per_site": received[busiest],
        "messages": messages,
        "link_s": seconds,
        "wall_s": res["wall_s"],
    }


def loss_row(sites: int, steps: int, exchange: str) -> dict:
    """One loss job (part 3): int4, H 50, `steps` inner steps."""
    from benchmarks.outer_sweep import simulate

    res = simulate(_overrides(sites, H_LOSS, max(1, steps // H_LOSS), "int4", exchange))
    return {
        "sites": sites,
        "steps": steps,
        "exchange": res["outer_exchange"] or exchange,
        "initial_eval_loss": res["initial_eval_loss"],
        "final_eval_loss": res["final_eval_loss"],
        "outer_bytes": res["outer_bytes"],
        "wall_s": res["wall_s"],
    }


def reencoding_error(codec: str, sites: int, numel: int = 200_000) -> dict:
    """Part 2: relative L2 distances, on N seeded vectors with per-block scales: reduce_scatter's mean
    from gather's (the re-encoding), gather's from the exact fp32 mean (the codec's own)."""
    import threading

    import torch

    from benchmarks.outer_sweep import ThreadGroup
    from hsgd.train.codec import make_codec
    from hsgd.train.exchange import gather_mean, reduce_scatter_mean

    code = make_codec(codec)
    pieces = []
    for k in range(sites):
        g = torch.Generator().manual_seed(47 + k)
        scale = torch.rand(-(-numel // 256), generator=g).repeat_interleave(256)[:numel]
        pieces.append(torch.randn(numel, generator=g) * scale)

    def run(fn) -> torch.Tensor:
        group, out = ThreadGroup(sites), [None] * sites

        def one(k: int) -> None:
            out[k] = fn(code, pieces[k], ThreadGroup.Rank(group, k), ())

        threads = [threading.Thread(target=one, args=(k,)) for k in range(sites)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        return out[0]

    exact = torch.stack(pieces).mean(dim=0)
    gathered, scattered = run(gather_mean), run(reduce_scatter_mean)
    return {
        "codec": codec,
        "sites": sites,
        "reencoding_vs_gather": float((scattered - gathered).norm() / gathered.norm()),
        "codec_vs_exact": float((gathered - exact).norm() / exact.norm()),
    }


def growth(rows: list[dict], codec: str, exchange: str) -> dict[str, float]:
    """{N: bytes per site at N over those at 2} (`auto`: gather at 2, reduce_scatter from 3 on)."""

    def picked(sites: int) -> str:
        return exchange if exchange != "auto" else "gather" if sites < 3 else "reduce_scatter"

    at = {r["sites"]: r["bytes_per_site"] for r in rows if r["codec"] == codec and r["exchange"] == picked(r["sites"])}
    return {str(n): at[n] / at[2] for n in sorted(at) if 2 in at and n != 2}


def summarize(report: dict) -> None:
    """Acceptance 1's ratios and Acceptance 2's gaps, added to `report` (figures: a run never fails on them)."""
    report["growth"] = {}
    for codec in CODECS:
        kinds = exchanges_of(codec) + (("auto",) if len(exchanges_of(codec)) > 1 else ())
        report["growth"][codec] = {ex: growth(report["bytes"], codec, ex) for ex in kinds}
    report["acceptance_1"] = {
        codec: {
            str(n): {"ratio": ratio, "target": TARGETS[n], "holds": ratio <= TARGETS[n]}
            for n, ratio in ((int(k), v) for k, v in report["growth"][codec]["auto"].items())
            if n in TARGETS
        }
        for codec in ("int8", "int4")
    }
    gaps = {}
    for sites in sorted({r["sites"] for r in report["loss"]}):
        by = {r["exchange"]: r for r in report["loss"] if r["sites"] == sites}
        if "gather" in by and "reduce_scatter" in by:
            gap = by["reduce_scatter"]["final_eval_loss"] / by["gather"]["final_eval_loss"] - 1
            gaps[str(sites)] = {"steps": by["gather"]["steps"], "gap": gap, "holds": abs(gap) <= LOSS_GAP}
    report["loss_gaps"] = gaps


def plot(report: dict, path: Path) -> None:
    """Bytes per site per outer step vs sites, each codec and exchange; the modeled seconds on each
    link; int4's final eval loss gap, reduce_scatter vs gather."""
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()
    links = report["links"]
    fig, axes = plt.subplots(1, 2 + len(links), figsize=(5 * (2 + len(links)), 4), dpi=110)
    for codec in CODECS:
        for ex in exchanges_of(codec):
            rows = [r for r in report["bytes"] if r["codec"] == codec and r["exchange"] == ex]
            rows.sort(key=lambda r: r["sites"])
            style, sites = ("-o" if ex == "reduce_scatter" else "--s"), [r["sites"] for r in rows]
            axes[0].plot(sites, [r["bytes_per_site"] / 1e6 for r in rows], style, label=f"{codec} {ex}")
            for i in range(len(links)):
                axes[1 + i].plot(sites, [r["link_s"][i] for r in rows], style, label=f"{codec} {ex}")
    titles = ["slow-link MB per site per outer step (sent + received)"]
    titles += [f"modeled outer s per step, {x['gbps']:g} Gbps, {x['latency_ms']:g} ms" for x in links]
    for ax, title in zip(axes, titles, strict=False):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sites")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    gaps, right = report["loss_gaps"], axes[-1]
    names = [f"{sites} x 1, {g['steps']} steps" for sites, g in gaps.items()]
    right.bar(names, [100 * g["gap"] for g in gaps.values()], color="#3b75af")
    right.axhspan(-100 * LOSS_GAP, 100 * LOSS_GAP, color="#ddd", zorder=0, label="target: within 0.5 %")
    right.axhline(0, color="#888", linewidth=0.8)
    right.set_ylim(-1, 1)
    right.set_title("int4, H 50: final eval loss, reduce_scatter vs gather (%)", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle("sync.outer_exchange: gather vs reduce_scatter", fontsize=10)
    save_png(fig, path)


def notes(args: dict) -> list[str]:
    """What a reader of the section must know about how its figures were taken (from the run's args)."""
    said = [
        "Bytes per site: what the site's link carried both ways in one outer step, counted as "
        "hsgd.train.comm.LevelGroup counts them (an all-gather or all-to-all: the chunks each way; the "
        "all-reduce without a codec: its payload each way, not a ring's 2 (N - 1) / N of it).",
        "reduce_scatter keeps no residual for the owner's re-encoding of the reduced chunk; each site's "
        "own error feedback is unchanged. The re-encoding rows measure its error; the loss rows its effect.",
    ]
    steps = args.get("loss_steps")
    if not args.get("no_loss") and steps != [2000, 1000]:
        said.append(
            f"Loss at {steps[0]} (4 x 1) and {steps[1]} (8 x 1) steps, not Acceptance 2's 2,000 and 1,000: "
            f"the full runs take over 15 minutes each on this shared 2-core machine. The full figure: "
            f"`python -m benchmarks outer_exchange` (its defaults)."
        )
    return said


def _run_jobs(jobs: dict[str, tuple], workers: int) -> dict[str, dict]:
    """{name: (function, *args)} in `workers` processes; a failed job is recorded, the others still run."""
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fn, *args): name for name, (fn, *args) in jobs.items()}
        for done, future in enumerate(as_completed(futures), 1):
            name = futures[future]
            try:
                results[name] = future.result()
            except Exception as err:  # noqa: BLE001
                results[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"[outer_exchange] {done}/{len(jobs)} {name}: {results[name].get('wall_s', '-')} s", flush=True)
    return {name: results[name] for name in jobs}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import header, write_suite

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks outer_exchange", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 and 4 sites, 1 outer step, 100 loss steps")
    parser.add_argument("--out", default="bench-results/outer_exchange")
    parser.add_argument("--sites", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3, help="outer steps of each bytes job")
    parser.add_argument(
        "--link", action="append", default=None, metavar="GBPS:LATENCY_MS", help="a modeled link (repeat)"
    )
    parser.add_argument("--loss-steps", type=int, nargs=2, default=[2000, 1000], metavar=("STEPS_4X1", "STEPS_8X1"))
    parser.add_argument("--no-loss", action="store_true", help="skip part 3 (hours of one core at the defaults)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once (one core each)")
    args = parser.parse_args(argv)
    args.link = args.link or ["1:50", "0.1:10"]
    links = [(float(g), float(ms)) for g, ms in (x.split(":") for x in args.link)]
    if args.quick:
        args.sites, args.rounds, args.loss_steps = [2, 4], 1, [100, 100]
    jobs: dict[str, tuple] = {
        f"bytes {codec} {ex} {n}": (bytes_row, n, codec, ex, args.rounds, links)
        for codec in CODECS
        for ex in exchanges_of(codec)
        for n in args.sites
    }
    if not args.no_loss:
        for sites, steps in zip((4, 8), args.loss_steps, strict=True):
            jobs.update({f"loss {sites}x1 {ex}": (loss_row, sites, steps, ex) for ex in ("gather", "reduce_scatter")})
    results = _run_jobs(jobs, args.jobs)
    failed = {k: v["error"] for k, v in results.items() if "error" in v}
    report = {
        **header("outer_exchange", argv, args.quick),
        "args": vars(args),
        "links": [{"gbps": g, "latency_ms": ms} for g, ms in links],
        "bytes": [v for k, v in results.items() if k.startswith("bytes") and "error" not in v],
        "loss": [v for k, v in results.items() if k.startswith("loss") and "error" not in v],
        "reencoding": [reencoding_error(c, n) for c in ("bf16", "int8", "int4") for n in args.sites],
        "failed": failed,
        "plots": ["outer_exchange.png"],
        "notes": notes(vars(args)),
    }
    summarize(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_suite(out, report)
    plot(report, out / "outer_exchange.png")
    from benchmarks.report import ROWS

    for row in ROWS["outer_exchange"](report):
        print(" | ".join(row))
    return 1 if failed else 0
