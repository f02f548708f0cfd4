"""Supervisor actor: carries out hsgd.core.round.RoundMachine's actions. It decides nothing itself
(read hsgd/core/round.py for what happens after any failure); it only

    calls replicas for each action, turns their answers (or Ray's errors) into PhaseResults,
    asks replicas in an inner phase for their step every second (progress answers on the control
    channel while a phase runs), ticks the machine's clock, kills whom the machine says is hung
    (after dumping every stack of its group), and between rounds: records metrics, evaluates,
    checkpoints, restores the latest checkpoint after a total loss, and waits for quorum.

It never moves model-sized tensors itself (heals go replica -> object store -> replica).

Durable state (`supervisor_state.json` in run.dir): epoch, committed_round, fired faults, initial
eval loss, the run's start time. A restarted supervisor reads it, waits for replicas still in a
phase of its predecessor, asks every replica for its progress, and resumes: max committed wins.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from actors.fault_injector import FaultInjector
from actors.round_runner import TICK_S, RoundRunner
from actors.spares import SparePool
from hsgd.core.deadlines import PhaseClock
from hsgd.core.round import (Action, Outcome, RoundMachine, RoundSettings, assign_heals_for_cluster, checkpoint_due,
                             current_round)
from hsgd.core.topology import Topology
from hsgd.record.events import RunLog
from hsgd.record.metrics import efficiencies, fault_figures, round_record
from hsgd.record.rundir import atomic_write_text, read_jsonl, write_summary
from hsgd.record.wandb import WandbSink
from hsgd.train import checkpoint
from hsgd.train.comm import collective_timeout_s

STATE_FILE = "supervisor_state.json"


class RunFailed(RuntimeError):
    pass


def replica_actor_name(run_id: str, rid: str) -> str:
    return f"hsgd:{run_id}:{rid}"


def supervisor_actor_name(run_id: str) -> str:
    return f"hsgd:{run_id}:supervisor"


def restarts_exhausted(handle) -> bool:
    """`gone` only when Ray's actor table says DEAD (no restart will come): Ray also raises
    ActorDiedError for an actor it is about to restart."""
    try:
        from ray._private.state import state as gcs

        info = gcs.actor_table(handle._actor_id.hex())
        return info.get("State") == "DEAD"
    except Exception:  # noqa: BLE001 — the table is best effort; assume it may come back
        return False


def spare_actor_name(run_id: str, cluster: int, k: int) -> str:
    return f"hsgd:{run_id}:spare-c{cluster}-{k}"


@ray.remote(concurrency_groups={"run": 1, "status": 4})
class Supervisor:
    def __init__(self, cfg: dict, run_dir: str, run_id: str, resolved_config: dict):
        self.cfg = OmegaConf.create(cfg)
        self.run_dir, self.run_id = run_dir, run_id
        self.topology = Topology(self.cfg.topology.clusters, self.cfg.topology.replicas_per_cluster)
        self.spr = self.cfg.sync.outer_every
        self.log = RunLog(run_dir)
        self.durable = self._load_durable()
        self.durable["supervisor_starts"] = self.durable.get("supervisor_starts", 0) + 1
        # which actor serves which replica id (a hot spare that took over serves a dead one's id)
        self.names: dict[str, str] = self.durable.setdefault(
            "identity", {rid: replica_actor_name(run_id, rid) for rid in self.topology.replica_ids()})
        spares = int(self.cfg.topology.get("spares_per_cluster", 0) or 0)
        self.spares = SparePool(self.durable.setdefault(
            "spares", {str(c): [spare_actor_name(run_id, c, k) for k in range(spares)] for c in range(self.topology.clusters)}),
            self._lookup)
        self.handles = {rid: self._lookup(name) for rid, name in self.names.items()}
        self.gone = {rid for rid, h in self.handles.items() if h is None}  # restarts exhausted
        self.live: dict[str, tuple[int, int]] = {}  # rid -> committed (round, step)
        self.param_bytes = 0  # model size, as replicas report it: scales heal and collective deadlines
        self.pids: dict[str, int] = {}
        self.replica_info: dict[str, dict] = {}  # rid -> {pid, node_id}: for stack dumps
        self.leaders: dict[int, str] = {}
        self.configured: dict[int, tuple] = {}
        self.outer_configured = None
        w = self.cfg.watchdog
        self.clock = PhaseClock(multiple=w.multiple, floor_s=w.floor_s, ceiling_s=w.ceiling_s)
        self.injector = FaultInjector(self.cfg, run_dir, self.durable, self.log, save=self._save_durable)
        self.stop_requested = False
        self.status_view: dict[str, Any] = {"phase": "starting", "round": 0, "epoch": self.durable["epoch"]}
        self.attempted_steps = self.committed_steps = 0
        self.participation: list[float] = []
        self.store = self.store_addr = None
        first = self.durable["supervisor_starts"] == 1
        self.wandb = WandbSink(self.cfg if first else OmegaConf.merge(self.cfg, {"logging": {"wandb": {"mode": "disabled"}}}),
                               run_dir, resolved_config if first else {})
        self._save_durable()
        self.log.event("supervisor_start", starts=self.durable["supervisor_starts"], pid=os.getpid())

    # -- durable state ------------------------------------------------------------------------------
    def _load_durable(self) -> dict:
        path = Path(self.run_dir) / STATE_FILE
        state = json.loads(path.read_text()) if path.exists() else {}
        return {"epoch": 0, "fired": [], "committed_round": 0, "started_at": time.time(), **state}

    def _save_durable(self) -> None:
        atomic_write_text(Path(self.run_dir) / STATE_FILE, json.dumps(self.durable, indent=1))

    # -- status channel (answers while a phase runs) -----------------------------------------------------
    @ray.method(concurrency_group="status")
    def status(self) -> dict:
        return dict(self.status_view)

    @ray.method(concurrency_group="status")
    def request_stop(self) -> bool:
        """Finish the round in flight, then end the run with status `stopped` (drills, Ctrl-C)."""
        self.stop_requested = True
        return True

    @ray.method(concurrency_group="status")
    def add_fault(self, raw: dict) -> str:
        """Schedule one more fault (drills). Validated like the config's; recorded durably."""
        return self.injector.add(raw)

    @ray.method(concurrency_group="status")
    def crash(self) -> None:
        """The `crash` fault on the supervisor, injected now (drills)."""
        self.injector.record_fired("supervisor", "crash", "now", self.status_view.get("round"))
        os._exit(17)

    def _set_status(self, **fields) -> None:
        """The live view: answered by status() and mirrored to status.json for jobs.status."""
        self.status_view.update(fields, updated=time.time())
        try:
            atomic_write_text(Path(self.run_dir) / "status.json", json.dumps(self.status_view, default=str))
        except OSError:
            pass  # the view is best effort; the run goes on

    # -- replicas: lookup, liveness --------------------------------------------------------------------
    def _lookup(self, name: str):
        try:
            return ray.get_actor(name)
        except ValueError:  # a restarted supervisor finds a replica that died for good
            return None

    # -- hot spares ----------------------------------------------------------------------------------------
    def _promote_spare(self, rid: str, wait_s: float = 0.0) -> dict | None:
        """A ready spare of rid's cluster takes over rid (the dead actor becomes a spare once back).
        Returns the spare's progress: it joins like any restarted replica. None: no spare ready."""
        if not self.spares:
            return None
        self.spares.check(self.log)
        if not self.spares.ready and wait_s > 0:
            self.spares.check(self.log, wait_s=wait_s)  # between rounds: give pending answers a moment
        taken = self.spares.promote(rid, self.topology.cluster_of(rid), self.handles[rid], self.names[rid],
                                    self.cfg.supervisor.call_timeout_s)
        if taken is None:
            return None
        name, handle, answer = taken
        self.log.event("spare_promoted", rid=rid, spare=name, replaced=self.names[rid], pid=answer.get("pid"))
        self.names[rid], self.handles[rid] = name, handle
        self.gone.discard(rid)
        self._save_durable()
        return answer

    def _restarts_exhausted(self, rid: str) -> bool:
        return restarts_exhausted(self.handles[rid])

    def _probe(self, rid: str, timeout_s: float) -> dict | None:
        """Ask a replica for its progress; None if it does not answer in time or is gone."""
        if rid in self.gone:
            return None
        try:
            return ray.get(self.handles[rid].progress.remote(), timeout=timeout_s)
        except ActorDiedError:
            if self._restarts_exhausted(rid):
                self.gone.add(rid)
            return None
        except (ActorUnavailableError, RayActorError, GetTimeoutError):
            return None

    def _admit(self, rid: str, answer: dict) -> None:
        self.live[rid] = (int(answer["round"]), int(answer["step"]))
        self.param_bytes = max(self.param_bytes, int(answer.get("param_bytes") or 0))
        self._note_up(rid, answer)

    def _note_up(self, rid: str, answer: dict) -> None:
        self.replica_info[rid] = {"pid": answer.get("pid"), "node_id": answer.get("node_id")}
        if rid in self.pids and self.pids[rid] != answer.get("pid"):
            # a new process holds no group: its cluster's (and, for a leader, the outer) group re-forms
            c = self.topology.cluster_of(rid)
            self.configured.pop(c, None)
            if self.leaders.get(c) == rid:
                self.outer_configured = None
        if self.pids.get(rid) != answer.get("pid"):
            self.pids[rid] = answer.get("pid")
            self.log.event("replica_up", rid=rid, round=answer["round"], step=answer["step"], pid=answer.get("pid"))

    def _rejoin(self, wait_s: float) -> None:
        """Round boundary: bring back replicas that (re)started, waiting up to wait_s for them."""
        deadline = time.monotonic() + wait_s
        while True:
            for rid in self._missing():
                answer = self._probe(rid, min(2.0, max(0.2, deadline - time.monotonic())))
                if answer is not None:  # one still in a phase of a dead supervisor: _await_idle waits
                    self._admit(rid, answer)
            if not self._missing() or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _missing(self) -> list[str]:
        return [rid for rid in self.topology.replica_ids() if rid not in self.live and rid not in self.gone]

    def _refresh(self) -> None:
        """Every live replica's committed (round, step); those that do not answer are down."""
        refs = {rid: self.handles[rid].progress.remote() for rid in sorted(self.live)}
        for rid, ref in refs.items():
            try:
                self._admit(rid, ray.get(ref, timeout=self.cfg.supervisor.call_timeout_s))
            except Exception as err:  # noqa: BLE001 — any failure to answer means down
                self._down(rid, "died", "progress", -1, type(err).__name__)

    def _down(self, rid: str, cause: str, phase: str, round_index: int, detail: str = "") -> None:
        if cause == "error":  # the replica raised: restart it clean, as any failed replica
            try:
                ray.kill(self.handles[rid], no_restart=False)
            except Exception:  # noqa: BLE001 — already gone
                pass
        if self.live.pop(rid, None) is not None:
            self.log.event("replica_down", rid=rid, cluster=self.topology.cluster_of(rid), cause=cause,
                           phase=phase, round=round_index, detail=detail[:300])
            self.configured.pop(self.topology.cluster_of(rid), None)
            if self.leaders.get(self.topology.cluster_of(rid)) == rid:
                del self.leaders[self.topology.cluster_of(rid)]
                self.outer_configured = None

    def _await_idle(self) -> None:
        """After a supervisor restart, replicas may still run a phase of the old one (the inner
        phase goes on to the round's end). Wait while they advance; kill one stuck in a phase."""
        limit = self.cfg.comm.configure_timeout_s + self.cfg.comm.timeout_s + self.cfg.watchdog.floor_s
        last: dict[str, tuple[int, float]] = {}
        while True:
            busy = []
            for rid in list(self.live):
                answer = self._probe(rid, self.cfg.supervisor.call_timeout_s)
                if answer is None:
                    self._down(rid, "died", "await_idle", -1)
                    continue
                if answer.get("phase", "idle") == "idle":
                    self._admit(rid, answer)
                    continue
                step, since = last.get(rid, (-1, time.monotonic()))
                if answer["step"] != step:
                    last[rid] = (answer["step"], time.monotonic())
                elif time.monotonic() - since > limit:
                    self.log.event("kill", rid=rid, reason=f"stuck in {answer.get('phase')} after a supervisor restart")
                    ray.kill(self.handles[rid], no_restart=False)
                    self._down(rid, "hung", answer.get("phase", "?"), answer.get("round", -1))
                    continue
                busy.append(rid)
            if not busy:
                return
            self._set_status(phase="waiting_for_replicas", busy=busy)
            time.sleep(TICK_S)

    # -- the run -----------------------------------------------------------------------------------------
    def _start_store(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self.store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.cfg.comm.configure_timeout_s))
        self.store_addr = f"{host}:{self.store.port}"

    @ray.method(concurrency_group="run")
    def run(self) -> dict:
        """Drive rounds until train.rounds are committed, a stop is requested, or the run fails;
        returns summary.json's content (also written). Re-issued by the driver to a restarted
        supervisor, which resumes from its durable state and the replicas' progress."""
        start = time.time()
        self._start_store()
        status, reason = "completed", None
        try:
            self._set_status(phase="waiting_for_replicas")
            self._rejoin(self.cfg.supervisor.quorum_wait_s)
            self._await_idle()
            if "initial_eval_loss" not in self.durable:
                self.durable["initial_eval_loss"] = self._evaluate()
                self._save_durable()
                self.log.event("initial_eval", eval_loss=self.durable["initial_eval_loss"])
            self._catch_up()
            while True:
                for rid in self._missing() + sorted(self.gone):
                    if rid not in self.live and (answer := self._promote_spare(rid, wait_s=1.0)) is not None:
                        self._admit(rid, answer)
                boundary = self.cfg.supervisor.get("rejoin", "boundary") == "boundary"
                self._rejoin(self.cfg.supervisor.rejoin_wait_s if boundary and self._missing() else 0.0)
                self._refresh()
                r = current_round(self.live.values())
                if r >= self.cfg.train.rounds:
                    break
                if self.stop_requested:
                    status, reason = "stopped", f"stop requested; stopped after round {r}"
                    self.log.event("run_stopped", round=r)
                    break
                self._round(r)
            self._final_heal()
        except RunFailed as err:
            status, reason = "failed", str(err)
            self.log.event("run_failed", reason=reason)
        summary = self._summary(status, reason, start)
        write_summary(self.run_dir, summary)
        self.wandb.finish(summary)
        self.log.event("run_end", status=status)
        self._set_status(phase="done", status=status)
        return summary

    def _settings(self) -> RoundSettings:
        cfg, sup = self.cfg, self.cfg.supervisor
        # a healthy member leaves a broken collective within its (payload-scaled) timeout
        grace = collective_timeout_s(cfg.comm.timeout_s, self.param_bytes, cfg.comm.min_gbps) + 5.0
        heal_s = collective_timeout_s(sup.call_timeout_s, 3 * self.param_bytes, cfg.comm.min_gbps)  # params + optimizer
        return RoundSettings(steps_per_round=self.spr, inner=cfg.sync.inner, outer=cfg.sync.outer,
                             inner_every=cfg.sync.inner_every, rejoin=sup.get("rejoin", "boundary"),
                             min_replicas_per_cluster=sup.min_replicas_per_cluster, min_clusters=sup.min_clusters,
                             step_deadline_s=self.clock.deadline("inner_step", 1), group_grace_s=grace,
                             presumed_dead_s=max(0.5, 3 * self.clock.median("inner_step", 0.5)),
                             configure_s=cfg.comm.configure_timeout_s + 10.0, heal_s=heal_s,
                             outer_s=min(sup.phase_timeout_s, self.clock.deadline("outer", 1) + grace),
                             commit_s=min(sup.phase_timeout_s, self.clock.deadline("outer_commit", 1) + grace))

    def _round(self, r: int) -> None:
        """Run round r through the machine; record it, or restore / wait for quorum / fail."""
        machine = RoundMachine(self.topology, self._settings(), r, progress=dict(self.live), leaders=self.leaders,
                               epoch=self.durable["epoch"], committed_round=self.durable["committed_round"],
                               configured=self.configured, outer_configured=self.outer_configured)
        self.injector.supervisor_faults(r, "inner")
        run = RoundRunner(self, machine, r)
        run.drive()
        self.durable["epoch"] = machine.epoch
        self.leaders, self.configured, self.outer_configured = machine.leaders, machine.configured_groups(), machine.outer_configured
        self._save_durable()
        if machine.outcome == "committed":
            self._record(r, machine, run)
            return
        self._await_idle()  # a round that ended early may leave calls in flight: never call a busy replica
        if machine.outcome == "restore":
            self._restore(machine.reason)
        elif machine.outcome == "below_quorum":
            self._await_quorum(machine.reason)
        else:
            raise RunFailed(machine.reason)

    def _await_quorum(self, reason: str) -> None:
        wait_s = self.cfg.supervisor.quorum_wait_s
        self.log.event("quorum_wait", reason=reason, wait_s=wait_s)
        self._set_status(phase="quorum_wait")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self._rejoin(min(5.0, max(0.0, deadline - time.monotonic())))
            counts = [sum(1 for rid in self.live if self.topology.cluster_of(rid) == c) for c in range(self.topology.clusters)]
            if sum(n >= self.cfg.supervisor.min_replicas_per_cluster for n in counts) >= self.cfg.supervisor.min_clusters:
                return
        raise RunFailed(f"quorum lost: {reason}; waited {wait_s:.0f}s for replicas to return")

    def _record(self, r: int, machine: RoundMachine, run: "RoundRunner") -> None:
        self.durable["committed_round"] = r + 1
        self._save_durable()
        self.committed_steps += self.spr * len(run.inner_participants)
        self.attempted_steps += run.attempted_steps
        self.participation.append(len(run.inner_participants) / self.topology.num_replicas)
        self._refresh()
        self.log.event("commit", round=r, epoch=machine.epoch, replicas=sorted(run.commit_digests),
                       digests_agree=len(set(run.commit_digests.values())) <= 1)
        eval_loss = None
        if (r + 1) % self.cfg.train.eval_every == 0 or r + 1 == self.cfg.train.rounds:
            eval_loss = self._evaluate()
        record = round_record(round_index=r, steps_per_round=self.spr, losses=run.losses, tokens=run.tokens,
                              inner_bytes=run.inner_bytes, outer_bytes=run.outer_bytes, phase_s=run.seconds,
                              eval_loss=eval_loss, live_replicas=len(run.commit_digests), epoch=machine.epoch,
                              attempts=run.attempts, digests=run.commit_digests, global_digests=run.global_digests,
                              t=time.time())
        self.log.metrics(record)  # before the checkpoint: a crash there must not lose the round's record
        self.wandb.log_round(record)
        self._set_status(round=r + 1, last_loss=record["loss"], last_eval_loss=eval_loss,
                         tokens_per_s=record["tokens_per_s"], inner_step=record["inner_step"])
        if checkpoint_due(r + 1, self.cfg.checkpoint.every, self.cfg.train.rounds):
            self._checkpoint(r + 1)

    # -- between rounds: evaluate, checkpoint, restore, final heal ---------------------------------------
    def _evaluate(self) -> float | None:
        for rid in sorted(self.live, key=lambda x: (x not in self.leaders.values(), self.topology.global_index(x))):
            try:
                return float(ray.get(self.handles[rid].evaluate.remote(), timeout=self.cfg.supervisor.phase_timeout_s))
            except Exception as err:  # noqa: BLE001 — that replica's failure; ask the next one
                self._down(rid, "died" if isinstance(err, RayActorError) else "error", "evaluate", -1, str(err))
        return None

    def _checkpoint(self, state_round: int) -> str | None:
        """Durable checkpoint of the state at `state_round` (after round state_round - 1 committed).
        Final only if every file reports that round; an existing one is never overwritten."""
        root = Path(self.run_dir) / "checkpoints"
        if checkpoint.exists(root, state_round):
            self.log.event("checkpoint_skipped", round=state_round, reason="already exists")
            return None
        for _ in range(3):
            self.injector.supervisor_faults(state_round - 1, "checkpoint")
            temp = checkpoint.new_temp_dir(root, state_round)
            members = [rid for rid in sorted(self.live) if self.live[rid][0] == state_round]
            armed = self.injector.arm(state_round - 1, ("checkpoint",), self._plan_view(), only=set(members))
            refs = {rid: self.handles[rid].save_checkpoint.remote(str(temp), state_round, armed.get(rid)) for rid in members}
            results, failed = {}, {}
            for rid, ref in refs.items():
                try:
                    answer = ray.get(ref, timeout=self.cfg.supervisor.phase_timeout_s)
                    (results if answer["outcome"] == Outcome.DONE.value else failed)[rid] = answer
                except Exception as err:  # noqa: BLE001 — that replica's failure
                    failed[rid] = str(err)
                    self._down(rid, "died" if isinstance(err, RayActorError) else "error", "checkpoint", state_round - 1, str(err))
            if failed or not results or any(a["round"] != state_round for a in results.values()):
                shutil.rmtree(temp, ignore_errors=True)
                continue
            manifest = {"round": state_round, "step": state_round * self.spr, "run_id": self.run_id,
                        "topology": [self.topology.clusters, self.topology.replicas_per_cluster],
                        "files": {rid: a["sha256"] for rid, a in results.items()}, "t": time.time()}
            try:
                final = checkpoint.finalize(temp, manifest, {rid: a["round"] for rid, a in results.items()})
            except checkpoint.CheckpointError as err:
                self.log.event("checkpoint_refused", round=state_round, reason=str(err))
                continue
            checkpoint.prune(root, self.cfg.checkpoint.keep)
            self.log.event("checkpoint", round=state_round, path=str(final), replicas=sorted(results))
            return str(final)
        self.log.event("checkpoint_skipped", round=state_round, reason="replicas failed while saving")
        return None

    def _restore(self, reason: str) -> None:
        """Total loss: every replica loads the latest durable checkpoint, or the run fails."""
        self._rejoin(self.cfg.supervisor.rejoin_wait_s)
        latest = checkpoint.latest(Path(self.run_dir) / "checkpoints")
        if latest is None:
            raise RunFailed(f"{reason}; no durable checkpoint to restore (checkpoint.every={self.cfg.checkpoint.every})")
        manifest = checkpoint.read_manifest(latest)
        for rid in sorted(self.live):
            try:
                answer = ray.get(self.handles[rid].load_checkpoint.remote(str(latest), manifest["files"].get(rid)),
                                 timeout=self.cfg.supervisor.phase_timeout_s)
                self.live[rid] = (answer["round"], answer["step"])
            except Exception as err:  # noqa: BLE001 — it heals from a restored peer later
                self._down(rid, "died" if isinstance(err, RayActorError) else "error", "restore", -1, str(err))
        # rounds after the checkpoint are trained again: their lines go, so each is recorded once
        metrics_path = Path(self.run_dir) / "metrics.jsonl"
        kept = [m for m in read_jsonl(metrics_path) if m.get("round", 0) < manifest["round"]]
        self.log.rewrite_metrics(kept)
        self.durable["committed_round"] = manifest["round"]
        self.configured, self.outer_configured = {}, None
        self._save_durable()
        self.log.event("restore", round=manifest["round"], path=str(latest), reason=reason, replicas=sorted(self.live))

    def _final_heal(self) -> None:
        """A replica that died in the last round comes back and heals before the run ends."""
        if not self._missing():
            return
        self._set_status(phase="final_heal")
        self._rejoin(self.cfg.supervisor.rejoin_wait_s)
        top = current_round(self.live.values())
        donors = {rid: p for rid, p in self.live.items() if p[0] == top}
        for c in range(self.topology.clusters):
            members = {rid: p for rid, p in self.live.items() if self.topology.cluster_of(rid) == c}
            heals = assign_heals_for_cluster(members, {d: p for d, p in donors.items() if d not in members})
            if heals:
                action = Action(id=-1, kind="heal", round=top, cluster=c, epoch=self.durable["epoch"],
                                calls={h.target: (h.source, h.scope) for h in heals})
                RoundRunner(self, None, top).heal_now(action)
        self._refresh()
        view = self._plan_view()
        self._set_status(members={f"c{c}": list(m) for c, m in view.members.items()},
                         leaders={f"c{c}": r for c, r in view.leaders.items()})

    def _catch_up(self) -> None:
        """After a supervisor restart: record rounds the old one committed but did not record, and
        take the checkpoint it owed."""
        self._refresh()
        r_now = current_round(self.live.values())
        if r_now > self.durable["committed_round"]:
            self.durable["committed_round"] = r_now
            self._save_durable()
        if r_now == 0:
            return
        recorded = {m["round"] for m in read_jsonl(Path(self.run_dir) / "metrics.jsonl")}
        for missing in sorted(set(range(r_now)) - recorded):
            record = {"round": missing, "inner_step": (missing + 1) * self.spr, "loss": None, "replica_loss": {},
                      "eval_loss": None, "tokens_per_s": None, "inner_bytes": 0, "outer_bytes": 0,
                      "live_replicas": len(self.live), "epoch": self.durable["epoch"], "replica_digests": {},
                      "recovered": True, "t": time.time()}
            if missing == r_now - 1:
                record["replica_digests"] = {rid: d["param"] for rid, d in sorted(self._digests().items())
                                             if d["round"] == r_now}
                record["eval_loss"] = self._evaluate()
            self.log.metrics(record)
            self.log.event("round_recorded_late", round=missing)
        if checkpoint_due(r_now, self.cfg.checkpoint.every, self.cfg.train.rounds):
            self._checkpoint(r_now)

    def _digests(self) -> dict:
        out = {}
        for rid in sorted(self.live):
            try:
                out[rid] = ray.get(self.handles[rid].digests.remote(), timeout=self.cfg.supervisor.call_timeout_s)
            except Exception:  # noqa: BLE001 — a replica lost at the very end: its digest is absent
                pass
        return out

    def _plan_view(self):
        from hsgd.core.membership import Plan

        members = {c: tuple(r for r in self.topology.cluster_members(c) if r in self.live) for c in range(self.topology.clusters)}
        members = {c: m for c, m in members.items() if m}
        return Plan(epoch=self.durable["epoch"], members=members,
                    leaders={c: self.leaders.get(c, m[0]) for c, m in members.items()}, outer_clusters=tuple(members))

    def _summary(self, status: str, reason: str | None, start: float) -> dict:
        digests, global_digest = {}, None
        for rid, d in self._digests().items():
            digests[rid] = d["param"]
            global_digest = global_digest or d["global"]
        metrics = read_jsonl(Path(self.run_dir) / "metrics.jsonl")
        evals = [m["eval_loss"] for m in metrics if m.get("eval_loss") is not None]
        rounds = self.durable["committed_round"]
        step_eff, training_eff = efficiencies(self.committed_steps, self.attempted_steps, self.participation)
        return {"status": status, "reason": reason, "rounds_committed": rounds,
                "inner_steps_committed": rounds * self.spr,
                "initial_eval_loss": self.durable.get("initial_eval_loss"),
                "final_eval_loss": evals[-1] if evals else None,
                "wall_s": time.time() - self.durable["started_at"],  # the whole run, across supervisor restarts
                "supervisor_wall_s": time.time() - start,
                "replica_param_digests": digests, "global_param_digest": global_digest,
                "step_efficiency": step_eff, "training_efficiency": training_eff,
                "faults": fault_figures(read_jsonl(Path(self.run_dir) / "faults_fired.jsonl"),
                                        read_jsonl(Path(self.run_dir) / "events.jsonl")),
                "faults_not_fired": self.injector.not_fired(),
                "supervisor_starts": self.durable["supervisor_starts"],
                "epoch": self.durable["epoch"], "run_dir": self.run_dir}
