"""Pictures of a run, written next to its JSON: loss.png (train loss per replica and eval loss of
the global model vs inner step, with fault markers)."""
from __future__ import annotations

from pathlib import Path

from hsgd.runlog import read_jsonl


def loss_plot_data(run_dir: str | Path) -> dict:
    """The series loss.png is drawn from (tests check these, not pixels)."""
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    per_replica: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        for rid, loss in (m.get("replica_loss") or {}).items():
            per_replica.setdefault(rid, []).append((m["inner_step"], loss))
    evals = [(m["inner_step"], m["eval_loss"]) for m in metrics if m.get("eval_loss") is not None]
    faults = read_jsonl(run_dir / "faults_fired.jsonl")
    spr = metrics[0]["inner_step"] // (metrics[0]["round"] + 1) if metrics else 1
    fault_steps = [(f["round"] * spr + f.get("step", 0), f"{f['kind']} {f['rid']}") for f in faults]
    return {"replica_loss": per_replica, "eval_loss": evals, "faults": fault_steps}


def write_loss_png(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = loss_plot_data(run_dir)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for rid, points in sorted(data["replica_loss"].items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1, alpha=0.7, label=f"train {rid}")
    if data["eval_loss"]:
        ax.plot([p[0] for p in data["eval_loss"]], [p[1] for p in data["eval_loss"]], "k-o", ms=3, lw=2,
                label="eval (global model)")
    for step, label in data["faults"]:
        ax.axvline(step, color="red", ls="--", lw=1)
        ax.annotate(label, (step, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=7, color="red")
    ax.set_xlabel("inner step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("hsgd: train loss per replica (round mean) and eval loss of the global model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out = Path(run_dir) / "loss.png"
    tmp = out.with_name(".loss.png.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def write_run_plots(run_dir: str | Path) -> list[Path]:
    return [write_loss_png(run_dir)]
