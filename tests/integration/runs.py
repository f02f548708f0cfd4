"""Running the real job (Ray actors, gloo groups) from tests, and reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hsgd.record.rundir import read_jsonl

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "logging.wandb.mode=disabled",
    "logging.progress=false",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "data.batch_size=4",
    "train.eval_batches=2",
]


def train(run_dir: Path | str, overrides: list[str], *, fast: bool = True) -> dict:
    """In-process run of jobs.train (embedded Ray started and stopped inside). Returns summary."""
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    cfg = compose_config((FAST if fast else []) + list(overrides))
    validate(cfg)
    return run_training(cfg, str(run_dir))


def train_cli(
    args: list[str], *, cwd: Path | str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m jobs.train <args>` in a subprocess, as a user would type it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jobs.train", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(run_dir: Path | str) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def events(run_dir: Path | str) -> list[dict]:
    return read_jsonl(Path(run_dir) / "events.jsonl")


def summary(run_dir: Path | str) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


# -- watching a run that goes on in the background ------------------------------------------------
def poll(what: str, timeout_s: float, probe, every_s: float = 0.2):
    """probe() until it returns something truthy; fail saying what never happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def replica_progress(run_dir: Path | str, rid: str) -> dict | None:
    """The replica's own answer on its control channel (answers while a phase runs): committed
    round and step, phase, replica_index and the pid of the process that answers; None while it
    is not up or restarting."""
    import ray

    from actors.roster import replica_actor_name

    info = json.loads((Path(run_dir) / "run.json").read_text())
    try:
        handle = ray.get_actor(replica_actor_name(info["run_id"], rid), namespace=info["namespace"])
        return ray.get(handle.progress.remote(), timeout=10)
    except Exception:  # noqa: BLE001 — not up yet, or restarting: ask again
        return None


def inner_running(run_dir: Path | str, rids, round_index: int, min_step: int) -> dict | None:
    """{rid: progress} once every rid runs round `round_index`'s inner steps at step >= min_step."""
    answers = {rid: replica_progress(run_dir, rid) for rid in rids}
    if all(
        a and a["round"] == round_index and a["phase"] != "idle" and a["step"] >= min_step for a in answers.values()
    ):
        return answers
    return None
