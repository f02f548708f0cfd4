"""Weights & Biases logging of the supervisor's global view (one run per job).

Offline by default (`logging.wandb.mode=offline`): the run files land under `<run.dir>/wandb`
and nothing touches the network; `online` needs WANDB_API_KEY in the environment (never in a
config or a log); `disabled` writes nothing. Rounds and inner steps are both step axes.
"""
from __future__ import annotations

import os
from typing import Any


class WandbSink:
    def __init__(self, cfg: Any, run_dir: str, resolved_config: dict):
        self.run = None
        mode = cfg.logging.wandb.mode
        if mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.logging.wandb.project, entity=cfg.logging.wandb.entity,
                              group=cfg.logging.wandb.group or cfg.run.name, name=os.path.basename(run_dir),
                              dir=run_dir, mode=mode, config=resolved_config, reinit="finish_previous")
        self.run.define_metric("round")
        self.run.define_metric("inner_step")
        for key in ("loss", "eval_loss", "tokens_per_s", "live_replicas", "epoch"):
            self.run.define_metric(key, step_metric="inner_step")
        self.run.define_metric("outer_bytes", step_metric="round")
        self.run.define_metric("inner_bytes", step_metric="round")

    def log_round(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None})

    def log_event(self, name: str, fields: dict) -> None:
        if self.run is not None:
            self.run.log({f"events/{name}": 1, **{f"events/{name}/{k}": v for k, v in fields.items()
                                                   if isinstance(v, (int, float))}})

    def finish(self, summary: dict) -> None:
        if self.run is not None:
            for key in ("status", "rounds_committed", "inner_steps_committed", "final_eval_loss", "wall_s"):
                if key in summary:
                    self.run.summary[key] = summary[key]
            self.run.finish()
