"""The Ray Train v2 peer: hsgd's own model trained by `ray.train.torch.TorchTrainer`, done as Ray
Train's docs recommend, so a kill's cost can be compared with hsgd's and torchft's.

What is measured. One fit() of `steps` optimizer steps on N workers, every step padded to
`min_step_s` (a sleep, as hsgd's `train.min_step_s`), with replicas SIGKILLed from outside — at a
step (`kills`) or at a time (`kill_times_s`) — and, per kill, read from the step logs
(benchmarks.peers.common): the survivors' stall, the victim's rejoin, the steps the group lost (the
highest step committed before the kill minus the step it resumed at), and the time until the
victim is back past the step it failed at. `wall_s` is fit()'s wall time.

How. `RAY_TRAIN_V2_ENABLED=1`, `ScalingConfig(num_workers=N, use_gpu=False)`: N worker actors,
one CPU each, in a gloo process group set up by Ray Train. Each worker builds the same model as
hsgd from the same config (`compose_config`, `hsgd.train.task`, seeded with `cfg.seed`), wraps it
with `ray.train.torch.prepare_model` (torch DDP), and runs hsgd's step: the batches of its replica
index (`dataset.batch("train", seed, replica_index=rank, step, micro)`), hsgd's loss, gradient
clipping, AdamW (`build_inner_optimizer`) and learning rate (`inner_lr` over a horizon of `steps`).
After each optimizer step and its padding a worker appends `StepLog(<out>/steps, "r<rank>")
.committed(step)`, `step` counted globally from 1. Every `checkpoint_every` steps every worker
calls `ray.train.report(metrics, checkpoint=...)` — a barrier; rank 0 alone hands over a
checkpoint (model, optimizer state, step), which Ray persists under `<out>/ray_train`.

A reported checkpoint is not yet a restart point: the controller collects each worker's report
from a queue of one at its next poll (every `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, default 2 s) and
registers the checkpoint once it holds every rank's report; a report finding the queue full waits
for that poll (so reports more often than one per poll interval slow training down). A kill before
the poll loses that checkpoint too: the group resumes from the one before it, and a kill loses up
to 2 * checkpoint_every steps, not checkpoint_every - 1. (Once any worker commits step c + K + 1,
every rank's report of c + K went into its queue, so every report of c was collected: checkpoint
c is registered.)

Fault tolerance is Ray Train's own (`FailureConfig(max_failures=...)`): when a worker dies, the
controller (it polls the workers every `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, default 2 s) tears
down the whole worker group — the survivors, blocked in DDP's all-reduce, are killed too — starts
a new one, and every new worker resumes from `ray.train.get_checkpoint()`, redoing the steps after
it. Each (re)start appends `{"rank", "resumed_at", "t", "pid"}` to `<out>/starts/r<rank>.jsonl`.
This runner restarts nothing itself.

What can fail. More kills than `max_failures` (here: the number of kills + 1) or an error in the
training function ends fit() with Ray Train's TrainingFailedError: `result_error` holds it. A kill whose
step is never logged before the deadline is skipped (`kill_errors`). fit() gets `timeout_s`; past
it, `ray.shutdown()` ends the run (and the Ray session of this process, even one it did not start)
and `result_error` says so. A timed kill that falls while the group restarts waits until the group
is back (a step logged after the previous kill), so it always hits a live process; its recorded
time is when it was sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers import common
from hsgd.record.rundir import atomic_write_text

REPO = str(Path(__file__).resolve().parents[2])
STATE_FILE = "state.pt"  # inside each checkpoint directory: model, optimizer state, step


# -- inside each Ray Train worker ------------------------------------------------------------------
def _write_start(folder: str, rank: int, resumed_at: int) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"r{rank}.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "resumed_at": resumed_at, "t": time.time(), "pid": os.getpid()}) + "\n")


def _train_loop(config: dict) -> None:
    """The training function each worker runs (on every (re)start of the worker group)."""
    import ray.train
    import ray.train.torch
    import torch
    from omegaconf import OmegaConf

    from hsgd.core.topology import Topology
    from hsgd.train import task
    from hsgd.train.inner import build_inner_optimizer, inner_lr, optimizer_implementation

    torch.set_num_threads(1)
    cfg = OmegaConf.create(config["cfg"])
    rank = ray.train.get_context().get_world_rank()
    replica_index = Topology(1, config["replicas"]).global_index(f"c0r{rank}")
    steps, every, min_step_s = config["steps"], config["checkpoint_every"], config["min_step_s"]
    dataset = task.build_dataset(cfg)
    torch.manual_seed(cfg.seed)  # hsgd's initial params
    model = task.build_model(cfg, dataset.vocab_size)
    loss_fn = task.build_loss(cfg)
    step, opt_state = 0, None
    checkpoint = ray.train.get_checkpoint()  # the latest reported one after a restart, else None
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, STATE_FILE), weights_only=True)
        model.load_state_dict(state["model"])
        step, opt_state = int(state["step"]), state["optimizer"]
    ddp = ray.train.torch.prepare_model(model)  # DistributedDataParallel over Ray Train's gloo group
    optimizer = build_inner_optimizer(cfg, list(model.parameters()))
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    clip = float(cfg.optim.inner.grad_clip)
    foreach = optimizer_implementation(cfg) != "single"
    grad_accum = int(cfg.data.grad_accum)
    bf16 = cfg.train.precision == "bf16"
    log = common.StepLog(config["steps_dir"], f"r{rank}")
    _write_start(config["starts_dir"], rank, step)
    while step < steps:
        started = time.perf_counter()
        lr = inner_lr(cfg.optim.inner, step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for micro in range(grad_accum):
            batch = dataset.batch("train", seed=cfg.seed, replica_index=replica_index, step=step, micro=micro)
            # DDP all-reduces on the last micro-batch's backward only, as hsgd's ddp does
            sync = ddp.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = loss_fn(ddp, batch)
                (loss / grad_accum).backward()
            total += float(loss.detach()) / grad_accum
        if clip > 0:  # the same math as hsgd's step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        optimizer.step()
        if min_step_s > 0:  # simulated accelerator step time, as hsgd's train.min_step_s
            time.sleep(max(0.0, min_step_s - (time.perf_counter() - started)))
        step += 1
        log.committed(step)
        if step % every == 0 or step == steps:
            metrics = {"step": step, "loss": total}
            if rank == 0:
                with tempfile.TemporaryDirectory() as folder:
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                        os.path.join(folder, STATE_FILE),
                    )
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
            else:
                ray.train.report(metrics, checkpoint=None)  # every worker reports: it is a barrier
    log.close()


# -- the driver -------------------------------------------------------------------------------------
def _config(model: str, replicas: int, steps: int, min_step_s: float, seed: int, overrides: Sequence[str]) -> dict:
    from omegaconf import OmegaConf

    from actors.launch import compose_config

    cfg = compose_config(
        [
            f"model={model}",
            "topology.clusters=1",
            f"topology.replicas_per_cluster={replicas}",
            "sync.inner=ddp",
            f"sync.outer_every={steps}",
            "train.rounds=1",
            f"train.min_step_s={min_step_s}",
            f"seed={seed}",
            "logging.wandb.mode=disabled",
            "checkpoint.every=0",
            *overrides,
        ]
    )
    return OmegaConf.to_container(cfg, resolve=True)


def _killer(
    steps_dir: Path,
    kills: Sequence[tuple[str, int]],
    kill_times_s: Sequence[tuple[float, str]],
    deadline: float,
    stop: threading.Event,
    done: list[common.Kill],
    errors: list[str],
) -> None:
    """Send the kills in order (step kills first, then timed ones), each bounded by `deadline`."""

    def live_row(replica: str, at_step: int) -> dict | None:
        """The replica's newest line once it is at `at_step` or later in a group started after the
        previous kill (so the pid is a live process); None when stopped or past the deadline."""
        after = done[-1].t if done else 0.0
        while not stop.is_set() and time.monotonic() < deadline:
            logs = common.read_steps(steps_dir)
            old = {r["pid"] for rows in logs.values() for r in rows if r["t"] <= after}  # the killed group's
            rows = [r for r in logs.get(replica, []) if r["pid"] not in old]
            if rows and rows[-1] == logs[replica][-1] and rows[-1]["step"] >= at_step:
                return rows[-1]
            stop.wait(0.02)
        return None

    def kill(replica: str, at_step: int, what: str) -> None:
        row = live_row(replica, at_step)
        if row is None:
            if not stop.is_set():
                errors.append(f"{what}: {replica} not at step {at_step} before the deadline")
            return
        try:  # common.kill_at_step finds the line at once and kills its writer
            done.append(common.kill_at_step(steps_dir, replica, row["step"], timeout_s=5.0))
        except (TimeoutError, ProcessLookupError) as err:
            errors.append(f"{what}: {err!r}")

    for replica, at_step in kills:
        kill(replica, at_step, f"kill {replica} at step {at_step}")
    if not kill_times_s:
        return
    t0 = None
    while not stop.is_set() and time.monotonic() < deadline:
        first = [rows[0]["t"] for rows in common.read_steps(steps_dir).values() if rows]
        if first:
            t0 = min(first)
            break
        stop.wait(0.02)
    for at_s, replica in sorted(kill_times_s):
        if t0 is None:
            errors.append(f"kill {replica} at {at_s:g} s: no step was committed before the deadline")
            continue
        wait = t0 + at_s - time.time()
        if wait > 0 and stop.wait(min(wait, max(0.0, deadline - time.monotonic()))):
            return
        kill(replica, 1, f"kill {replica} at {at_s:g} s")


def _kill_figures(steps: dict[str, list[dict]], starts: list[dict], kill: common.Kill) -> dict:
    figures = common.recovery(steps, kill).as_dict()
    before = [r["step"] for rows in steps.values() for r in rows if r["t"] <= kill.t]
    highest = max(before) if before else 0
    restarts = sorted((s for s in starts if s["t"] > kill.t), key=lambda s: s["t"])
    resumed_at = restarts[0]["resumed_at"] if restarts else None
    back = [r["t"] for r in steps.get(kill.replica, []) if r["t"] > kill.t and r["step"] > highest]
    figures.update(
        {
            "t": kill.t,
            "pid": kill.pid,
            "highest_step_before": highest,
            "resumed_at_step": resumed_at,
            "steps_lost": None if resumed_at is None else highest - resumed_at,
            "group_restarted_s": restarts[0]["t"] - kill.t if restarts else None,
            "back_at_failed_step_s": back[0] - kill.t if back else None,
        }
    )
    return figures


def run_raytrain(
    *,
    model: str,
    replicas: int,
    steps: int,
    min_step_s: float,
    out: Path,
    kills: Sequence[tuple[str, int]] = (),
    kill_times_s: Sequence[tuple[float, str]] = (),
    checkpoint_every: int = 10,
    timeout_s: float = 300,
    seed: int = 0,
    overrides: Sequence[str] = (),
) -> dict:
    """Train `steps` steps of hsgd's `model` on `replicas` Ray Train workers, kill as told, and
    return the figures (JSON-able; see the module docstring), also written to <out>/raytrain.json.
    `out` must hold no step logs yet.
    `overrides`: extra hsgd config overrides (to match the hsgd side's config)."""
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    out = Path(out).resolve()
    steps_dir, starts_dir = out / "steps", out / "starts"
    if list(steps_dir.glob("*.jsonl")) or list(starts_dir.glob("*.jsonl")):
        raise ValueError(f"{out} already holds step logs: give each run its own folder")
    out.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # read when ray.train is imported, and propagated to workers
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled

    if not is_v2_enabled():
        raise RuntimeError("Ray Train v2 is off in this process (RAY_TRAIN_V2_ENABLED was 0 at import)")
    config = {
        "cfg": _config(model, replicas, steps, min_step_s, seed, overrides),
        "replicas": replicas,
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "min_step_s": float(min_step_s),
        "steps_dir": str(steps_dir),
        "starts_dir": str(starts_dir),
    }
    pythonpath = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started_ray = not ray.is_initialized()
    if started_ray:  # a fresh local cluster, never another one found on this machine
        ray.init(
            address="local",
            num_cpus=replicas + 1,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": pythonpath},
        )
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=replicas, use_gpu=False),
        run_config=ray.train.RunConfig(
            name=f"hsgd-peer-raytrain-{int(time.time())}",
            storage_path=str(out / "ray_train"),
            failure_config=ray.train.FailureConfig(max_failures=len(kills) + len(kill_times_s) + 1),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            worker_runtime_env={"env_vars": pythonpath},
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        start = time.monotonic()
        try:
            trainer.fit()
            outcome["error"] = None
        except BaseException as err:  # noqa: BLE001 — TrainingFailedError, or Ray shut down on timeout
            outcome["error"] = repr(err)
        outcome["wall_s"] = time.monotonic() - start

    done: list[common.Kill] = []
    kill_errors: list[str] = []
    stop = threading.Event()
    deadline = time.monotonic() + timeout_s
    fitting = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
    killing = threading.Thread(
        target=_killer,
        name="raytrain-kills",
        daemon=True,
        args=(steps_dir, kills, kill_times_s, deadline, stop, done, kill_errors),
    )
    fit_start = time.monotonic()
    timed_out = False
    try:
        fitting.start()
        killing.start()
        fitting.join(timeout=max(0.0, deadline - time.monotonic()))
        timed_out = fitting.is_alive()
        stop.set()
        killing.join(timeout=10)
        if timed_out:  # a hung fit(): ending the Ray session is the only bound left
            ray.shutdown()
            fitting.join(timeout=30)
    finally:
        stop.set()
        if started_ray and ray.is_initialized():
            ray.shutdown()
    steps_seen = common.read_steps(steps_dir)
    starts = [s for rows in common.read_steps(starts_dir).values() for s in rows]
    error = outcome.get("error")
    if timed_out:
        error = f"fit() did not end within {timeout_s:g} s; Ray was shut down" + (f" ({error})" if error else "")
    result = {
        "peer": "ray_train",
        "replicas": replicas,
        "steps": steps,
        "min_step_s": min_step_s,
        "checkpoint_every": checkpoint_every,
        "model": model,
        "seed": seed,
        "wall_s": outcome.get("wall_s", time.monotonic() - fit_start),
        "kills": [{"replica": k.replica, "pid": k.pid, "t": k.t} for k in done],
        "kill_errors": kill_errors,
        "recoveries": [_kill_figures(steps_seen, starts, k) for k in done],
        "step_time_s": common.step_time_s(steps_seen, before_t=done[0].t if done else None),
        "committed_steps": common.committed_steps(steps_seen),
        "last_step": {replica: max((r["step"] for r in rows), default=0) for replica, rows in steps_seen.items()},
        "group_starts": len([s for s in starts if s["rank"] == 0]),
        "result_error": error,
    }
    atomic_write_text(out / "raytrain.json", json.dumps(result, indent=2))
    return result
