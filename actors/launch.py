"""The driver library: `jobs.train` is its command line; tests and notebooks call `run_training`
with a config composed and checked before Ray starts (hsgd.config.compose). The driver owns the
replicas, so they outlive a supervisor crash; it re-issues the run call to a restarted supervisor;
whatever breaks once the folder is locked, summary.json is there (or printed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from actors.ray_start import connect_ray
from hsgd.config import ConfigError, output_path
from hsgd.config.compose import attaches_to_cluster, check_embedded_capacity, check_run_folder, compose_config, precheck  # noqa: F401 — the driver's API
from hsgd.config.layout import RunLayout, layout_of
from hsgd.core.supervisor_losses import SupervisorLosses
from hsgd.record.run_end import DRIVER_IO_S, driver_summary, ensure_summary
from hsgd.record.run_info import RUN_INFO, write_run_info
from hsgd.record.run_state import RunState
from hsgd.record.rundir import atomic_write_text, call_with_deadline
from hsgd.record.runlock import RunLock, RunLocked
from hsgd.train import checkpoint


def run_training(cfg: DictConfig, run_dir: str) -> dict:
    """Run one training job to its end; returns summary.json's content. ConfigError (one line) for
    each refusal, before anything is written (a fresh run refuses a checkpoint.dir holding checkpoints).
    The lock (a stale one taken over with train.resume=true) is refreshed until the run ends."""
    from actors.startup import find_resume_point, record_takeovers
    from hsgd.config.auto import resolve as resolve_auto

    run_dir = os.path.abspath(output_path(run_dir))
    cfg.run.dir = run_dir
    resume = bool(cfg.train.resume)
    check_run_folder(run_dir, resume, hydra_wrote=True)
    ckpt_root = checkpoint.root_url(cfg.checkpoint.dir, run_dir)
    layout = layout_of(cfg)  # the run's layout, worked out once (what auto and a resume adopt is no part of it)
    auto_filled = resolve_auto(cfg, layout)  # null = auto: the values this run trains with (hsgd/config/auto.py)
    resume_from = find_resume_point(ckpt_root, cfg, adopt=tuple(auto_filled)) if resume else None
    if auto_filled:  # what null resolved to (or, on a resume, what the checkpoint recorded)
        print("[hsgd] auto: " + ", ".join(f"{k}={OmegaConf.select(cfg, k)}" for k in auto_filled), flush=True)
    fingerprint = checkpoint.fingerprint(cfg)
    if not resume and cfg.checkpoint.every and (held := checkpoint.finalized(ckpt_root)):
        raise ConfigError(
            "checkpoint.dir",
            f"{ckpt_root} already holds checkpoints ({held[-1]}); choose another "
            f"checkpoint.dir or add train.resume=true",
        )
    run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:6]}"
    os.makedirs(run_dir, exist_ok=True)
    lock = RunLock(run_dir, run_id)
    try:
        lock.acquire(takeover=resume)
    except RunLocked as err:
        raise ConfigError("run.dir", str(err)) from err
    try:
        record_takeovers(run_dir, lock, resume_from)
        return _run_owned(cfg, Run(cfg, layout, run_dir, run_id, ckpt_root, fingerprint, resume_from))
    finally:
        lock.release()


@dataclass
class Run:
    """One run in a folder it holds the lock of: what start, drive and finish share."""

    cfg: DictConfig
    layout: RunLayout
    run_dir: str
    run_id: str
    ckpt_root: str
    fingerprint: dict
    resume_from: checkpoint.Choice | None
    started_at: float = field(default_factory=time.time)
    started_ray: bool = False
    info: dict = field(default_factory=dict)  # run.json: how jobs.diagnose and notebooks find this run's actors
    actors: list = field(default_factory=list)
    placement: object = None
    stop_asked: bool = False  # Ctrl-C once: a stop is asked of the supervisor


def _run_owned(cfg: DictConfig, run: Run) -> dict:
    """Start, drive, finish; whatever breaks once the folder is ours, the run ends with a summary."""
    from actors.placement import PlacementTimeout
    from actors.startup import one_line

    os.environ.setdefault("WANDB_MODE", cfg.logging.wandb.mode)
    run.started_ray = connect_ray(cfg, run.layout)
    try:
        supervisor = _start(run)
        return _finish(run, _drive(run, supervisor))
    except ConfigError:
        raise  # a bad value (exit 2): not a run that ended
    except Exception as err:  # noqa: BLE001
        summary = driver_summary(run.run_dir, run.layout, f"{type(err).__name__}: {one_line(err)}")
        ensure_summary(run.run_dir, summary)
        if isinstance(err, PlacementTimeout):
            raise  # jobs.train says what it waited for (exit 1)
        print(f"[hsgd] the run failed with an exception:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        print(f"[hsgd] failed: {summary['reason']}", flush=True)
        return summary
    finally:
        _clean_up(run)


def _start(run: Run):
    """Everything before the supervisor's run call; returns the supervisor's handle."""
    from actors import startup
    from actors.placement import ClusterPlacement
    from actors.supervisor import Supervisor, supervisor_actor_name
    from hsgd.core.site_plan import resume_notice

    cfg, resume_from = run.cfg, run.resume_from
    plan = startup.check_cluster_first(cfg, run.layout)  # before any actor starts: ConfigError (one line, exit 2)
    # the global replica index table: a resume keeps every id's index (hsgd/core/topology.py)
    indices = resume_from.manifest.get("replica_indices") if resume_from is not None else None
    layout = run.layout.with_indices(indices).with_backends(plan)
    topo = layout.topology
    if resume_from is not None and (notice := resume_notice(run.run_dir, topo.clusters)):
        print(f"[hsgd] {notice}", flush=True)  # before any actor starts (issue 45, finding 10)
    run.info = startup.run_info(run.run_id, topo)
    write_run_info(run.run_dir, run.info)  # first: the folder is hsgd's
    atomic_write_text(Path(run.run_dir) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    state = RunState.begin(run.run_dir, run.run_id, run.fingerprint, resumed=resume_from is not None)
    state.replica_indices = dict(topo.index_table)
    calls_at_start = bool(cfg.checkpoint.every or resume_from is not None)
    faults = startup.startup_faults(cfg, state, topo, resume_from) if calls_at_start else {}
    state.write(run.run_dir)
    # raises actors.placement.PlacementTimeout when the resources stay busy (hydra_main: exit 1)
    run.placement = ClusterPlacement(cfg, plan.gpus_per_rank, cfg.supervisor.quorum_wait_s, run.run_id, layout)
    container = OmegaConf.to_container(cfg, resolve=True)
    replicas, spares = startup.start_replicas(
        cfg, layout, run.run_id, run.run_dir, run.placement, container, {"inner": plan.inner, "outer": plan.outer}
    )
    run.actors.extend([*replicas.values(), *spares.values()])
    # started now so its process boots while the replicas do; it sends nothing before run()
    supervisor = Supervisor.options(
        name=supervisor_actor_name(run.run_id), max_restarts=cfg.supervisor.max_restarts, max_task_retries=0, num_cpus=0
    ).remote(
        container,
        run.run_dir,
        run.run_id,
        container,
        resume_round=resume_from.manifest["round"] if resume_from else None,
        layout=layout,
    )
    run.actors.append(supervisor)
    run.info["replica_nodes"] = startup.replica_nodes(replicas, cfg.supervisor.call_timeout_s)
    write_run_info(run.run_dir, run.info)
    print(f"[hsgd] placement: {startup.placement_line(run.info['replica_nodes'], topo)}", flush=True)
    guard = startup.StartupCalls(topo, cfg.supervisor)
    if calls_at_start:
        guard.check_reach(run.ckpt_root, run.run_id, {**replicas, **spares}, {} if resume_from else faults)
    if resume_from is not None:
        taking_part = startup.resume_takers(cfg, run.run_dir, layout)  # (a drained site's replicas load nothing)
        guard.load_resume_point(resume_from, {r: replicas[r] for r in taking_part}, faults, layout.ranks_per_replica)
    return supervisor


def _drive(run: Run, supervisor) -> dict:
    """The supervisor's run call to its summary, re-issued to a restarted supervisor."""
    import ray
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError

    from actors.startup import one_line
    from hsgd.record.console import ProgressView

    cfg = run.cfg
    view = ProgressView(cfg.train.rounds * run.layout.steps_per_round, run.run_dir, enabled=cfg.logging.progress)
    losses = SupervisorLosses(cfg.supervisor.max_restarts, restart_wait_s=cfg.supervisor.call_timeout_s)
    try:
        while True:
            ref = supervisor.run.remote()
            _watch(run, supervisor, view, ref)
            try:
                return ray.get(ref, timeout=60.0)
            except RayActorError as err:
                verdict = losses.on_error(RunState.read(run.run_dir).supervisor_starts, time.monotonic())
                if verdict.gone:
                    return driver_summary(run.run_dir, run.layout, f"{verdict.reason}: {type(err).__name__}")
                if verdict.new_loss:
                    print(
                        f"[hsgd] supervisor lost ({type(err).__name__}); re-issuing the run to its restart", flush=True
                    )
                time.sleep(1.0)
            except Exception as err:  # noqa: BLE001 — RayTaskError (run() raised: it must not), a lost answer
                return driver_summary(run.run_dir, run.layout, f"the supervisor's run call failed: {one_line(err)}")
    finally:
        view.close()


def _watch(run: Run, supervisor, view, ref) -> None:
    """The progress bar while a run call is in flight; Ctrl-C asks for a stop, a second aborts."""
    import ray

    while True:
        try:
            done, _ = ray.wait([ref], timeout=1.0)
        except KeyboardInterrupt:
            if run.stop_asked:
                raise  # a second Ctrl-C: abort now (the caller's finally still cleans up)
            run.stop_asked = True
            print("\n[hsgd] stopping after the round in flight (Ctrl-C again to abort)", flush=True)
            supervisor.request_stop.remote()
            continue
        with contextlib.suppress(Exception):  # supervisor restarting: the view just waits
            view.update(ray.get(supervisor.status.remote(), timeout=5.0))
        if done:
            return


def _finish(run: Run, summary: dict) -> dict:
    """summary.json always there (or on the console), plots (a failure only warns), the last lines."""
    from hsgd.record.plots import write_run_plots

    run_dir = run.run_dir
    ensure_summary(run_dir, summary)
    _best_effort(lambda: write_run_plots(run_dir), 120.0, f"plotting into {run_dir}", "plots")
    figures = [summary.get(k) for k in ("initial_eval_loss", "final_eval_loss", "wall_s")]
    if summary["status"] == "completed" and all(isinstance(x, (int, float)) for x in figures):
        print(
            f"[hsgd] completed: {summary['rounds_committed']} rounds, {summary['inner_steps_committed']} "
            f"inner steps, eval loss {figures[0]:.4f} -> {figures[1]:.4f} in {figures[2]:.1f}s",
            flush=True,
        )
    else:
        print(f"[hsgd] {summary['status']}: {summary.get('reason')}", flush=True)
    print(f"[hsgd] outputs in {run_dir}", flush=True)
    return summary


def _clean_up(run: Run) -> None:
    import ray

    from actors.quarantine import stop_moved
    from actors.site_changes import stop_joined_sites, with_joined_replicas

    if run.info:  # sites added mid-run: their replicas and groups are detached (they outlive a supervisor)
        with contextlib.suppress(Exception):  # best effort, as every stop here
            call_with_deadline(lambda: stop_joined_sites(run.run_dir, run.run_id), DRIVER_IO_S, "stopping added sites")
        with contextlib.suppress(Exception):  # quarantine's re-created replicas: detached too
            call_with_deadline(lambda: stop_moved(run.run_dir, run.run_id), DRIVER_IO_S, "stopping moved replicas")
    for actor in run.actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    if run.placement is not None:
        run.placement.release()
    if run.info:
        run.info["job_s"] = time.time() - run.started_at  # the whole job, Ray start and plots included
        path = Path(run.run_dir) / RUN_INFO

        def write() -> None:  # with the replicas of sites added mid-run, as the supervisor wrote them
            run.info["replicas"] = with_joined_replicas(run.run_dir, run.run_id, run.info["replicas"])
            write_run_info(run.run_dir, run.info)

        _best_effort(write, DRIVER_IO_S, f"writing {path}", str(path))
    if run.started_ray:  # also detaches from a real cluster: a multirun's next job attaches afresh
        ray.shutdown()


def _best_effort(write, deadline_s: float, doing: str, what: str) -> None:
    """A file kept for people and tools (plots, run.json): a failure is a console warning, no more."""
    try:
        call_with_deadline(write, deadline_s, doing)
    except Exception as err:  # noqa: BLE001 — matplotlib's errors and storage's alike
        print(f"[hsgd] warning: {what} not written: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
