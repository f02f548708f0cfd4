"""The driver library: compose the config, attach to or start Ray, place and start the actors,
wait for the run, write the plots. `jobs.train` is its command line; tests and notebooks call
`run_training` directly.

1. Compose and validate the config; a bad value raises `ConfigError` (one line) before Ray starts.
2. Attach to a Ray cluster (RAY_ADDRESS / a job context / ray.address) or start an embedded one.
   Under `ray job submit` relative run folders land under the persistent output root
   (hsgd.config.output_root), not in the job's temporary copy of the working dir.
3. Check the cluster can hold every replica, place each cluster as a unit (actors/placement.py),
   start the replica actors (owned by this driver, so they outlive a supervisor crash) and the
   supervisor, and wait for the run while drawing a progress bar; a dead supervisor is restarted by
   Ray and the run call re-issued.
4. Write plots next to the JSON and print where everything is.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsgd.config import ConfigError, output_path, register_schema, resolve_backend, under_ray_job, validate
from hsgd.config.capacity import (PROCESS_BYTES, STATE_COPIES, embedded_capacity_problem, model_param_count,
                                  usable_memory_bytes)
from hsgd.record.rundir import atomic_write_text, read_json, read_jsonl, write_summary

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _fail_config(message: str) -> None:
    """A bad value found after composing (resume target, topology of a checkpoint)."""
    field, _, problem = message.partition(": ")
    raise ConfigError(field, problem)


def compose_config(overrides: list[str]) -> DictConfig:
    """The resolved config for these overrides, as Hydra would build it (for tests, notebooks and
    the pre-check). Raises Hydra/OmegaConf errors for bad keys or types; does not validate."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    plain = [o for o in overrides if not o.startswith("-") and not o.lstrip("+~").startswith("hydra")]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR),
                               version_base="1.3", job_name="hsgd"):
        cfg = compose(config_name="config", overrides=plain)
    OmegaConf.resolve(cfg)
    return cfg


def describe_hydra_error(err: BaseException) -> str:
    """One line from Hydra/OmegaConf's nested errors: the field and what went wrong."""
    from omegaconf.errors import OmegaConfBaseException

    chain, cause = [], err
    while cause is not None and len(chain) < 5:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            msg = str(getattr(e, "msg", "") or e).split("\n")[0]
            return f"{e.full_key}: {msg}"
    return " ".join(str(err).split())[:400]


def precheck(overrides: list[str]) -> None:
    """Compose and validate the config outside Hydra's runner. Raises ConfigError (one line)."""
    try:
        cfg = compose_config(overrides)
        validate(cfg)
        if not attaches_to_cluster(cfg):
            check_embedded_capacity(cfg)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — Hydra/OmegaConf parse and type errors
        field, _, problem = describe_hydra_error(err).partition(": ")
        raise ConfigError(field, problem) from err


def connect_ray(cfg: DictConfig) -> bool:
    """Returns True if this call connected Ray (and the caller must disconnect when done); a
    caller that already initialised Ray (a test, a notebook) keeps its connection."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address or under_ray_job() or os.environ.get("RAY_JOB_ID") or os.environ.get("RAY_JOB_SUBMISSION_ID"):
        ray.init(address=address or "auto", namespace="hsgd", log_to_driver=True)
        return True
    n = check_embedded_capacity(cfg)
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(n * cfg.topology.cpus_per_replica + 0.999) + 1)
    repo = str(Path(__file__).resolve().parent.parent)
    ray.init(num_cpus=num_cpus, namespace="hsgd", include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    return True


def attaches_to_cluster(cfg) -> bool:
    """True when the run attaches to an existing Ray cluster instead of starting an embedded one."""
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS") or under_ray_job() or os.environ.get("RAY_JOB_ID")
                or os.environ.get("RAY_JOB_SUBMISSION_ID"))


def check_embedded_capacity(cfg) -> int:
    """Raise ConfigError when the embedded cluster cannot hold the topology (replicas and spares);
    returns how many replica actors it will hold."""
    t = cfg.topology
    n = t.clusters * (t.replicas_per_cluster + int(t.get("spares_per_cluster", 0) or 0))
    problem = embedded_capacity_problem(
        replicas=n, cpus_per_replica=t.cpus_per_replica, cores=os.cpu_count() or 1, memory_bytes=_memory_bytes(),
        num_cpus=cfg.ray.num_cpus, per_replica_bytes=PROCESS_BYTES + STATE_COPIES * 4 * model_param_count(
            cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size))
    if problem is not None:
        raise ConfigError("topology.replicas_per_cluster", problem)
    return n


def _memory_bytes() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 2**40  # unknown: do not refuse on memory (a container limit, if any, still counts)
    return usable_memory_bytes(physical)


def supervisor_starts(run_dir: str) -> int:
    """How many supervisor incarnations have started (their durable count; 0 before the first)."""
    try:
        return int(read_json(Path(run_dir) / "supervisor_state.json").get("supervisor_starts", 0))
    except (TypeError, ValueError):
        return 0


@dataclass(frozen=True)
class LossVerdict:
    new_loss: bool  # this error is a supervisor death not counted before
    gone: bool  # give up: restarts exhausted, or the restart did not come back in time
    reason: str = ""


class SupervisorLosses:
    """Counts the supervisor's deaths, not the errors a death causes. One death surfaces as several
    errors: the `run` call in flight fails, and a call re-issued before Ray has noticed the death
    fails too (ActorUnavailableError), on a slow machine several times in a row. So a loss is
    counted once per incarnation (`supervisor_starts` in the supervisor's durable state): an error
    while the incarnation already counted is still the latest one is the same death, seen again.

    Gone: more deaths than `max_restarts` (Ray restarts no more), or no new incarnation within
    `restart_wait_s` of a death (it died before recording its start, or Ray gave up)."""

    def __init__(self, max_restarts: int, *, restart_wait_s: float):
        self.max_restarts, self.restart_wait_s = max_restarts, restart_wait_s
        self.count = 0
        self._counted_start: int | None = None  # the incarnation whose death was counted last
        self._down_since = 0.0

    def on_error(self, starts: int, now: float) -> LossVerdict:
        if starts != self._counted_start:
            self.count, self._counted_start, self._down_since = self.count + 1, starts, now
            if self.count > self.max_restarts:
                return LossVerdict(True, True, f"supervisor lost {self.count} times "
                                   f"(supervisor.max_restarts={self.max_restarts} exhausted)")
            return LossVerdict(True, False)
        if now - self._down_since > self.restart_wait_s:
            return LossVerdict(False, True, f"supervisor did not come back within {self.restart_wait_s:g} s "
                               f"(supervisor.call_timeout_s) of its death {self.count}")
        return LossVerdict(False, False)


def run_training(cfg: DictConfig, run_dir: str) -> dict:
    """Run one training job to its end; returns summary.json's content. A relative run_dir is
    taken as run.dir is (hsgd.config.output_path): under a Ray job, below the persistent root."""
    import ray
    import torch
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from actors.placement import ClusterPlacement, check_capacity
    from actors.replica import Replica
    from actors.roster import replica_actor_name, spare_actor_name
    from actors.supervisor import Supervisor, supervisor_actor_name
    from hsgd.train import checkpoint
    from hsgd.record.plots import write_run_plots
    from hsgd.record.console import ProgressView
    from hsgd.core.topology import Topology

    job_started = time.time()
    run_dir = os.path.abspath(output_path(run_dir))
    cfg.run.dir = run_dir
    os.makedirs(run_dir, exist_ok=True)
    resume_from = None
    if cfg.train.resume:
        resume_from = checkpoint.latest(Path(run_dir) / "checkpoints")
        if resume_from is None:
            _fail_config(f"train.resume: no checkpoint under {run_dir}/checkpoints; pass run.dir=<the run to resume>")
    elif (Path(run_dir) / "summary.json").exists() or (Path(run_dir) / "supervisor_state.json").exists():
        _fail_config(f"run.dir: {run_dir} already holds a run; choose a new run.dir or add train.resume=true")
    backend = resolve_backend(cfg.comm.backend, torch.cuda.is_available())
    os.environ.setdefault("WANDB_MODE", cfg.logging.wandb.mode)
    container = OmegaConf.to_container(cfg, resolve=True)
    
    started_ray = connect_ray(cfg)
    try:
        check_capacity(cfg, backend)
    except ConfigError as err:
        if started_ray:
            ray.shutdown()
        _fail_config(str(err))
    atomic_write_text(Path(run_dir) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if resume_from is not None:
        # a resumed run continues from the checkpoint: the supervisor's old view is stale
        for name in ("supervisor_state.json",):
            state = Path(run_dir) / name
            if state.exists():
                old = json.loads(state.read_text())
                atomic_write_text(state, json.dumps({"epoch": old.get("epoch", 0), "fired": old.get("fired", []),
                                                     "started_at": time.time(),
                                                     "initial_eval_loss": old.get("initial_eval_loss")}))

    run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:6]}"
    topo_ids = [f"c{c}r{i}" for c in range(cfg.topology.clusters) for i in range(cfg.topology.replicas_per_cluster)]
    # how jobs.diagnose and notebooks find this run's actors
    run_info = {"run_id": run_id, "namespace": ray.get_runtime_context().namespace,
                "ray_address": ray.get_runtime_context().gcs_address, "replicas": topo_ids,
                "driver_pid": os.getpid(), "started_at": time.time(),
                # how the cluster authenticates: Ray turns token auth on by itself only for a cluster
                # it finds on its own, never for an explicit address, so a tool that attaches by the
                # address above (jobs.diagnose) applies this mode
                "auth_mode": os.environ.get("RAY_AUTH_MODE", "disabled")}
    atomic_write_text(Path(run_dir) / "run.json", json.dumps(run_info, indent=1))
    placement = None
    actors = []
    try:
        # raises actors.placement.PlacementTimeout when the resources stay busy (hydra_main: exit 1)
        if resume_from is not None:
            # Rounds committed after the checkpoint are redone: drop their metrics lines. Before
            # any actor starts: the supervisor appends to this file from its first moment.
            metrics_path = Path(run_dir) / "metrics.jsonl"
            last = checkpoint.read_manifest(resume_from)["round"]
            kept = [json.dumps(m) for m in read_jsonl(metrics_path) if m.get("round", 0) < last]
            atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))
        placement = ClusterPlacement(cfg, backend, timeout_s=cfg.supervisor.quorum_wait_s)
        topo = Topology(cfg.topology.clusters, cfg.topology.replicas_per_cluster)
        replicas = {}
        for rid in topo.replica_ids():
            c, i = divmod(topo.global_index(rid), cfg.topology.replicas_per_cluster)
            replicas[rid] = Replica.options(name=replica_actor_name(run_id, rid), max_restarts=cfg.faults.max_restarts,
                                            max_task_retries=0, **placement.options(c, i)).remote(container, rid, run_dir, backend)
        actors.extend(replicas.values())
        # hot spares: warmed replicas that take over a dead replica's identity (bundles after the replicas)
        for c in range(cfg.topology.clusters):
            for k in range(int(cfg.topology.get("spares_per_cluster", 0) or 0)):
                actors.append(Replica.options(name=spare_actor_name(run_id, c, k), max_restarts=cfg.faults.max_restarts,
                                              max_task_retries=0,
                                              **placement.options(c, cfg.topology.replicas_per_cluster + k)).remote(
                    container, f"c{c}r0", run_dir, backend, True))
        # Started now so its process boots while the replicas do; it sends nothing before run().
        supervisor = Supervisor.options(name=supervisor_actor_name(run_id), max_restarts=cfg.supervisor.max_restarts,
                                        max_task_retries=0, num_cpus=0).remote(container, run_dir, run_id, container)
        actors.append(supervisor)
        # where each replica landed, as the replica itself reports it (its runtime context)
        run_info["replica_nodes"] = _replica_nodes(replicas, cfg.supervisor.call_timeout_s)
        atomic_write_text(Path(run_dir) / "run.json", json.dumps(run_info, indent=1))
        print("[hsgd] placement: " + "; ".join(
            f"c{c} on node(s) {','.join(sorted({str(n)[:8] for r, n in run_info['replica_nodes'].items() if r.startswith(f'c{c}r')}))}"
            for c in range(cfg.topology.clusters)), flush=True)
        if resume_from is not None:
            manifest = checkpoint.read_manifest(resume_from)
            if manifest["topology"] != [cfg.topology.clusters, cfg.topology.replicas_per_cluster]:
                _fail_config(f"train.resume: checkpoint {resume_from} is for topology {manifest['topology']}, "
                              f"not [{cfg.topology.clusters}, {cfg.topology.replicas_per_cluster}]")
            ray.get([replicas[rid].load_checkpoint.remote(str(resume_from), sha)
                     for rid, sha in manifest["files"].items() if rid in replicas],
                    timeout=cfg.supervisor.phase_timeout_s)
            print(f"[hsgd] resumed from {resume_from} (round {manifest['round']})", flush=True)
        view = ProgressView(cfg, run_dir, enabled=cfg.logging.progress)
        summary, stop_asked = None, False
        losses = SupervisorLosses(cfg.supervisor.max_restarts, restart_wait_s=cfg.supervisor.call_timeout_s)
        while summary is None:
            ref = supervisor.run.remote()
            while True:
                try:
                    done, _ = ray.wait([ref], timeout=1.0)
                except KeyboardInterrupt:
                    if stop_asked:
                        raise  # a second Ctrl-C: abort now (the finally below still cleans up)
                    stop_asked = True
                    print("\n[hsgd] stopping after the round in flight (Ctrl-C again to abort)", flush=True)
                    supervisor.request_stop.remote()
                    continue
                try:
                    view.update(ray.get(supervisor.status.remote(), timeout=5.0))
                except Exception:  # noqa: BLE001 — supervisor restarting: the view just waits
                    pass
                if done:
                    break
            try:
                summary = ray.get(ref, timeout=60.0)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as err:
                verdict = losses.on_error(supervisor_starts(run_dir), time.monotonic())
                if verdict.gone:
                    summary = _supervisor_gone_summary(run_dir, verdict.reason, err)
                    break
                if verdict.new_loss:
                    print(f"[hsgd] supervisor lost ({type(err).__name__}); re-issuing the run to its restart", flush=True)
                time.sleep(1.0)
        view.close()
        write_run_plots(run_dir)
        if summary["status"] == "completed":
            print(f"[hsgd] completed: {summary['rounds_committed']} rounds, {summary['inner_steps_committed']} "
                  f"inner steps, eval loss {summary['initial_eval_loss']:.4f} -> {summary['final_eval_loss']:.4f} "
                  f"in {summary['wall_s']:.1f}s", flush=True)
        else:
            print(f"[hsgd] {summary['status']}: {summary.get('reason')}", flush=True)
        print(f"[hsgd] outputs in {run_dir}", flush=True)
        return summary
    finally:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if placement is not None:
            placement.release()
        run_info["job_s"] = time.time() - job_started  # the whole job, Ray start and plots included
        atomic_write_text(Path(run_dir) / "run.json", json.dumps(run_info, indent=1))
        if started_ray:  # also detaches from a real cluster: a multirun's next job attaches afresh
            ray.shutdown()


def _replica_nodes(replicas: dict, timeout_s: float) -> dict:
    """replica id -> the Ray node id the replica reports from its own runtime context (None if it
    did not answer in time: a replica still starting or already dead; the run goes on)."""
    import ray

    refs = {rid: handle.progress.remote() for rid, handle in replicas.items()}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    nodes = {}
    for rid, ref in refs.items():
        try:
            nodes[rid] = ray.get(ref, timeout=0.1)["node_id"]
        except Exception:  # noqa: BLE001
            nodes[rid] = None
    return nodes


def _supervisor_gone_summary(run_dir: str, reason: str, err: BaseException) -> dict:
    """The supervisor died more often than it may restart, or did not come back: end the run as
    failed, keep the files."""
    summary = {"status": "failed", "reason": f"{reason}: {type(err).__name__}", "rounds_committed": None,
               "inner_steps_committed": None, "initial_eval_loss": None, "final_eval_loss": None, "wall_s": None,
               "replica_param_digests": {}, "global_param_digest": None, "run_dir": run_dir}
    write_summary(run_dir, summary)
    return summary
