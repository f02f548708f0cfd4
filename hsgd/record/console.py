"""Console view of a running job: a tqdm bar over inner steps and one line per committed round."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from hsgd.record.rundir import read_jsonl


def _num(value, fmt: str = ".4f", blank: str = "     -") -> str:
    return blank if value is None else format(value, fmt)


def round_line(m: dict) -> str:
    """One console line per committed round (a round recorded late has no loss or throughput: '-')."""
    ev, loss = _num(m.get("eval_loss")), _num(m.get("loss"))
    return (
        f"round {m['round']:>4} | step {m['inner_step']:>6} | loss {loss} | eval {ev} | "
        f"{m.get('tokens_per_s') or 0.0:8.0f} tok/s | live {m['live_replicas']} | epoch {m['epoch']} | "
        f"outer {m['outer_bytes'] / 1e6:.2f} MB"
    )


class ProgressView:
    def __init__(self, total_steps: int, run_dir: str, enabled: bool = True):
        """`total_steps`: the run's inner steps (train.rounds x the layout's steps per round)."""
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=not enabled)
        self.rounds_printed = len(read_jsonl(self.metrics_path))  # a resumed run's earlier rounds

    def update(self, status: dict) -> None:
        for m in read_jsonl(self.metrics_path)[self.rounds_printed :]:
            self.rounds_printed += 1
            line = round_line(m)
            if self.enabled:
                self.bar.write(line)
            else:
                print(line, flush=True)
        step = status.get("inner_step")
        if step is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)
        post = {"phase": status.get("phase"), "epoch": status.get("epoch")}
        if status.get("last_loss") is not None:
            post["loss"] = f"{status['last_loss']:.3f}"
        if status.get("tokens_per_s"):
            post["tok/s"] = f"{status['tokens_per_s']:.0f}"
        self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        self.update({})
        self.bar.close()
