"""What every peer suite (`overhead`, `recovery`, `goodput`, `scale`, `straggler`, `sites`,
`convergence` and `outer_exchange`) writes, and BENCHMARKS.md made from it.

Each suite writes `<out>/<suite>.json` through `write_suite`: its own figures plus a header that
says when, where and how they were measured —

    {"suite", "date" (UTC, ISO 8601), "machine": {"platform", "python", "torch", "cpus", "gpu"},
     "command" (the exact command line), "quick" (a smoke run: its figures are not results), ...}

— and its plot beside it, `<out>/<suite>.png`. `python -m benchmarks report [--from DIR ...]
[--to BENCHMARKS.md]` reads every `<suite>.json` under the given folders (the newest of each suite
wins) and writes BENCHMARKS.md: one section per suite, its header (date, machine, and the command
without its `--out`, a path of the machine it ran on), the suite's figures in a table, and its plot
(linked relative to BENCHMARKS.md; a report listing `plots`, file names beside its JSON, gets each
of them). A quick run's figures are never written there. Suites describe their own rows (`ROWS`: a
suite's headline rows from its JSON). The `OPTIONAL` suites (`convergence`, `outer_exchange`: hours on this machine)
get a section only once a full report of theirs exists; the others say "Not measured yet" until then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

SUITES = ("overhead", "recovery", "goodput", "scale", "straggler", "sites")
OPTIONAL = ("convergence", "outer_exchange", "sites_transient")  # rendered when a full report exists, else left out


def header(suite: str, argv: list[str], quick: bool) -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "suite": suite,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "gpu": gpu,
        },
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in [suite, *argv]),
        "quick": quick,
    }


@contextlib.contextmanager
def bench_ray(num_cpus: int = 8, namespace: str = "hsgd-bench", **init):
    """The suite's embedded Ray: started here (token auth at Ray's default, on) and shut down at
    the end — or, when the caller already runs one (a test session's), that one, left running."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace=namespace,
            include_dashboard=False,
            log_to_driver=False,
            **init,
        )
    try:
        yield
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def write_suite(out: Path, report: dict) -> Path:
    """`<out>/<suite>.json`, written whole or not at all (temp name, then rename)."""
    path = Path(out) / f"{report['suite']}.json"
    atomic_write_text(path, json.dumps(report, indent=2, default=str))
    return path


def _f(value, spec: str = ".3g", unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _overhead_rows(r: dict) -> list[list[str]]:
    return [
        [
            f"hsgd 1×2 ddp / torch DDP, `{m['model']}`",
            f"{_f(m['ratio_median'], '.3f')}×",
            f"{_f(m['ratio_min'], '.3f')}–{_f(m['ratio_max'], '.3f')}",
        ]
        for m in r["models"]
    ]


SPARE_REJOIN_TARGET_S = 2.0  # issue 36: with one hot spare a killed replica is back within this


def _recovery_rows(r: dict) -> list[list[str]]:
    """Per side its stall and rejoin; hsgd's sides (in newer reports) add detection (the SIGKILL to
    `replica_down`: median / p95 over the kills) and the median of each stage of the way back, in
    order (benchmarks/peers/hsgd_peer.py `restart_breakdown`: `promote` counts from the kill, the
    others are each stage's own length); then the ratios."""
    rows = []
    for side in r["sides"]:
        rec, name = side.get("recovery") or {}, side["name"]
        note = f"step {_f(side.get('step_time_s'), '.2f', ' s')}"
        if name == "hsgd_1x3_spare" and rec.get("rejoin_s") is not None:
            note += (
                f"; one hot spare: target rejoin ≤ {SPARE_REJOIN_TARGET_S:g} s "
                f"{_holds(rec['rejoin_s'] <= SPARE_REJOIN_TARGET_S)}"
            )
        rows.append(
            [
                f"{name}: survivors' stall (median) / killed replica's rejoin",
                f"{_f(rec.get('survivors_stall_median_s'), '.2f', ' s')} / {_f(rec.get('rejoin_s'), '.2f', ' s')}",
                note,
            ]
        )
        if side.get("detect_s"):
            d = side["detect_s"]
            rows.append(
                [
                    f"{name}: SIGKILL to `replica_down` (median / p95)",
                    f"{_f(d.get('median'), '.2f', ' s')} / {_f(d.get('p95'), '.2f', ' s')}",
                    f"{len([x for x in d.get('each') or [] if x is not None])} kills",
                ]
            )
        if side.get("restart_breakdown"):
            rows.append(
                [
                    f"{name}: the way back, median of each stage",
                    ", ".join(f"{stage} {_f(s, '.2f', ' s')}" for stage, s in side["restart_breakdown"].items()),
                    "in order; `promote` from the kill",
                ]
            )
    for name, ratio in r.get("ratios", {}).items():
        rows.append([name, f"{_f(ratio, '.3g')}×", "same invocation"])
    return rows


def _goodput_rows(r: dict) -> list[list[str]]:
    return [
        [
            f"{g['side']} at MTBF {g['mtbf_s']:g} s: wall vs fault-free / committed-step efficiency",
            f"{_f(g.get('goodput'), '.3f')} / {_f(g.get('step_efficiency'), '.3f')}",
            f"{g.get('faults', 0)} faults",
        ]
        for g in r["runs"]
        if g.get("mtbf_s")
    ]


def _scale_rows(r: dict) -> list[list[str]]:
    rows = [
        [
            f"decisions per round, {d['replicas']:,} replicas / {d['clusters']} clusters",
            _f(d.get("machine_plus_runner_ms"), ".1f", " ms"),
            "",
        ]
        for d in r.get("decisions", [])
    ]
    fit = r.get("decisions_fit") or {}
    rows.append(["decisions: growth exponent (time ∝ replicas^k)", _f(fit.get("growth_exponent"), ".2f"), ""])
    for p in r.get("ray_control_plane", []):
        rows.append(
            [
                f"Ray control plane per round, {p['replicas']} light replica actors",
                _f(p.get("round_ms_median"), ".1f", " ms"),
                f"spread {_f(p.get('round_ms_spread'), '.1f', ' ms')}",
            ]
        )
    fit = r.get("ray_fit") or {}
    if r.get("ray_extrapolated_10000_ms") is not None:
        rows.append(
            [
                "Ray control plane per round, extrapolated to 10,000 replicas (power fit / fixed + per replica)",
                f"{_f(r['ray_extrapolated_10000_ms'], '.0f', ' ms')} / "
                f"{_f((fit.get('affine') or {}).get('at_10000_ms'), '.0f', ' ms')}",
                f"exponent {_f(fit.get('growth_exponent'), '.2f')} (r² {_f(fit.get('r2'), '.2f')}); "
                f"budget {r.get('budget_ms', 600):g} ms",
            ]
        )
    return rows + _lasting_rows(r)


def _holds(value) -> str:
    return "holds" if value else "does not hold"


def _lasting_rows(r: dict) -> list[list[str]]:
    """scale's part 3: rounds whose inner phase lasts `lasting_inner_s` (none in older reports), the
    runner reading steps off the progress board (the default) and by calls (its fallback)."""
    lasting = r.get("lasting_rounds") or []
    if not lasting:
        return []
    inner_s, rows = r["lasting_inner_s"], []
    for p in lasting:
        for path, f in (("progress board", p), ("by calls", p.get("by_calls"))):
            if f is None:
                continue
            by = f["lasting"]["calls_by_method"]
            rows.append(
                [
                    f"actor calls per round, {p['replicas']} actors / {p['clusters']} clusters, {path}: "
                    f"{inner_s:g}-s inner phase / instant / extra",
                    f"{f['calls_per_round']} / {f['instant_calls_per_round']} / {f['extra_calls_per_round']}",
                    f"target extra ≤ 2×clusters×ticks = {f['target_extra_calls']:.0f}: "
                    f"{_holds(f['extra_calls_hold'])}; progress calls {by.get('progress', 0)} (idle-liveness "
                    f"{f['idle_liveness_calls_lasting']}); supervisor CPU "
                    f"{_f(100 * f['supervisor_cpu_per_inner_s'], '.1f', ' %')} of a core",
                ]
            )
    for p in lasting:
        cells = [f"{_f(100 * p['supervisor_cpu_per_inner_s'], '.1f', ' %')}"]
        if p.get("by_calls"):
            cells.append(f"{_f(100 * p['by_calls']['supervisor_cpu_per_inner_s'], '.1f', ' %')}")
        rows.append(
            [
                f"supervisor CPU per second of inner phase, {p['replicas']} actors: "
                f"progress board{' / by calls' if p.get('by_calls') else ''}",
                " / ".join(cells) + " of a core",
                f"drive()'s thread (board) {_f(100 * p['supervisor_main_thread_cpu_per_inner_s'], '.1f', ' %')}; "
                f"driver at rest {_f(100 * r['driver_idle_cpu_per_s'], '.1f', ' %')}",
            ]
        )
    targets = r["lasting_targets"]
    for path, fit, holds in (
        ("progress board", r["lasting_fit"], r["lasting_holds"]),
        ("by calls", r["lasting_fit"].get("by_calls"), r["lasting_holds"].get("by_calls")),
    ):
        if fit is None:
            continue
        calls, cpu = fit["extra_calls"], fit["supervisor_cpu_per_inner_s"]
        rows.append(
            [
                f"{path}: extra calls per round vs replicas (affine fit)",
                f"{calls['fixed']:.1f} + {calls['per_replica']:.2f} × replicas",
                f"{_f(calls.get('per_replica_per_tick'), '.2f')} per replica per tick; "
                f"{_f(calls['at_10000'], ',.0f')} at 10,000",
            ]
        )
        rows.append(
            [
                f"{path}: supervisor CPU per second of inner phase vs replicas (affine fit)",
                f"{100 * cpu['fixed']:.2f} % + {100 * cpu['per_replica']:.3f} % × replicas",
                f"one core at ~{_f(cpu.get('one_core_at_replicas'), ',.0f')} replicas",
            ]
        )
        rows.append(
            [
                f"{path}: issue 36 targets ({inner_s:g}-s inner phases)",
                f"extra calls ≤ {targets['extra_calls_per_cluster_tick']:g}×clusters×ticks at every size: "
                f"{_holds(holds['extra_calls_le_2_clusters_ticks'])}; "
                f"CPU at {holds['largest_replicas']} actors ≤ "
                f"{100 * targets['cpu_fraction_at_largest']:g} % of a core: "
                f"{_holds(holds['cpu_le_5pct_at_largest'])}",
                "figures, never asserts",
            ]
        )
    return rows


def _straggler_rows(r: dict) -> list[list[str]]:
    return [
        [
            f"{a['name']}: time to {r['steps']} steps",
            _f(a.get("wall_s"), ".1f", " s"),
            f"speed-up vs flat {_f(a.get('speedup_vs_flat'), '.2f')}×",
        ]
        for a in r["arms"]
    ]


def _sites_rows(r: dict) -> list[list[str]]:
    rows = []
    for a in r["arms"]:
        rows.append(
            [
                f"balance={a['name']}: tokens/s / final eval loss / fast site's wait at the outer sync",
                f"{_f(a.get('tokens_per_s'), '.0f')} / {_f(a.get('final_eval_loss'), '.4f')} / "
                f"{_f((a.get('outer_wait_fraction_median') or {}).get('c0'), '.1%')}",
                f"{a['rounds']} rounds, {a['tokens']:,} tokens in {_f(a.get('train_wall_s'), '.1f', ' s')}",
            ]
        )
    ratios, holds, targets = r["ratios"], r["holds"], r["targets"]
    rows.append(
        [
            "tokens/s, steps / none",
            f"{_f(ratios['tokens_per_s'], '.2f')}×",
            f"target ≥ {targets['tokens_per_s']:g}×: {'holds' if holds['tokens_per_s'] else 'does not hold'}",
        ]
    )
    rows.append(
        [
            f"time to none's final eval loss ({r['loss_target']:.4f}), none / steps",
            f"{_f(r['none_wall_to_loss_s'], '.1f', ' s')} / {_f(r['steps_wall_to_loss_s'], '.1f', ' s')} = "
            f"{_f(ratios['time_to_loss'], '.2f')}×",
            f"target ≥ {targets['time_to_loss']:g}×: {'holds' if holds['time_to_loss'] else 'does not hold'}",
        ]
    )
    if r.get("gap"):
        rows.append([f"the gap to {r['ceiling']:g}×", r["gap"]["figures"], r["gap"]["sentence"]])
    return rows


def _pct(gap) -> str:
    return "—" if gap is None else f"{100 * gap:+.2f} %"


def _yes(meets) -> str:
    return "—" if meets is None else "yes" if meets else "no"


def _convergence_rows(r: dict) -> list[list[str]]:
    """benchmarks/convergence.py's table: per arm its final eval loss, its gap against flat DDP of its
    kind at the arm's own inner rate and (with a `--flat-lrs` sweep) at flat DDP's best rate, and the
    slow-link bytes ratio, the target held against each; then flat DDP's best rate per kind and
    hsgd's DiLoCo against torchft's at the same H."""
    target = r.get("target") or {}
    gap = 100 * target["gap"] if "gap" in target else None
    bar = f"≥ {_f(target.get('bytes_ratio_vs_flat'), 'g')}×, ≤ {_f(gap, 'g')} %"
    rows = []
    for row in r["rows"]:
        swept = (row.get("flat_rates") or 0) > 1
        status = "" if row.get("status") == "completed" else f" ({row.get('status')})"
        gaps = _pct(row.get("gap")) + (f" / {_pct(row.get('gap_vs_best_flat'))}" if swept else "")
        holds = _yes(row.get("meets_target")) + (f" / {_yes(row.get('meets_target_vs_best_flat'))}" if swept else "")
        rows.append(
            [
                f"`{row['arm']}`{status}: eval loss / gap vs flat DDP (its rate{' / best rate' if swept else ''})"
                f" / flat ÷ arm slow-link bytes",
                f"{_f(row.get('final_eval_loss'), '.4f')} / {gaps} / {_f(row.get('bytes_ratio_vs_flat'), ',.1f')}×",
                f"{row.get('what', '')}; target ({bar}): {holds}",
            ]
        )
    for at, best in (r.get("flat_best") or {}).items():
        if len(best.get("rates") or []) < 2:
            continue
        rows.append(
            [
                f"flat DDP's best inner rate ({at})",
                f"lr {_f(best.get('inner_lr'), '.3g')}: {_f(best.get('final_eval_loss'), '.4f')} (`{best['arm']}`)",
                "tried "
                + ", ".join(
                    f"lr {_f(t.get('inner_lr'), '.3g')}: {_f(t.get('final_eval_loss'), '.4f')}" for t in best["rates"]
                ),
            ]
        )
    for h, c in (r.get("peer_comparison") or {}).items():
        rows.append(
            [
                f"hsgd DiLoCo / torchft DiLoCo eval loss, H={h}",
                f"{_f(c.get('ratio'), '.4f')}",
                f"`{c['hsgd_arm']}` {_f(c.get('hsgd_eval_loss'), '.4f')} / `{c['torchft_arm']}` "
                f"{_f(c.get('torchft_eval_loss'), '.4f')} (< 1: hsgd ends lower)",
            ]
        )
    return rows


def _mb(n) -> str:
    return _f(None if n is None else n / 1e6, ".3f", " MB")


def _outer_exchange_rows(r: dict) -> list[list[str]]:
    """benchmarks/outer_exchange.py: per codec and exchange the busiest site's bytes per outer step at
    each N, and their modeled seconds; Acceptance 1's ratios; the re-encoding's error; int4's eval loss."""
    rows = []
    links = ", ".join(f"{x['gbps']:g} Gbps {x['latency_ms']:g} ms" for x in r["links"])
    for codec in dict.fromkeys(b["codec"] for b in r["bytes"]):
        for ex in dict.fromkeys(b["exchange"] for b in r["bytes"] if b["codec"] == codec):
            got = sorted(
                (b for b in r["bytes"] if b["codec"] == codec and b["exchange"] == ex), key=lambda b: b["sites"]
            )
            sites = "/".join(str(b["sites"]) for b in got)
            ratios = ", ".join(f"{n}: {v:.2f}x" for n, v in r["growth"][codec][ex].items())
            rows.append(
                [
                    f"`{codec}` {ex}: slow-link bytes per site per outer step, {sites} sites",
                    " / ".join(_mb(b["bytes_per_site"]) for b in got),
                    f"vs 2 sites {ratios}; modeled s per step ({links}): "
                    + " / ".join(", ".join(f"{t:.3f}" for t in b["link_s"]) for b in got)
                    + f" ({'/'.join(str(b['messages']) for b in got)} messages)",
                ]
            )
    for codec, at in r.get("acceptance_1", {}).items():
        rows.append(
            [
                f"`{codec}` auto (gather at 2, reduce_scatter from 3): bytes per site, N sites / 2 sites",
                ", ".join(f"{n}: {v['ratio']:.2f}x" for n, v in at.items()),
                "target " + ", ".join(f"{n}: <= {v['target']:g}x {_holds(v['holds'])}" for n, v in at.items()),
            ]
        )
    for e in r.get("reencoding", []):
        rows.append(
            [
                f"`{e['codec']}`, {e['sites']} sites: reduce_scatter's mean vs gather's (relative L2)",
                f"{e['reencoding_vs_gather']:.2e}",
                f"the re-encoding, no residual kept; gather vs the exact mean {e['codec_vs_exact']:.2e}",
            ]
        )
    for sites, g in r.get("loss_gaps", {}).items():
        by = {x["exchange"]: x for x in r["loss"] if str(x["sites"]) == sites}
        rows.append(
            [
                f"`int4` {sites} x 1, H 50, {g['steps']} steps: final eval loss gather / reduce_scatter",
                f"{by['gather']['final_eval_loss']:.4f} / {by['reduce_scatter']['final_eval_loss']:.4f}",
                f"gap {100 * g['gap']:+.2f} %, target within {100 * 0.005:g} %: {_holds(g['holds'])}",
            ]
        )
    return rows


def _sites_transient_rows(r: dict) -> list[list[str]]:
    rows = [
        [
            f"balance={a['name']}: tokens/s / final eval loss / each site's idle share at the outer sync",
            f"{_f(a.get('tokens_per_s'), '.0f')} / {_f(a.get('final_eval_loss'), '.4f')} / "
            + ", ".join(f"{c} {_f(w, '.0%')}" for c, w in (a.get("outer_wait_fraction_median") or {}).items()),
            f"{a['rounds']} rounds, {a['tokens']:,} tokens in {_f(a.get('train_wall_s'), '.1f', ' s')}",
        ]
        for a in r["arms"]
    ]
    holds = {k: "holds" if v else "does not hold" for k, v in r["holds"].items()}
    rows += [
        [
            "tokens/s, time / steps (time / none)",
            f"{_f(r['tokens_per_s_time_vs_steps'], '.2f')}× ({_f(r['tokens_per_s_time_vs_none'], '.2f')}×)",
            f"predicted {_f(r['predicted_time_vs_steps'], '.2f')}× ({r['predicted_from']}); target ≥ "
            f"{r['targets']['tokens_per_s_time_vs_steps']:g}×: {holds['tokens_per_s']}",
        ],
        [
            f"eval loss at equal tokens ({r['equal_tokens']:,}): none / steps / time",
            " / ".join(_f(r["eval_loss_at_equal_tokens"].get(n), ".4f") for n in ("none", "steps", "time")),
            f"time vs steps {_f(r['loss_gap_at_equal_tokens'], '+.2%')}, target within "
            f"{r['targets']['loss_at_equal_tokens']:.0%}: {holds['loss_at_equal_tokens']}",
        ],
        [
            f"eval loss at equal wall ({_f(r['equal_wall_s'], '.0f', ' s')}): none / steps / time",
            " / ".join(_f(r["eval_loss_at_equal_wall"].get(n), ".4f") for n in ("none", "steps", "time")),
            "interpolated between the per-round evals",
        ],
    ]
    return rows


ROWS: dict[str, Callable[[dict], list[list[str]]]] = {
    "overhead": _overhead_rows,
    "recovery": _recovery_rows,
    "goodput": _goodput_rows,
    "scale": _scale_rows,
    "straggler": _straggler_rows,
    "sites": _sites_rows,
    "sites_transient": _sites_transient_rows,
    "convergence": _convergence_rows,
    "outer_exchange": _outer_exchange_rows,
}

TITLES = {
    "overhead": "Overhead: hsgd's inner DDP vs plain torch DDP",
    "recovery": "Recovery from one kill: hsgd vs torchft vs Ray Train",
    "goodput": "Goodput under a steady rain of failures",
    "scale": "Control plane vs size",
    "straggler": "Stragglers: flat DDP vs local SGD vs DiLoCo",
    "sites": "Sites of different speeds: `sync.balance` none vs steps",
    "sites_transient": "A site slowed for a while: `sync.balance` none vs steps vs time",
    "convergence": "Convergence: flat DDP vs LocalSGD vs DiLoCo, eval loss vs slow-link bytes",
    "outer_exchange": "Outer exchange: gather vs reduce_scatter, slow-link bytes per site",
}


def newest_reports(folders: list[Path]) -> dict[str, dict]:
    """The newest full (not quick) report of each suite found under the folders, each with the
    path it was read from (`json_path`)."""
    found: dict[str, dict] = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.json")):
            try:
                report = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if not isinstance(report, dict) or report.get("suite") not in ROWS or report.get("quick"):
                continue
            if report["suite"] not in found or report["date"] > found[report["suite"]]["date"]:
                found[report["suite"]] = {**report, "json_path": str(path)}
    return found


def portable(command: str) -> str:
    """A recorded command without its `--out DIR` (a path of the machine it ran on)."""
    return re.sub(r"\s--out(=|\s+)('[^']*'|\S+)", "", command)


def render(reports: dict[str, dict], to_dir: Path = Path(".")) -> str:
    """BENCHMARKS.md's text; plots are linked relative to `to_dir` (the folder it is written to)."""
    lines = [
        "# hsgd benchmarks",
        "",
        "Generated by `python -m benchmarks report --from benchmarks` from each suite's JSON; every figure is a",
        "ratio or a distribution from runs interleaved in one invocation (shared machines are noisy), never a",
        "threshold. Reproduce a suite with its command, from the repository root (`python -m jobs.bench` is",
        "an alias of `python -m benchmarks`). Suites not run yet are listed as such.",
        "",
    ]
    for suite in SUITES + OPTIONAL:
        report = reports.get(suite)
        if report is None and suite in OPTIONAL:
            continue
        lines += [f"## {TITLES[suite]} (`{suite}`)", ""]
        if report is None:
            lines += [f"Not measured yet: `python -m benchmarks {suite}`.", ""]
            continue
        m = report["machine"]
        lines += [
            f"- Date: {report['date']}",
            f"- Machine: {m['platform']}, {m['cpus']} CPUs, {m['gpu'] or 'no GPU'}, torch {m['torch']}",
            f"- Command: `{portable(report['command'])}`",
            "",
            "| figure | value | note |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {' | '.join(row)} |" for row in ROWS[suite](report)]
        if report.get("notes"):  # how the figures were taken, where a suite says so
            lines += ["", *(f"- {note}" for note in report["notes"])]
        if report.get("json_path"):
            json_path = Path(report["json_path"])
            pngs = [json_path.parent / name for name in report.get("plots") or []] or [json_path.with_suffix(".png")]
            for png in (p for p in pngs if p.is_file()):
                lines += ["", f"![{suite}]({Path(os.path.relpath(png.resolve(), Path(to_dir).resolve())).as_posix()})"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from",
        dest="folders",
        nargs="+",
        default=["bench-results"],
        help="folders holding the suites' <suite>.json (searched recursively)",
    )
    parser.add_argument("--to", default="BENCHMARKS.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="accepted as by every suite: the report is quick already (and never renders a quick run)",
    )
    args = parser.parse_args(argv)
    reports = newest_reports([Path(f) for f in args.folders])
    atomic_write_text(args.to, render(reports, Path(args.to).parent))
    print(f"{args.to}: {', '.join(sorted(reports)) or 'no suite measured yet'}", file=sys.stderr)
    return 0
