"""The driver library: compose the config, attach to or start Ray, place and start the actors,
wait for the run, write the plots. `jobs.train` is its command line; tests and notebooks call
`run_training` directly.

1. Compose and validate the config; a bad value raises `ConfigError` (one line) before Ray starts.
2. Attach to a Ray cluster (RAY_ADDRESS / a job context / ray.address) or start an embedded one.
   Under `ray job submit` relative run folders land under the persistent output root
   (hsgd.config.output_root), not in the job's temporary copy of the working dir.
3. Check what only the cluster knows (per-level backends and GPUs per replica from the cluster's
   resources, not this machine's CUDA; room for every replica; data.path on every node that may
   run replicas), place each cluster as a unit (actors/placement.py),
   start the replica actors (owned by this driver, so they outlive a supervisor crash) and the
   supervisor, and wait for the run while drawing a progress bar; a dead supervisor is restarted by
   Ray and the run call re-issued.
4. Write plots next to the JSON and print where everything is.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsgd.config import NUMERIC_FIELDS, ConfigError, output_path, register_schema, under_ray_job, validate
from hsgd.config.capacity import (PROCESS_BYTES, STATE_COPIES, embedded_capacity_problem, model_param_count,
                                  usable_memory_bytes)
from hsgd.record.rundir import atomic_write_text, call_with_deadline, read_json, read_jsonl, write_summary
from hsgd.config.rounds import steps_per_round

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


def precheck(overrides: list[str], *, run_folder: bool = False) -> None:
    """Compose and validate the config outside Hydra's runner, before Ray starts: the config's
    types (OmegaConf), every rule of hsgd.config.validate (numbers, choices, folders, factories,
    credentials, the corpus test-loaded) and the embedded cluster's capacity. Raises ConfigError
    (one line, '<field>: <problem>; valid: ...'); jobs.train exits 2 on it. `run_folder` (a single
    run): also check_run_folder, before Hydra writes its `.hydra/` into the folder."""
    try:
        cfg = compose_config(overrides)
        validate(cfg)
        if not attaches_to_cluster(cfg):
            check_embedded_capacity(cfg)
        if run_folder:
            check_run_folder(os.path.abspath(output_path(cfg.run.dir)), bool(cfg.train.resume))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — Hydra/OmegaConf parse and type errors
        field, _, problem = describe_hydra_error(err).partition(": ")
        if field in NUMERIC_FIELDS and "valid:" not in problem:  # e.g. seed=1e23: "could not be converted to Integer"
            problem += f"; valid: {NUMERIC_FIELDS[field].describe()}"
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

    Gone: more deaths than `max_restarts` (Ray restarts no more; -1 restarts forever, as Ray means
    it), or no new incarnation within `restart_wait_s` of a death (it died before recording its
    start, or Ray gave up)."""

    def __init__(self, max_restarts: int, *, restart_wait_s: float):
        self.max_restarts, self.restart_wait_s = max_restarts, restart_wait_s
        self.count = 0
        self._counted_start: int | None = None  # the incarnation whose death was counted last
        self._down_since = 0.0

    def on_error(self, starts: int, now: float) -> LossVerdict:
        if starts != self._counted_start:
            self.count, self._counted_start, self._down_since = self.count + 1, starts, now
            if self.max_restarts != -1 and self.count > self.max_restarts:
                return LossVerdict(True, True, f"supervisor lost {self.count} times "
                                   f"(supervisor.max_restarts={self.max_restarts} exhausted)")
            return LossVerdict(True, False)
        if now - self._down_since > self.restart_wait_s:
            return LossVerdict(False, True, f"supervisor did not come back within {self.restart_wait_s:g} s "
                               f"(supervisor.call_timeout_s) of its death {self.count}")
        return LossVerdict(False, False)


HYDRA_ENTRIES = (".hydra",)  # what Hydra writes into the run folder before run_training starts (and *.log)
HSGD_MARKS = ("run.json", "config.yaml", "checkpoints", "hsgd.lock")  # any of them: an hsgd run's folder


def check_run_folder(run_dir: str, resume: bool, *, hydra_wrote: bool = False) -> None:
    """Raise ConfigError (one line; nothing is written) when this run may not use run_dir:
    - it exists and is not a folder, or is a non-empty folder that is not an hsgd run (none of
      HSGD_MARKS: run.json, config.yaml, checkpoints/, hsgd.lock): someone else's files, never
      written into;
    - another run holds its lock (hsgd.record.runlock), or a stale lock without train.resume;
    - it holds a run (summary.json / supervisor_state.json) and train.resume is not set.
    `hydra_wrote`: Hydra's own `.hydra/` and `*.log` in the folder do not make it foreign (the job
    created them a moment ago). Read-only: jobs.train calls it before Hydra writes anything, and
    run_training again before it takes the lock (the authority)."""
    from hsgd.record import runlock

    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        _fail_config(f"run.dir: {run_dir} exists and is not a folder; choose a new run.dir")
    entries = sorted(os.listdir(p)) if p.is_dir() else []
    if hydra_wrote:
        entries = [e for e in entries if e not in HYDRA_ENTRIES and not e.endswith(".log")]
    if entries and not set(HSGD_MARKS) & set(entries):
        _fail_config(f"run.dir: {run_dir} is not empty and is not an hsgd run folder (no {', '.join(HSGD_MARKS)}; "
                     f"it holds {', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); "
                     f"choose a new or empty folder")
    try:
        runlock.check(run_dir, takeover=resume)
    except runlock.RunLocked as err:
        _fail_config(f"run.dir: {err}")
    if not resume and {"summary.json", "supervisor_state.json"} & set(entries):
        _fail_config(f"run.dir: {run_dir} already holds a run; choose a new run.dir or add train.resume=true")


@dataclass(frozen=True)
class ResumePoint:
    path: str  # the checkpoint directory (URL) resumed from
    manifest: dict
    skipped: tuple  # (directory, reason) of newer checkpoints that did not verify


def find_resume_point(root: str, fingerprint: dict) -> ResumePoint:
    """train.resume: the newest checkpoint under root that verifies (manifest readable, every
    file's sha256 matches), falling back past corrupt or truncated ones; ConfigError (one line)
    when there is none, or when it was written with a config a resume may not change."""
    from hsgd.train import checkpoint

    skipped: list[tuple[str, str]] = []
    found = checkpoint.newest_good(root, on_skip=lambda d, reason: skipped.append((d, reason)))
    if found is None:
        why = f"; none verifies: {skipped[0][1]}" if skipped else ""
        _fail_config(f"train.resume: no usable checkpoint under {root}{why}; pass run.dir=<the run to resume> "
                     f"(and its checkpoint.dir)")
    path, manifest = found
    diff = checkpoint.fingerprint_diff(manifest.get("fingerprint"), fingerprint)
    if diff:
        _fail_config(f"train.resume: checkpoint {path} was written with another config, and a resume may not change "
                     f"{'; '.join(diff)}")
    return ResumePoint(path, manifest, tuple(skipped))


def run_training(cfg: DictConfig, run_dir: str) -> dict:
    """Run one training job to its end; returns summary.json's content. A relative run_dir is
    taken as run.dir is (hsgd.config.output_path): under a Ray job, below the persistent root.

    Before anything is written: the folder is checked (check_run_folder), on resume the checkpoint
    is chosen and its config fingerprint compared (find_resume_point), and a fresh run refuses a
    checkpoint.dir that already holds checkpoints. Then the run takes the folder's lock
    (hsgd.record.runlock; a stale one is taken over with train.resume=true), refreshed by a
    driver thread until the run ends, when it is removed. Raises ConfigError (one line) for each
    refusal."""
    from hsgd.record.runlock import RunLock, RunLocked
    from hsgd.train import checkpoint

    run_dir = os.path.abspath(output_path(run_dir))
    cfg.run.dir = run_dir
    resume = bool(cfg.train.resume)
    check_run_folder(run_dir, resume, hydra_wrote=True)
    ckpt_root = checkpoint.root_url(cfg.checkpoint.dir, run_dir)
    fingerprint = checkpoint.fingerprint(cfg)
    resume_from = find_resume_point(ckpt_root, fingerprint) if resume else None
    if not resume and cfg.checkpoint.every and (held := checkpoint.latest(ckpt_root)) is not None:
        _fail_config(f"checkpoint.dir: {ckpt_root} already holds checkpoints ({held}); choose another "
                     f"checkpoint.dir or add train.resume=true")
    run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:6]}"
    os.makedirs(run_dir, exist_ok=True)
    lock = RunLock(run_dir, run_id)
    try:
        lock.acquire(takeover=resume)
    except RunLocked as err:
        _fail_config(f"run.dir: {err}")
    try:
        _record_takeovers(run_dir, lock, resume_from)
        return _run_owned(cfg, run_dir, run_id, ckpt_root, fingerprint, resume_from)
    finally:
        lock.release()


def _record_takeovers(run_dir: str, lock, resume_from: ResumePoint | None) -> None:
    """Events (and console lines) for a stale lock taken over and for checkpoints skipped at resume."""
    from hsgd.record.events import RunLog

    if lock.taken_over is None and not (resume_from and resume_from.skipped):
        return
    log = RunLog(run_dir)
    try:
        if lock.taken_over is not None:
            log.event("lock_taken_over", previous_run_id=lock.taken_over.get("run_id"),
                      reason=lock.taken_over["reason"])
            print(f"[hsgd] took over the stale lock of run {lock.taken_over.get('run_id')} "
                  f"({lock.taken_over['reason']})", flush=True)
        for path, reason in (resume_from.skipped if resume_from else ()):
            log.event("checkpoint_fallback", path=path, reason=reason)
            print(f"[hsgd] checkpoint {path} skipped: {reason}", flush=True)
    finally:
        log.close()


def _run_owned(cfg: DictConfig, run_dir: str, run_id: str, ckpt_root: str, fingerprint: dict,
               resume_from: ResumePoint | None) -> dict:
    """run_training's body, in a folder this run holds the lock of."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from actors.placement import (ClusterPlacement, PlacementTimeout, check_capacity, check_data_path,
                                  plan_backends)
    from actors.replica import Replica
    from actors.roster import replica_actor_name, spare_actor_name
    from actors.supervisor import Supervisor, supervisor_actor_name
    from hsgd.record.plots import write_run_plots
    from hsgd.record.console import ProgressView
    from hsgd.core.topology import Topology

    job_started = time.time()
    os.environ.setdefault("WANDB_MODE", cfg.logging.wandb.mode)
    container = OmegaConf.to_container(cfg, resolve=True)
    
    started_ray = connect_ray(cfg)
    try:  # what only the cluster knows, before any actor starts: one line, exit 2
        plan = plan_backends(cfg)  # per-level backends, GPUs per replica: from the cluster, not this machine
        check_capacity(cfg, plan.gpus_per_replica)
        unanswered = check_data_path(cfg, plan.gpus_per_replica, timeout_s=min(30.0, cfg.supervisor.call_timeout_s))
    except ConfigError as err:
        if started_ray:
            ray.shutdown()
        _fail_config(str(err))
    if plan.notice:
        print(f"[hsgd] {plan.notice}", flush=True)
    if unanswered:
        print(f"[hsgd] warning: data.path not checked on {', '.join(unanswered)} (no answer in time)", flush=True)
    backends = {"inner": plan.inner, "outer": plan.outer}  # `auto` left here is resolved in each replica
    atomic_write_text(Path(run_dir) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    _write_durable_start(run_dir, run_id, fingerprint, resume_from)
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
            last = resume_from.manifest["round"]
            kept = [json.dumps(m) for m in read_jsonl(metrics_path) if m.get("round", 0) < last]
            atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))
        placement = ClusterPlacement(cfg, plan.gpus_per_replica, timeout_s=cfg.supervisor.quorum_wait_s)
        topo = Topology(cfg.topology.clusters, cfg.topology.replicas_per_cluster)
        replicas = {}
        for rid in topo.replica_ids():
            c, i = divmod(topo.global_index(rid), cfg.topology.replicas_per_cluster)
            replicas[rid] = Replica.options(name=replica_actor_name(run_id, rid), max_restarts=cfg.faults.max_restarts,
                                            max_task_retries=0, **placement.options(c, i)).remote(container, rid, run_dir, backends)
        actors.extend(replicas.values())
        # hot spares: warmed replicas that take over a dead replica's identity (bundles after the replicas)
        for c in range(cfg.topology.clusters):
            for k in range(int(cfg.topology.get("spares_per_cluster", 0) or 0)):
                actors.append(Replica.options(name=spare_actor_name(run_id, c, k), max_restarts=cfg.faults.max_restarts,
                                              max_task_retries=0,
                                              **placement.options(c, cfg.topology.replicas_per_cluster + k)).remote(
                    container, f"c{c}r0", run_dir, backends, True))
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
        if cfg.checkpoint.every or resume_from is not None:
            _check_checkpoint_reach(ckpt_root, run_id, [a for a in actors if a is not supervisor],
                                    cfg.supervisor.call_timeout_s)
        if resume_from is not None:
            _load_resume_point(resume_from, replicas, cfg.supervisor.phase_timeout_s)
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
                    summary = _driver_summary(run_dir, cfg, f"{verdict.reason}: {type(err).__name__}")
                    break
                if verdict.new_loss:
                    print(f"[hsgd] supervisor lost ({type(err).__name__}); re-issuing the run to its restart", flush=True)
                time.sleep(1.0)
            except Exception as err:  # noqa: BLE001 — RayTaskError (run() raised: it must not), a lost answer
                summary = _driver_summary(run_dir, cfg, f"the supervisor's run call failed: {_one_line(err)}")
        view.close()
        _ensure_summary(run_dir, summary)
        _report_end(run_dir, summary, write_run_plots)
        return summary
    except ConfigError:
        raise  # a bad value (exit 2): not a run that ended
    except Exception as err:  # noqa: BLE001 — whatever broke once the folder is ours, the run ends with a summary
        summary = _driver_summary(run_dir, cfg, f"{type(err).__name__}: {_one_line(err)}")
        _ensure_summary(run_dir, summary)
        if isinstance(err, PlacementTimeout):
            raise  # jobs.train says what it waited for (exit 1)
        print(f"[hsgd] the run failed with an exception:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        print(f"[hsgd] failed: {summary['reason']}", flush=True)
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
        _write_quietly(Path(run_dir) / "run.json", json.dumps(run_info, indent=1))
        if started_ray:  # also detaches from a real cluster: a multirun's next job attaches afresh
            ray.shutdown()


def _write_durable_start(run_dir: str, run_id: str, fingerprint: dict, resume_from: ResumePoint | None) -> None:
    """supervisor_state.json before the supervisor starts: this run's id (a supervisor never loads
    durable state of another run id) and config fingerprint (every manifest carries it). A resumed
    run keeps the old state's epoch, fired faults and initial eval loss; its view of replicas is stale."""
    path = Path(run_dir) / "supervisor_state.json"
    state = {"run_id": run_id, "fingerprint": fingerprint, "started_at": time.time()}
    if resume_from is not None:
        old = read_json(path)
        state.update({k: old[k] for k in ("epoch", "fired", "initial_eval_loss") if k in old})
    atomic_write_text(path, json.dumps(state, indent=1))


def _check_checkpoint_reach(root: str, run_id: str, handles: list, timeout_s: float) -> None:
    """Every replica (and spare) must reach the checkpoint root: the driver writes a nonce there and
    each reads it back, before any training. ConfigError (one line naming the node) otherwise."""
    import ray

    from hsgd.train import checkpoint

    try:
        url, nonce = checkpoint.write_reach_nonce(root, run_id)
    except Exception as err:  # noqa: BLE001 — any storage error: the driver cannot write there
        _fail_config(f"checkpoint.dir: the driver cannot write to {root}: {type(err).__name__}: {err}")
    try:
        refs = [h.reach_checkpoints.remote(url, nonce) for h in handles]
        problems = []
        for ref in refs:
            try:
                answer = ray.get(ref, timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 — a replica that cannot even answer
                problems.append(f"a replica did not answer the check ({type(err).__name__})")
                continue
            if answer["problem"]:
                problems.append(f"replica {answer['rid']} on node {answer['node']} cannot read {url}: "
                                f"{answer['problem']}")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            _fail_config(f"checkpoint.dir: {problems[0]}{more}; every replica must reach checkpoint.dir "
                         f"(a shared mount or an object store URL)")
    finally:
        checkpoint.remove(url)


def _load_resume_point(point: ResumePoint, replicas: dict, timeout_s: float) -> None:
    """Every replica with a file in the checkpoint loads it (files already verified). A replica id
    the checkpoint lacks (the topology grew) starts fresh and heals from a peer like a restarted
    replica; files of replica ids this run lacks are not loaded."""
    import ray

    files = point.manifest["files"]
    refs = [replicas[rid].load_checkpoint.remote(point.path, sha) for rid, sha in files.items() if rid in replicas]
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 — RayTaskError wrapping the replica's CheckpointError
            cause = getattr(err, "cause", None) or err
            _fail_config(f"train.resume: {' '.join(str(cause).split())[:400]}")
    absent = sorted(set(replicas) - set(files))
    note = f"; {', '.join(absent)} heal from peers" if absent else ""
    print(f"[hsgd] resumed from {point.path} (round {point.manifest['round']}){note}", flush=True)


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


DRIVER_IO_S = 10.0  # the driver's wait for one read or write of the run folder at the run's end


def _one_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err  # a RayTaskError names the remote exception as its cause
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:400]}"


def _driver_summary(run_dir: str, cfg, reason: str) -> dict:
    """The run failed and the supervisor could not say so itself (it is gone, or its run call
    raised): summary.json from what the driver can still read — the durable state, metrics.jsonl —
    with the same keys as the supervisor's (hsgd.record.metrics.fallback_summary)."""
    from hsgd.record.metrics import fallback_summary

    def read() -> tuple[dict, list[dict]]:
        return read_json(Path(run_dir) / "supervisor_state.json"), read_jsonl(Path(run_dir) / "metrics.jsonl")

    try:
        durable, metrics = call_with_deadline(read, DRIVER_IO_S, f"reading {run_dir}")
    except Exception:  # noqa: BLE001 — the folder itself is gone or hung: what is known is the reason
        durable, metrics = {}, []
    return fallback_summary(status="failed", reason=reason, durable=durable, metrics=metrics,
                            steps_per_round=steps_per_round(cfg), now=time.time(), run_dir=run_dir)


def _ensure_summary(run_dir: str, summary: dict) -> None:
    """summary.json holds `summary` when this returns, or the summary is printed on the console as
    one JSON line (after a line saying why): a run never ends without its summary."""
    text = json.dumps(summary, indent=2, sort_keys=True, default=str)
    path = Path(run_dir) / "summary.json"
    try:
        if call_with_deadline(lambda: path.read_text(encoding="utf-8"), DRIVER_IO_S, f"reading {path}") == text:
            return  # the supervisor wrote it
    except Exception:  # noqa: BLE001 — absent, unreadable, hung: write it
        pass
    try:
        call_with_deadline(lambda: write_summary(run_dir, summary), DRIVER_IO_S, f"writing {path}")
    except Exception as err:  # noqa: BLE001 — OSError, TimeoutError, or a summary json cannot hold
        print(f"[hsgd] summary.json could not be written to {run_dir} ({type(err).__name__}: {err}); "
              f"the summary follows as one JSON line:", flush=True)
        print(json.dumps(summary, sort_keys=True, default=str), flush=True)


def _write_quietly(path: Path, text: str) -> None:
    """A file the run keeps for tools (run.json): a failure to write it is a console line, no more."""
    try:
        call_with_deadline(lambda: atomic_write_text(path, text), DRIVER_IO_S, f"writing {path}")
    except Exception as err:  # noqa: BLE001
        print(f"[hsgd] warning: {path} not written: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


def _report_end(run_dir: str, summary: dict, write_run_plots) -> None:
    """Plots (a failure is a warning: the record is what counts) and the console's last lines."""
    try:
        call_with_deadline(lambda: write_run_plots(run_dir), 120.0, f"plotting into {run_dir}")
    except Exception as err:  # noqa: BLE001 — matplotlib's errors and storage's alike
        print(f"[hsgd] warning: plots not written: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    figures = [summary.get(k) for k in ("initial_eval_loss", "final_eval_loss", "wall_s")]
    if summary["status"] == "completed" and all(isinstance(x, (int, float)) for x in figures):
        print(f"[hsgd] completed: {summary['rounds_committed']} rounds, {summary['inner_steps_committed']} "
              f"inner steps, eval loss {figures[0]:.4f} -> {figures[1]:.4f} in {figures[2]:.1f}s", flush=True)
    else:
        print(f"[hsgd] {summary['status']}: {summary.get('reason')}", flush=True)
    print(f"[hsgd] outputs in {run_dir}", flush=True)
