"""Weights & Biases logging of the supervisor's global view, one run per job (docs/operations.md, "wandb").
Rounds and inner steps are both step axes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hsgd.record.rundir import call_with_deadline


class WandbSink:
    """Never raises and never blocks the run past a deadline: wandb writes under the run folder
    (offline) or to the network (online), and either can fail or hang. The first failure turns the
    sink off (`on_error(what, error)` tells the caller once); `finish` waits at most `finish_s`."""

    def __init__(
        self,
        cfg: Any,
        run_dir: str,
        resolved_config: dict,
        *,
        on_error: Callable[[str, str], None] | None = None,
        finish_s: float = 30.0,
    ):
        self.run = None
        self._on_error, self.finish_s = on_error, finish_s
        mode = cfg.logging.wandb.mode
        if mode == "disabled":
            return
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=cfg.logging.wandb.project,
                entity=cfg.logging.wandb.entity,
                group=cfg.logging.wandb.group or cfg.run.name,
                name=os.path.basename(run_dir),
                dir=run_dir,
                mode=mode,
                config=resolved_config,
                reinit="finish_previous",
            )
            self.run.define_metric("round")
            self.run.define_metric("inner_step")
            for key in ("loss", "eval_loss", "tokens_per_s", "live_replicas", "epoch"):
                self.run.define_metric(key, step_metric="inner_step")
            for key in ("outer_bytes", "inner_bytes"):
                self.run.define_metric(key, step_metric="round")
        except Exception as err:  # noqa: BLE001 — wandb's failures come in many types
            self._fail("wandb init", err)

    def log_round(self, metrics: dict) -> None:
        if self.run is not None:
            try:
                self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None})
            except Exception as err:  # noqa: BLE001
                self._fail("wandb log", err)

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None

        def finish() -> None:
            for key in ("status", "rounds_committed", "inner_steps_committed", "final_eval_loss", "wall_s"):
                if key in summary:
                    run.summary[key] = summary[key]
            run.finish()

        try:  # finish syncs wandb's files: a thread of its own, so a hung disk or network cannot hold the run
            call_with_deadline(finish, self.finish_s, "wandb finish")
        except Exception as err:  # noqa: BLE001
            self._fail("wandb finish", err)

    def _fail(self, what: str, err: BaseException) -> None:
        self.run = None
        if self._on_error is not None:
            self._on_error(what, f"{type(err).__name__}: {err}")
