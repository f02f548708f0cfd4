"""Train: `python -m jobs.train [hydra overrides]` (or under `ray job submit`; docs/operations.md, "Sweeps" for `-m`).

A bad value prints one line and exits 2 before Ray starts (hsgd.config.compose.precheck; for a
multirun: every job's, before the first starts); a failed run exits 1.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from actors.launch import run_training
from hsgd.config import ConfigError, register_schema, validate
from hsgd.config.compose import describe_hydra_error, precheck

register_schema()
_SWEEP = {"dir": None, "failed": []}  # a multirun's folder and its failed jobs' run dirs


def _config_error(message: str) -> None:
    print(f"hsgd: config error: {message}", file=sys.stderr)
    sys.exit(2)  # a config error: before Ray starts


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from actors.placement import PlacementTimeout

    try:
        validate(cfg)
    except ConfigError as err:
        _config_error(str(err))
    hydra_cfg = HydraConfig.get()
    run_dir = os.path.abspath(hydra_cfg.runtime.output_dir)
    # one job of a sweep: a failed run must not stop the jobs after it (sys.exit would)
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    if sweep:
        _SWEEP["dir"] = os.path.abspath(str(hydra_cfg.sweep.dir))
        print(f"[hsgd] sweep job {hydra_cfg.job.num}: {' '.join(hydra_cfg.overrides.task)}", flush=True)
    summary = None
    try:
        summary = run_training(cfg, run_dir)
    except ConfigError as err:
        _config_error(str(err))
    except PlacementTimeout as err:
        print(f"hsgd: placement error: {err}", file=sys.stderr, flush=True)
        if not sweep:
            sys.exit(1)
        summary = {"status": "failed", "reason": f"placement: {err}"}
    finally:
        if sweep:
            from jobs.sweep import write_sweep_table

            if summary is None or summary["status"] == "failed":
                _SWEEP["failed"].append(run_dir)
            write_sweep_table(_SWEEP["dir"])
    if summary["status"] == "failed":
        print(f"[hsgd] run failed: {summary.get('reason')}", file=sys.stderr, flush=True)
        if not sweep:
            sys.exit(1)
        return None
    return summary.get("final_eval_loss")


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """The override lists of a multirun's jobs, as Hydra's basic sweeper expands them; None when
    another sweeper is chosen (it expands them itself)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(o.lstrip("+~").startswith("hydra/sweeper") for o in overrides):
        return None
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if o not in ("-m", "--multirun")])
    return [job for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]


def main() -> None:
    argv = sys.argv[1:]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not any(a.startswith("--") and a != "--multirun" for a in argv):
        try:
            jobs = (sweep_jobs(argv) or []) if multirun else [argv]
        except Exception as err:  # noqa: BLE001 — a malformed sweep override
            _config_error(describe_hydra_error(err))
        try:
            for job in jobs:
                precheck(job, run_folder=not multirun)  # a single run's folder too: before Hydra writes into it
        except ConfigError as err:
            _config_error(str(err))
    hydra_main()
    if multirun and _SWEEP["dir"] is not None:
        from jobs.sweep import markdown_table, sweep_rows

        print(f"[hsgd] sweep table ({_SWEEP['dir']}/sweep.csv, sweep.md):", flush=True)
        print(markdown_table(sweep_rows(_SWEEP["dir"])), end="", flush=True)
    if _SWEEP["failed"]:
        print(
            f"[hsgd] {len(_SWEEP['failed'])} sweep job(s) failed: {' '.join(_SWEEP['failed'])}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
