"""A run's start-up, for the driver: start the replica and spare actors in their placement, ask where
they landed, and the start-up calls (checkpoint reach check, resume load). A replica that dies or
cannot be reached during one (a lost node, a `startup` fault) is a replica failure, never a config
error: Ray restarts it and the call is retried until `supervisor.call_timeout_s` since the first
try; one still away then is left out (taken in when back) where its cluster keeps
`supervisor.min_replicas_per_cluster`, else the run fails (exit 1). Only a live replica's answer
(or its own exception) can be a config error (exit 2).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

import ray
from omegaconf import OmegaConf, open_dict
from ray.exceptions import GetTimeoutError, RayActorError

from actors.replica import Replica
from actors.roster import replica_actor_name, spare_actor_name
from hsgd.config import ConfigError
from hsgd.config.auto import recorded
from hsgd.config.layout import RunLayout, ranks_of, sites_and_ranks
from hsgd.core.faults import FaultSpec, due_faults, parse_schedule, topology_shape
from hsgd.core.membership import live_plan
from hsgd.core.site_requests import drained, outcomes
from hsgd.core.topology import Topology, parse_replica_id
from hsgd.record.events import RunLog
from hsgd.record.run_state import RunState
from hsgd.train import checkpoint

RETRY_PAUSE_S = 1.0  # between tries of a start-up call for replicas that died


def resume_takers(cfg, run_dir: str | None, layout: RunLayout | None = None) -> list[str]:
    """The replicas a resume starts that take part: the configured topology's, less those of sites
    drained in `run_dir` (they stay drained: actors/site_changes.py). Only they can load a checkpoint
    for the run (a drained site's replica that loads one is stopped before the first round)."""
    topo, _ = sites_and_ranks(cfg, layout)
    gone = set(drained(outcomes(run_dir))) if run_dir else set()
    return [rid for rid in topo.replica_ids() if topo.cluster_of(rid) not in gone]


def find_resume_point(root: str, cfg, adopt: tuple[str, ...] = ()) -> checkpoint.Choice:
    """train.resume: the newest checkpoint under root that verifies and holds a file of a replica
    that takes part (`resume_takers`, run.dir's drained sites left out): one saved while they were
    down cannot start them, only a fresh model could. ConfigError (one line naming each checkpoint
    tried): none, or its config may not resume. Keys in `adopt` (those the run left auto) take the
    values the checkpoint recorded (hsgd.config.auto.recorded), so a run started under other defaults
    resumes with the ones it trained with."""
    run_dir = OmegaConf.select(cfg, "run.dir", throw_on_resolution_failure=False)
    takers = resume_takers(cfg, run_dir)
    # either format, into any k: a replica cuts a file's whole tensors to its shards, DCP reshards
    point = checkpoint.choose(root, checkpoint.fingerprint(cfg), skip_other_config=False, holders_of=takers)
    if point.path is None:
        tried = "; ".join(f"{path.rstrip('/').rsplit('/', 1)[-1]}: {why}" for path, why in point.skipped)
        why = f"; none usable ({tried})" if tried else ""
        raise ConfigError(
            "train.resume",
            f"no usable checkpoint under {root}{why}; pass run.dir=<the run to resume> (and its checkpoint.dir)",
        )
    saved = recorded(point.manifest or {})
    if adopt and any(key in saved for key in adopt):
        with open_dict(cfg):
            for key in adopt:
                if key in saved:
                    OmegaConf.update(cfg, key, saved[key])
        diff = checkpoint.fingerprint_diff((point.manifest or {}).get("fingerprint"), checkpoint.fingerprint(cfg))
        point = replace(point, config_diff=tuple(diff))
    if point.config_diff:
        raise ConfigError(
            "train.resume",
            f"checkpoint {point.path} was written with another config, "
            f"and a resume may not change {'; '.join(point.config_diff)}",
        )
    return point


def start_replica(
    container: dict,
    name: str,
    options: dict,
    *args,
    index_table: dict,
    lifetime: str | None = None,
    ranks: int | None = None,
):
    """One replica actor (args: rid, run_dir, backends[, spare]); `index_table` keeps each id's data stream.
    `lifetime="detached"`: it outlives its creator (a site added by the supervisor); its other ranks
    (k > 1) are its own actors, with `options` only, so they go with it."""
    k = ranks if ranks is not None else ranks_of(OmegaConf.create(container), None)  # (the run's k)
    return Replica.options(
        name=name,
        max_restarts=container["faults"]["max_restarts"],
        max_task_retries=0,
        **({"lifetime": lifetime} if lifetime else {}),
        **options,
    ).remote(container, *args, index_table=index_table, rank_options=options if k > 1 else None)


def start_replicas(
    cfg, layout: RunLayout, run_id: str, run_dir: str, placement, container: dict, backends: dict
) -> tuple[dict, dict]:
    """The replica actors (rid -> handle) and the hot spares (name -> handle), after them in the bundles."""
    topo, k = layout.topology, layout.ranks_per_replica

    def start(name: str, c: int, i: int, *args):
        return start_replica(
            container, name, placement.options(c, i), *args, index_table=dict(topo.index_table), ranks=k
        )

    replicas = {
        rid: start(replica_actor_name(run_id, rid), *parse_replica_id(rid), rid, run_dir, backends)
        for rid in topo.replica_ids()
    }
    spares = {
        spare_actor_name(run_id, c, k): start(
            spare_actor_name(run_id, c, k), c, topo.size(c) + k, f"c{c}r0", run_dir, backends, True
        )
        for c in range(topo.clusters)
        for k in range(cfg.topology.spares_per_cluster)
    }
    return replicas, spares


def replica_nodes(replicas: dict, timeout_s: float) -> dict:
    """rid -> the Ray node id the replica reports (None: no answer in time; the run goes on)."""
    refs = {rid: handle.progress.remote() for rid, handle in replicas.items()}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    nodes = {}
    for rid, ref in refs.items():
        try:
            nodes[rid] = ray.get(ref, timeout=0.1)["node_id"]
        except Exception:  # noqa: BLE001
            nodes[rid] = None
    return nodes


def check_cluster_first(cfg, layout: RunLayout):
    """What only the cluster knows, checked before any actor starts (ConfigError: one line, exit 2);
    its notices on the console. The backend plan (actors.placement.check_cluster)."""
    from actors.placement import check_cluster

    plan, unanswered = check_cluster(cfg, data_timeout_s=min(30.0, cfg.supervisor.call_timeout_s), layout=layout)
    if plan.notice:
        print(f"[hsgd] {plan.notice}", flush=True)
    if unanswered:
        print(f"[hsgd] warning: data.path not checked on {', '.join(unanswered)} (no answer in time)", flush=True)
    return plan


def run_info(run_id: str, topo: Topology) -> dict:
    """run.json's first content (hsgd/record/run_info.py): how tools find this run's actors."""
    ctx = ray.get_runtime_context()
    return {
        "run_id": run_id,
        "namespace": ctx.namespace,
        "ray_address": ctx.gcs_address,
        "replicas": list(topo.replica_ids()),
        "driver_pid": os.getpid(),
        "started_at": time.time(),
        # Ray turns token auth on by itself only for a cluster it finds on its own, never for an
        # explicit address, so a tool that attaches by the address above (jobs.diagnose) applies this mode
        "auth_mode": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }


def placement_line(nodes: dict, topo: Topology) -> str:
    """Where each cluster's replicas landed, for the console: `c0 on node(s) <ids>; ...`."""
    return "; ".join(
        f"c{c} on node(s) {','.join(sorted({str(nodes[r])[:8] for r in topo.cluster_members(c)}))}"
        for c in range(topo.clusters)
    )


class StartupCalls:
    def __init__(self, topology: Topology, supervisor_cfg):
        self.topology, self.cfg = topology, supervisor_cfg

    def call_all(self, handles: dict, call: Callable, timeout_s: float) -> tuple[dict, dict]:
        """call(key, handle, first_try) -> an ObjectRef, retried for those that died or did not
        answer. Returns (answers, errors: a live replica's own exception) by key. RuntimeError when
        one still away after the retries leaves its cluster below `min_replicas_per_cluster`."""
        answers, errors, pending = {}, {}, dict(handles)
        deadline, first = time.monotonic() + self.cfg.call_timeout_s, True
        while pending:
            refs = {key: call(key, handle, first) for key, handle in pending.items()}
            for key, ref in refs.items():
                try:
                    answers[key] = ray.get(ref, timeout=timeout_s)
                except (RayActorError, GetTimeoutError) as err:  # dead or unreachable: a replica failure
                    print(f"[hsgd] {key} lost during start-up ({type(err).__name__}); retrying it", flush=True)
                    continue
                except Exception as err:  # noqa: BLE001 — the live replica's own error: the caller's to judge
                    errors[key] = err
                pending.pop(key)
            if pending and time.monotonic() < deadline:
                time.sleep(RETRY_PAUSE_S)
            elif pending:
                break
            first = False
        away = set(pending) & set(self.topology.replica_ids())
        for c in range(self.topology.clusters):
            floor = self.topology.min_replicas_of(c, self.cfg.min_replicas_per_cluster)
            if len(set(self.topology.cluster_members(c)) - away) < floor:
                raise RuntimeError(
                    f"start-up: {', '.join(sorted(away))} did not come back within "
                    f"{self.cfg.call_timeout_s:g} s (supervisor.call_timeout_s) and cluster c{c} is "
                    f"below {self.topology.floor_field(c)}={floor}"
                )
        if away:
            print(
                f"[hsgd] starting without {', '.join(sorted(away))} (lost during start-up; taken in when back)",
                flush=True,
            )
        return answers, errors

    def check_reach(self, root: str, run_id: str, handles: dict, faults: dict) -> None:
        """Every replica (and spare) must reach the checkpoint root: the driver writes a nonce there
        and each reads it back, before any training. ConfigError (one line naming the node) otherwise."""
        try:
            url, nonce = checkpoint.write_reach_nonce(root, run_id)
        except Exception as err:  # noqa: BLE001 — any storage error: the driver cannot write there
            raise ConfigError(
                "checkpoint.dir", f"the driver cannot write to {root}: {type(err).__name__}: {err}"
            ) from err
        try:
            answers, errors = self.call_all(
                handles,
                lambda key, h, first: h.reach_checkpoints.remote(url, nonce, faults.get(key) if first else None),
                self.cfg.call_timeout_s,
            )
            problems = [
                f"replica {a['rid']} on node {a['node']} cannot read {url}: {a['problem']}"
                for a in answers.values()
                if a["problem"]
            ]
            problems += [f"{key} failed the check: {one_line(err, typed=False)}" for key, err in errors.items()]
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ConfigError(
                    "checkpoint.dir",
                    f"{problems[0]}{more}; every replica must reach checkpoint.dir "
                    f"(a shared mount or an object store URL)",
                )
        finally:
            checkpoint.remove(url)

    def load_resume_point(self, point: checkpoint.Choice, replicas: dict, faults: dict, ranks: int = 1) -> None:
        """Every replica (of those that take part: `resume_takers`) with a file (or DCP folder) in the
        (verified) checkpoint loads it, in its format, and its params digest must then be the one the
        manifest recorded (`ranks`: the run's k; checkpoint.expected_param_digest). One it lacks (the
        topology grew) starts fresh and heals from a peer; files of replica ids this run lacks stay
        unread. "resumed" is said only once one loaded: ConfigError (one line) when none did, or one's
        load failed or left other params (the run would start from a fresh model)."""
        files, fmt, state_round = point.manifest["files"], point.format, point.manifest["round"]
        loaders = {rid: h for rid, h in replicas.items() if rid in files}
        answers, errors = self.call_all(
            loaders,
            lambda rid, h, first: h.load_checkpoint.remote(
                point.path, files[rid], faults.get(rid) if first else None, fmt
            ),
            self.cfg.phase_timeout_s,
        )
        for err in errors.values():  # a RayTaskError wrapping the live replica's CheckpointError
            raise ConfigError("train.resume", one_line(err, typed=False))
        if not answers:
            why = "were lost during start-up" if loaders else "take part, and it holds no file of any"
            raise ConfigError(
                "train.resume",
                f"no replica loaded {point.path}: {', '.join(sorted(loaders or replicas)) or 'none'} {why}; "
                f"a resume never starts from a fresh model",
            )
        checked = self._check_digests(point.manifest, {rid: loaders[rid] for rid in answers}, ranks)
        absent = sorted(set(replicas) - set(files))
        note = f"; {', '.join(absent)} heal from peers" if absent else ""
        print(f"[hsgd] resumed from {point.path} (round {state_round}){checked}{note}", flush=True)

    def _check_digests(self, manifest: dict, loaded: dict, ranks: int) -> str:
        """Each loaded replica's params digest against the manifest's: ConfigError (one line) on a
        mismatch; returns what the console line says of it ("" when the manifest records none for k)."""
        expected = {rid: checkpoint.expected_param_digest(manifest, rid, ranks) for rid in loaded}
        expected = {rid: digest for rid, digest in expected.items() if digest}
        for rid, digest in sorted(expected.items()):
            got = ray.get(loaded[rid].digests.remote(), timeout=self.cfg.phase_timeout_s)["param"]
            if problem := checkpoint.digest_mismatch(rid, got, digest):
                raise ConfigError("train.resume", f"{problem}; the run is not started from {manifest['round']}")
        if not expected:
            return ""
        return (
            ", params digest "
            + ", ".join(f"{rid} {digest[:12]}" for rid, digest in sorted(expected.items()))
            + " as saved"
        )


def one_line(err: BaseException, *, typed: bool = True) -> str:
    """An exception as one console line (a RayTaskError as the remote exception it wraps)."""
    cause = getattr(err, "cause", None) or err
    text = " ".join(str(cause).split())[:400]
    return f"{type(cause).__name__}: {text}" if typed else text


def startup_faults(cfg, state: RunState, topo: Topology, resume_from) -> dict[str, list[FaultSpec]]:
    """The schedule's `startup` faults due at the round this run starts at: rid -> the faults
    for its start-up call; marked fired in the durable state (the supervisor never fires them)."""
    specs = parse_schedule(list(cfg.faults.schedule), **topology_shape(topo))
    start_round = int(resume_from.manifest["round"]) if resume_from is not None else 0
    armed: dict[str, list[FaultSpec]] = {}
    for d in due_faults(
        specs,
        state.fired,
        round_index=start_round,
        phases=("startup",),
        plan=live_plan(topo, set(topo.replica_ids()), {}, state.epoch),
    ):
        state.fired.append(d.index)
        for rid in d.targets:
            armed.setdefault(rid, []).append(d.spec)  # (its round: start_round)
    return armed


def record_takeovers(run_dir: str, lock, resume_from: checkpoint.Choice | None) -> None:
    """Events (and console lines) for a stale lock taken over and for checkpoints skipped at resume."""
    if lock.taken_over is None and not (resume_from and resume_from.skipped):
        return
    log = RunLog(run_dir)
    try:
        if lock.taken_over is not None:
            log.event(
                "lock_taken_over", previous_run_id=lock.taken_over.get("run_id"), reason=lock.taken_over["reason"]
            )
            print(
                f"[hsgd] took over the stale lock of run {lock.taken_over.get('run_id')} ({lock.taken_over['reason']})",
                flush=True,
            )
        for path, reason in resume_from.skipped if resume_from else ():
            log.event("checkpoint_fallback", path=path, reason=reason)
            print(f"[hsgd] checkpoint {path} skipped: {reason}", flush=True)
    finally:
        log.flush(10.0)
