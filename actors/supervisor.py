"""Supervisor actor: the only authority on membership, epochs, phase order and commits.

It carries out hsgd's decisions (membership.Plan, heal.assign_heals, outer.commit_decision) by
calling replica actors; it never moves model-sized tensors itself (heals go replica -> object
store -> replica). One round, as in ARCHITECTURE.md:

    rejoin (round boundary: wait briefly for restarting replicas) -> plan -> heal -> configure
    -> inner phase -> [inner none: cluster average] -> outer reduce (leaders, into a buffer)
    -> commit decision -> outer commit (leader broadcasts, all apply) -> eval, metrics, checkpoint

Any failure (an actor died, a collective failed, a deadline passed) marks the dead, bumps the
epoch and repeats the round from the top; completed steps are never redone because every phase
call is idempotent per (round, phase) and replicas behind the furthest one are healed from it.
A replica that misses a deadline is killed (ray.kill, restartable) and handled as dead.

Durable state (`supervisor_state.json` in run.dir): epoch, fired faults, initial eval loss, and
the run's start time. A restarted supervisor reads it, asks every replica for its progress, and
resumes: max committed (round, step) wins.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from hsgd.train import checkpoint
from hsgd.core.faults import FaultSpec, due_faults, fault_figures, parse_fault, parse_schedule, random_schedule
from hsgd.core.heal import assign_heals
from hsgd.core.membership import Membership, Plan
from hsgd.train.outer import commit_decision
from hsgd.record.metrics import efficiencies, round_record
from hsgd.record.events import RunLog
from hsgd.record.rundir import atomic_write_text, read_jsonl, write_summary
from hsgd.core.topology import Topology
from hsgd.record.wandb import WandbSink
from hsgd.core.deadlines import PhaseClock
from hsgd.record.hangs import hang_report, stuck_function
from actors.hang import dump_replica

STATE_FILE = "supervisor_state.json"


class RunFailed(RuntimeError):
    pass


def replica_actor_name(run_id: str, rid: str) -> str:
    return f"hsgd:{run_id}:{rid}"


def supervisor_actor_name(run_id: str) -> str:
    return f"hsgd:{run_id}:supervisor"


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
        sup = self.cfg.supervisor
        self.membership = Membership(self.topology, min_replicas_per_cluster=sup.min_replicas_per_cluster,
                                     min_clusters=sup.min_clusters, epoch=self.durable.get("epoch", 0))
        self.handles, self.gone = {}, set()  # gone: replicas that can never come back (restarts exhausted)
        for rid in self.topology.replica_ids():
            try:
                self.handles[rid] = ray.get_actor(replica_actor_name(run_id, rid))
            except ValueError:  # a restarted supervisor finds a replica that died for good
                self.gone.add(rid)
        self.progress: dict[str, tuple[int, int]] = {}
        self.replica_info: dict[str, dict] = {}  # rid -> {pid, node_id}: for stack dumps
        w = self.cfg.watchdog
        self.clock = PhaseClock(multiple=w.multiple, floor_s=w.floor_s,
                                ceiling_s=min(w.ceiling_s, self.cfg.supervisor.phase_timeout_s))
        self.configured_epoch: int | None = None
        self.plan: Plan | None = None
        self.faults: list[FaultSpec] = parse_schedule(list(self.cfg.faults.schedule), clusters=self.topology.clusters,
                                                      replicas_per_cluster=self.topology.replicas_per_cluster)
        fc = self.cfg.faults
        if fc.mtbf_s > 0:
            self.faults += random_schedule(mtbf_s=fc.mtbf_s, kinds=list(fc.kinds), seed=fc.seed,
                                           rounds=self.cfg.train.rounds, round_s_estimate=self.spr * fc.step_s,
                                           steps_per_round=self.spr, clusters=self.topology.clusters,
                                           replicas_per_cluster=self.topology.replicas_per_cluster)
        for raw in self.durable.get("added_faults", []):  # faults a drill added before a restart
            self.faults.append(parse_fault(raw, index=len(self.faults), clusters=self.topology.clusters,
                                           replicas_per_cluster=self.topology.replicas_per_cluster))
        self.stop_requested = False
        self.status_view: dict[str, Any] = {"phase": "starting", "round": 0, "epoch": self.membership.epoch}
        self.attempted_steps = 0  # replica-steps the inner phases were asked to run
        self.committed_steps = 0  # replica-steps that made it into a committed round
        self.participation: list[float] = []
        self.fault_log: list[dict] = []
        self.store = None
        self.store_addr = None
        self.wandb = WandbSink(self.cfg, run_dir, resolved_config) if self.durable["supervisor_starts"] == 1 \
            else WandbSink(OmegaConf.merge(self.cfg, {"logging": {"wandb": {"mode": "disabled"}}}), run_dir, {})
        self._save_durable()
        self.log.event("supervisor_start", starts=self.durable["supervisor_starts"], pid=os.getpid())

    # -- durable state --------------------------------------------------------------------------
    def _load_durable(self) -> dict:
        path = Path(self.run_dir) / STATE_FILE
        if path.exists():
            return json.loads(path.read_text())
        return {"epoch": 0, "fired": [], "started_at": time.time()}

    def _save_durable(self) -> None:
        self.durable["epoch"] = self.membership.epoch
        atomic_write_text(Path(self.run_dir) / STATE_FILE, json.dumps(self.durable, indent=1))

    # -- status (answers while a phase runs) -----------------------------------------------------
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
        spec = parse_fault(raw, index=len(self.faults), clusters=self.topology.clusters,
                           replicas_per_cluster=self.topology.replicas_per_cluster)
        self.faults.append(spec)
        self.durable.setdefault("added_faults", []).append(dict(raw))
        self._save_durable()
        self.log.event("fault_scheduled", fault=spec.describe())
        return spec.describe()

    @ray.method(concurrency_group="status")
    def crash(self) -> None:
        """The `crash` fault on the supervisor, injected now (drills)."""
        with open(os.path.join(self.run_dir, "faults_fired.jsonl"), "a") as fh:
            fh.write(json.dumps({"t": time.time(), "rid": "supervisor", "kind": "crash", "phase": "now",
                                 "round": self.status_view.get("round")}) + "\n")
        os._exit(17)

    def _set_status(self, **fields) -> None:
        """The live view: answered by status() and mirrored to status.json for jobs.status."""
        self.status_view.update(fields, updated=time.time())
        try:
            atomic_write_text(Path(self.run_dir) / "status.json",
                                         json.dumps(self.status_view, default=str))
        except OSError:
            pass  # the view is best effort; the run goes on

    # -- calling replicas -----------------------------------------------------------------------
    def _gather(self, calls: dict[str, Any], timeout_s: float, phase: str,
                round_index: int = -1, early_hang: bool = True) -> tuple[dict, dict]:
        """Wait for every call; returns (results, failures). A failure is (kind, detail) with kind
        `died` (actor gone), `collective` (alive, a peer failed) or `deadline` (hung: dumped,
        reported and killed by us)."""
        results, failures = {}, {}
        pending = {ref: rid for rid, ref in calls.items()}
        start = time.monotonic()
        deadline = start + timeout_s
        first_error_at = None
        # Once a peer reported a failed collective, the others fail within a moment too (their
        # groups are broken); anyone still silent after this grace is hung.
        grace = max(3.0, min(self.cfg.comm.timeout_s, 10.0))
        while pending:
            now = time.monotonic()
            hang_deadline = deadline if first_error_at is None or not early_hang else min(deadline, first_error_at + grace)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, hang_deadline - now))
            if not ready:
                stuck = sorted(pending.values())
                self._report_hang(stuck, phase, round_index, calls, results, failures,
                                  waited_s=time.monotonic() - start, deadline_s=hang_deadline - start)
                for rid in stuck:
                    failures[rid] = ("deadline", f"{phase} missed its deadline")
                break
            for ref in ready:
                rid = pending.pop(ref)
                try:
                    value = ray.get(ref, timeout=self.cfg.supervisor.call_timeout_s)
                except (ActorDiedError, ActorUnavailableError, RayActorError) as err:
                    failures[rid] = ("died", type(err).__name__)
                    first_error_at = first_error_at or time.monotonic()
                    continue
                except GetTimeoutError:
                    failures[rid] = ("deadline", "result fetch timed out")
                    continue
                if isinstance(value, dict) and value.get("ok") is False:
                    failures[rid] = ("collective", value.get("error", "?"))
                    first_error_at = first_error_at or time.monotonic()
                    self._note_progress(value)
                else:
                    results[rid] = value
                    self._note_progress(value)
        return results, failures

    def _note_progress(self, value: Any) -> None:
        if isinstance(value, dict) and "rid" in value and "round" in value:
            self.progress[value["rid"]] = (int(value["round"]), int(value["step"]))
            if "pid" in value:
                self.replica_info[value["rid"]] = {"pid": value["pid"], "node_id": value.get("node_id"),
                                                   "phase": value.get("phase")}

    def _report_hang(self, stuck: list[str], phase: str, round_index: int, calls: dict, results: dict,
                     failures: dict, *, waited_s: float, deadline_s: float) -> None:
        """Missed deadline: dump stacks of everyone in the phase, write hangs/<time>-<rid>.txt,
        then kill the stuck replicas (restartable) so the normal fault path takes over."""
        peers = {}
        for rid in calls:
            if rid in results:
                peers[rid] = "returned ok"
            elif rid in failures:
                peers[rid] = f"failed: {failures[rid][0]}: {failures[rid][1][:160]}"
            else:
                peers[rid] = f"waiting: no answer after {waited_s:.1f}s"
        dumps = {}
        if self.cfg.watchdog.stack_dumps:  # in parallel: each py-spy dump takes about a second
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=8) as pool:
                futures = {rid: pool.submit(dump_replica, self.handles[rid], self.replica_info.get(rid, {}),
                                            self.run_dir, rid) for rid in sorted(calls)}
                dumps = {rid: fut.result(timeout=30.0) for rid, fut in futures.items()}  # each dump is itself bounded
        hang_dir = Path(self.run_dir) / "hangs"
        hang_dir.mkdir(exist_ok=True)
        for rid in stuck:
            text = hang_report(rid=rid, phase=phase, round_index=round_index, waited_s=waited_s,
                               deadline_s=deadline_s, peers=peers, dumps=dumps,
                               view={"epoch": self.membership.epoch, "leaders": self.plan.leaders if self.plan else {}})
            path = hang_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{rid}.txt"
            atomic_write_text(path, text)
            self.log.event("hang_detected", rid=rid, phase=phase, round=round_index, waited_s=waited_s,
                           deadline_s=deadline_s, stuck_in=stuck_function(dumps.get(rid, "")), report=str(path),
                           waiting=[p for p, st in peers.items() if st != "returned ok" and p != rid])
            try:
                ray.kill(self.handles[rid], no_restart=False)
            except Exception as err:  # noqa: BLE001 — already dead is fine
                self.log.event("kill_failed", rid=rid, error=str(err))

    def _handle_failures(self, failures: dict, phase: str, round_index: int) -> None:
        now = time.time()
        for rid, (kind, detail) in sorted(failures.items()):
            if kind in ("died", "deadline"):
                if self.membership.mark_dead(rid):
                    self.log.event("replica_down", rid=rid, phase=phase, round=round_index, cause=kind, detail=detail)
                    self.fault_log.append({"rid": rid, "detected_at": now, "phase": phase, "round": round_index,
                                           "cause": kind})
            else:
                self.log.event("collective_failed", rid=rid, phase=phase, round=round_index, detail=detail[:300])
        self.membership.force_new_epoch()

    # -- membership ------------------------------------------------------------------------------
    def _probe(self, rid: str, timeout_s: float) -> dict | None:
        """Ask a replica for its progress; None if it does not answer in time or is gone."""
        try:
            return ray.get(self.handles[rid].progress.remote(), timeout=timeout_s)
        except ActorDiedError:
            self.gone.add(rid)
            return None
        except (ActorUnavailableError, RayActorError, GetTimeoutError):
            return None

    def _rejoin(self, wait_s: float) -> None:
        """Round boundary: bring back replicas that restarted, waiting up to wait_s for them.
        A restarting actor answers ActorUnavailableError at once, so keep asking until the deadline."""
        deadline = time.monotonic() + wait_s
        while True:
            missing = [rid for rid in self.topology.replica_ids()
                       if rid not in self.membership.live and rid not in self.gone]
            for rid in missing:
                answer = self._probe(rid, min(2.0, max(0.2, deadline - time.monotonic())))
                if answer is not None:
                    self.membership.mark_alive(rid)
                    self.progress[rid] = (answer["round"], answer["step"])
                    self.log.event("replica_up", rid=rid, round=answer["round"], step=answer["step"],
                                   pid=answer.get("pid"))
            still = [rid for rid in missing if rid not in self.membership.live and rid not in self.gone]
            if not still or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _await_quorum(self) -> None:
        problem = self.membership.quorum_problem()
        if problem is None:
            return
        wait_s = self.cfg.supervisor.quorum_wait_s
        self.log.event("quorum_wait", reason=problem, wait_s=wait_s)
        self._set_status(phase="quorum_wait")
        self._rejoin(wait_s)
        problem = self.membership.quorum_problem()
        if problem is not None:
            raise RunFailed(f"quorum lost: {problem}; waited {wait_s:.0f}s for replicas to return")

    def _refresh_progress(self) -> None:
        refs = {rid: self.handles[rid].progress.remote() for rid in sorted(self.membership.live)}
        results, failures = self._gather(refs, self.cfg.supervisor.call_timeout_s, "progress")
        if failures:
            self._handle_failures(failures, "progress", -1)

    def _heal(self, plan: Plan, round_index: int) -> bool:
        heals = assign_heals({rid: self.progress[rid] for rid in plan.live if rid in self.progress}, plan)
        if not heals:
            return True
        self._set_status(phase="heal")
        start = time.monotonic()
        involved = {h.source for h in heals} | {h.target for h in heals}
        armed = self._armed(round_index, ("heal",), plan, only=involved)
        state_refs = {src: self.handles[src].get_state.remote(armed.get(src)) for src in sorted({h.source for h in heals})}
        calls = {h.target: self.handles[h.target].load_state.remote(state_refs[h.source], h.scope, armed.get(h.target))
                 for h in heals}
        for h in heals:
            self.log.event("heal_begin", target=h.target, source=h.source, scope=h.scope)
        results, failures = self._gather(calls, self.cfg.supervisor.call_timeout_s, "heal")
        seconds = time.monotonic() - start
        for h in heals:
            if h.target in results:
                self.log.event("heal_end", target=h.target, source=h.source, scope=h.scope, seconds=seconds,
                               bytes=results[h.target].get("bytes"))
        if failures:
            # A dead source surfaces as an error in its target's call: ask everyone involved.
            dead = {rid: ("died", "no answer after a failed heal") for rid in sorted(involved)
                    if self._probe(rid, 3.0) is None}
            self._handle_failures(dead or failures, "heal", round_index)
            return False
        return True

    def _configure(self, plan: Plan) -> bool:
        self._set_status(phase="configure")
        calls = {}
        outer_on = self.cfg.sync.outer != "none"
        for cluster, members in plan.members.items():
            for rid in members:
                inner = (f"{self.run_id}/{plan.inner_prefix(cluster)}", plan.inner_rank(rid), len(members))
                outer = None
                if outer_on and plan.is_leader(rid):
                    outer = (f"{self.run_id}/{plan.outer_prefix()}", plan.outer_rank(cluster), len(plan.outer_clusters))
                calls[rid] = self.handles[rid].configure.remote(plan.epoch, self.store_addr, inner, outer)
        # early_hang=False: after a member dies, the others legitimately wait out the rendezvous
        results, failures = self._gather(calls, self.cfg.comm.configure_timeout_s + 10.0, "configure",
                                         early_hang=False)
        if failures:
            self._handle_failures(failures, "configure", -1)
            return False
        self.configured_epoch = plan.epoch
        self.log.event("membership", epoch=plan.epoch, members={f"c{c}": list(m) for c, m in plan.members.items()},
                       leaders={f"c{c}": r for c, r in plan.leaders.items()}, standby=list(plan.standby))
        self._save_durable()
        return True

    def _prepare(self, round_index: int, at_round_start: bool) -> Plan | None:
        """rejoin -> quorum -> progress -> heal -> configure. None means: something failed, retry."""
        if at_round_start:
            self._rejoin(self.cfg.supervisor.rejoin_wait_s if self._anyone_restarting() else 0.0)
        self._await_quorum()
        self._refresh_progress()
        plan = self.membership.plan()
        if not self._heal(plan, round_index):
            return None
        if self.configured_epoch != plan.epoch and not self._configure(plan):
            return None
        self.plan = plan
        self._set_status(epoch=plan.epoch, members={f"c{c}": list(m) for c, m in plan.members.items()},
                         leaders={f"c{c}": r for c, r in plan.leaders.items()})
        return plan

    def _anyone_restarting(self) -> bool:
        return any(rid not in self.membership.live and rid not in self.gone for rid in self.topology.replica_ids())

    # -- faults --------------------------------------------------------------------------------
    def _armed(self, round_index: int, phases: tuple[str, ...], plan: Plan,
               only: set[str] | None = None, called: set[str] | None = None) -> dict[str, list[dict]]:
        """Faults to hand to replicas with this phase call. Each fires once (recorded durably).
        A target that takes no part in the phase (a non-leader of `cluster:c1` during the outer
        all-reduce) gets its fault injected right away through its control channel."""
        armed: dict[str, list[dict]] = {}
        due = due_faults(self.faults, self.durable["fired"], round_index=round_index, phases=phases,
                         plan=plan, only=only)
        for d in due:
            self.durable["fired"].append(d.index)
            self.log.event("fault_armed", fault=d.spec.describe(), targets=list(d.targets))
            for rid in d.targets:
                if called is None or rid in called:
                    armed.setdefault(rid, []).append(d.message())
                elif d.spec.kind == "kill":  # as a node failure would: from outside, at once
                    self._record_fired(rid, d.spec.kind, d.spec.phase, round_index)
                    ray.kill(self.handles[rid], no_restart=False)
                else:
                    self.handles[rid].inject.remote(d.message())  # fire-and-forget: it may never answer
        if due:
            self._save_durable()
        return armed

    def _record_fired(self, rid: str, kind: str, phase: str, round_index: int | None) -> None:
        with open(os.path.join(self.run_dir, "faults_fired.jsonl"), "a") as fh:
            fh.write(json.dumps({"t": time.time(), "rid": rid, "kind": kind, "phase": phase,
                                 "round": round_index, "step": 0}) + "\n")

    def _supervisor_faults(self, round_index: int, phase: str) -> None:
        fired = self.durable["fired"]
        for i, f in enumerate(self.faults):
            if i in fired or f.target_kind != "supervisor" or f.round != round_index or f.phase != phase:
                continue
            fired.append(i)
            self._save_durable()  # before dying: a restarted supervisor must not fire it again
            self.log.event("fault_fired", fault=f.describe(), pid=os.getpid())
            self._record_fired("supervisor", f.kind, phase, round_index)
            if f.kind == "kill":
                ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
                time.sleep(60)
            os._exit(17)

    # -- the round -----------------------------------------------------------------------------
    def _phase(self, name: str, round_index: int, calls: dict[str, Any], units: int = 1) -> tuple[dict, dict]:
        """One phase call on many replicas, under the watchdog's deadline for `units` of work."""
        deadline_s = self.clock.deadline(name, units)
        self._set_status(phase=name, round=round_index, deadline_s=deadline_s)
        self.log.event("phase_begin", phase=name, round=round_index, epoch=self.membership.epoch,
                       replicas=sorted(calls), deadline_s=deadline_s)
        start = time.monotonic()
        results, failures = self._gather(calls, deadline_s, name, round_index)
        seconds = time.monotonic() - start
        self.log.event("phase_end", phase=name, round=round_index, seconds=seconds,
                       ok=sorted(results), failed={rid: list(v) for rid, v in failures.items()})
        if failures:
            self._handle_failures(failures, name, round_index)
        elif units > 0:
            self.clock.observe(name, seconds, units)
        return results, failures

    def _run_round(self, r: int) -> dict:
        sup, cfg = self.cfg.supervisor, self.cfg
        seconds = {"inner": 0.0, "inner_sync": 0.0, "outer": 0.0, "outer_commit": 0.0, "heal_configure": 0.0}
        totals = {"tokens": 0, "inner_bytes": 0, "outer_bytes": 0}
        losses: dict[str, list[float]] = {}
        at_round_start, attempts = True, 0
        while True:
            attempts += 1
            if attempts > 100:
                raise RunFailed(f"round {r} failed 100 times in a row; giving up")
            t0 = time.monotonic()
            plan = self._prepare(r, at_round_start)
            at_round_start = False
            seconds["heal_configure"] += time.monotonic() - t0
            if plan is None:
                continue
            live = plan.live
            # inner phase: every participating replica finishes the round's steps
            self._supervisor_faults(r, "inner")
            t0 = time.monotonic()
            armed = self._armed(r, ("inner", "inner_sync"), plan)
            steps_before = {rid: self.progress.get(rid, (r, 0))[1] for rid in live}
            units = max(self.spr - (steps_before[rid] - r * self.spr) for rid in live)
            results, failures = self._phase("inner", r, {rid: self.handles[rid].run_inner.remote(r, armed.get(rid))
                                                          for rid in live}, units)
            seconds["inner"] += time.monotonic() - t0
            done = {rid: self.progress.get(rid, (r, steps_before[rid]))[1] - steps_before[rid]
                    for rid in live if rid not in failures or failures[rid][0] == "collective"}
            lost = max(done.values(), default=0)  # a dead replica ran about as far as its peers
            self.attempted_steps += sum(done.values()) + lost * (len(live) - len(done))
            for rid, res in results.items():
                rep = res["report"]
                totals["tokens"] += rep["tokens"]
                totals["inner_bytes"] += rep["inner_bytes"]
                losses.setdefault(rid, []).extend(rep["losses"])
            if failures:
                continue
            self.participation.append(len(live) / self.topology.num_replicas)
            # inner none: the cluster's mean goes to outer sync
            if cfg.sync.inner == "none" and any(len(m) > 1 for m in plan.members.values()):
                t0 = time.monotonic()
                armed = self._armed(r, ("inner_sync",), plan)
                _, failures = self._phase("inner_sync", r, {rid: self.handles[rid].cluster_average.remote(r, armed.get(rid))
                                                            for rid in live})
                seconds["inner_sync"] += time.monotonic() - t0
                if failures:
                    continue
            # outer phase, step 1: leaders reduce into buffers (nothing applied yet)
            self._supervisor_faults(r, "outer")
            t0 = time.monotonic()
            leaders = {c: plan.leaders[c] for c in plan.outer_clusters}
            armed = self._armed(r, ("outer",), plan, called=set(leaders.values()))
            results, failures = self._phase("outer", r, {rid: self.handles[rid].outer_reduce.remote(r, armed.get(rid))
                                                         for rid in leaders.values()})
            seconds["outer"] += time.monotonic() - t0
            totals["outer_bytes"] += sum(res.get("outer_bytes", 0) for res in results.values())
            succeeded = {c for c, rid in leaders.items() if rid in results}
            if not commit_decision(set(leaders), succeeded):
                self.log.event("abort", round=r, reason="outer reduce incomplete", succeeded=sorted(succeeded))
                self._discard_buffers(plan)
                continue
            # step 2: the decision is commit; leaders broadcast in their cluster, everyone applies
            self.log.event("commit_decision", round=r, clusters=sorted(succeeded))
            self._supervisor_faults(r, "outer_commit")
            t0 = time.monotonic()
            armed = self._armed(r, ("outer_commit",), plan)
            calls = {rid: self.handles[rid].outer_commit.remote(r, plan.inner_rank(plan.leaders[c]), armed.get(rid))
                     for c, members in plan.members.items() for rid in members}
            results, failures = self._phase("outer_commit", r, calls)
            seconds["outer_commit"] += time.monotonic() - t0
            totals["inner_bytes"] += sum(res.get("inner_bytes", 0) for res in results.values())
            if failures:
                continue  # committed replicas are ahead now; the rest heal from them on retry
            digests = {rid: res["digest"] for rid, res in results.items()}
            global_digests = {rid: res["global_digest"] for rid, res in results.items()}
            self.committed_steps += self.spr * len(live)
            self.log.event("commit", round=r, epoch=plan.epoch, replicas=sorted(results),
                           digests_agree=len(set(digests.values())) == 1)
            return {"plan": plan, "seconds": seconds, "totals": totals, "losses": losses, "digests": digests,
                    "global_digests": global_digests, "attempts": attempts}

    def _discard_buffers(self, plan: Plan) -> None:
        calls = {rid: self.handles[rid].discard_outer.remote() for rid in plan.leaders.values()}
        _, failures = self._gather(calls, self.cfg.supervisor.call_timeout_s, "discard")
        if failures:
            self._handle_failures(failures, "discard", -1)

    def _evaluate(self, plan: Plan) -> float | None:
        for c in sorted(plan.leaders):
            results, failures = self._gather({plan.leaders[c]: self.handles[plan.leaders[c]].evaluate.remote()},
                                             self.cfg.supervisor.phase_timeout_s, "evaluate")
            if results:
                return float(next(iter(results.values())))
            self._handle_failures(failures, "evaluate", -1)
        return None

    def _checkpoint(self, r: int, plan: Plan) -> str | None:
        """Durable checkpoint after round r committed (the state at round r + 1)."""
        root = Path(self.run_dir) / "checkpoints"
        for attempt in range(3):
            self._supervisor_faults(r, "checkpoint")
            temp = checkpoint.new_temp_dir(root, r + 1)
            armed = self._armed(r, ("checkpoint",), plan)
            results, failures = self._phase("checkpoint", r, {rid: self.handles[rid].save_checkpoint.remote(str(temp), armed.get(rid))
                                                              for rid in plan.live})
            if failures or not results:
                import shutil

                shutil.rmtree(temp, ignore_errors=True)
                self._rejoin(0.0)
                plan = self.membership.plan()
                continue
            manifest = {"round": r + 1, "step": (r + 1) * self.spr, "run_id": self.run_id,
                        "topology": [self.topology.clusters, self.topology.replicas_per_cluster],
                        "files": {rid: res["sha256"] for rid, res in results.items()}, "t": time.time()}
            final = checkpoint.finalize(temp, manifest)
            checkpoint.prune(root, self.cfg.checkpoint.keep)
            self.log.event("checkpoint", round=r + 1, path=str(final), replicas=sorted(results))
            return str(final)
        self.log.event("checkpoint_skipped", round=r + 1)
        return None

    # -- the run ------------------------------------------------------------------------------
    def _start_store(self) -> None:
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self.store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False,
                              timeout=__import__("datetime").timedelta(seconds=self.cfg.comm.configure_timeout_s))
        self.store_addr = f"{host}:{self.store.port}"

    @ray.method(concurrency_group="run")
    def run(self) -> dict:
        start = time.time()
        self._start_store()
        self.configured_epoch = None
        self.membership.force_new_epoch()
        status, reason = "completed", None
        try:
            self._set_status(phase="waiting_for_replicas")
            self._rejoin(self.cfg.supervisor.quorum_wait_s)
            self._await_quorum()
            self._refresh_progress()
            if "initial_eval_loss" not in self.durable:
                plan = self.membership.plan()
                self.durable["initial_eval_loss"] = self._evaluate(plan)
                self._save_durable()
                self.log.event("initial_eval", eval_loss=self.durable["initial_eval_loss"])
            self._catch_up()
            while True:
                r = max((self.progress[rid][0] for rid in self.membership.live if rid in self.progress), default=0)
                if r >= self.cfg.train.rounds:
                    break
                if self.stop_requested:
                    status, reason = "stopped", f"stop requested; stopped after round {r}"
                    self.log.event("run_stopped", round=r)
                    break
                self._round_and_record(r)
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

    def _round_and_record(self, r: int) -> None:
        out = self._run_round(r)
        plan = out["plan"]
        eval_loss = None
        if (r + 1) % self.cfg.train.eval_every == 0 or r + 1 == self.cfg.train.rounds:
            eval_loss = self._evaluate(plan)
        record = round_record(round_index=r, steps_per_round=self.spr, losses=out["losses"],
                              tokens=out["totals"]["tokens"], inner_bytes=out["totals"]["inner_bytes"],
                              outer_bytes=out["totals"]["outer_bytes"], phase_s=out["seconds"], eval_loss=eval_loss,
                              live_replicas=len(plan.live), epoch=plan.epoch, attempts=out["attempts"],
                              digests=out["digests"], global_digests=out["global_digests"], t=time.time())
        self.log.metrics(record)  # before the checkpoint: a crash there must not lose the round's record
        self.wandb.log_round(record)
        self._set_status(round=r + 1, last_loss=record["loss"], last_eval_loss=eval_loss,
                         tokens_per_s=record["tokens_per_s"], inner_step=record["inner_step"])
        if self._checkpoint_due(r + 1):
            self._checkpoint(r, plan)

    def _final_heal(self) -> None:
        """A replica that died in the last round comes back and heals before the run ends, so the
        result is held by every replica that can return (not only the survivors)."""
        if not self._anyone_restarting():
            return
        self._set_status(phase="final_heal")
        self._rejoin(self.cfg.supervisor.rejoin_wait_s)
        self._refresh_progress()
        plan = self.membership.plan()
        top = max((self.progress[rid][0] for rid in plan.live if rid in self.progress), default=0)
        self._heal(plan, top)

    def _checkpoint_due(self, rounds_done: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and (rounds_done % every == 0 or rounds_done == self.cfg.train.rounds)

    def _catch_up(self) -> None:
        """After a supervisor restart: record the rounds the old supervisor committed but did not
        record, and take the checkpoint it owed. Replicas are exactly at the last committed round
        (nothing runs without a supervisor), so both are exact."""
        r_now = max((self.progress[rid][0] for rid in self.membership.live if rid in self.progress), default=0)
        if r_now == 0:
            return
        recorded = {m["round"] for m in read_jsonl(Path(self.run_dir) / "metrics.jsonl")}
        plan = self.membership.plan()
        for missing in sorted(set(range(r_now)) - recorded):
            record = {"round": missing, "inner_step": (missing + 1) * self.spr, "loss": None, "replica_loss": {},
                      "eval_loss": None, "tokens_per_s": None, "inner_bytes": 0, "outer_bytes": 0,
                      "live_replicas": len(plan.live), "epoch": plan.epoch, "replica_digests": {},
                      "recovered": True, "t": time.time()}
            if missing == r_now - 1:
                results, _ = self._gather({rid: self.handles[rid].digests.remote() for rid in plan.live},
                                          self.cfg.supervisor.call_timeout_s, "digests")
                record["replica_digests"] = {rid: d["param"] for rid, d in sorted(results.items())}
                record["eval_loss"] = self._evaluate(plan)
            self.log.metrics(record)
            self.log.event("round_recorded_late", round=missing)
        if self._checkpoint_due(r_now):
            latest = checkpoint.latest(Path(self.run_dir) / "checkpoints")
            if latest is None or checkpoint.read_manifest(latest)["round"] < r_now:
                self._checkpoint(r_now - 1, plan)

    def _summary(self, status: str, reason: str | None, start: float) -> dict:
        digests, global_digest = {}, None
        calls = {rid: self.handles[rid].digests.remote() for rid in sorted(self.membership.live)}
        results, _ = self._gather(calls, self.cfg.supervisor.call_timeout_s, "digests")
        for rid, d in sorted(results.items()):
            digests[rid] = d["param"]
            global_digest = global_digest or d["global"]
        metrics = read_jsonl(Path(self.run_dir) / "metrics.jsonl")
        evals = [m["eval_loss"] for m in metrics if m.get("eval_loss") is not None]
        rounds = max((r for r, _ in (self.progress.get(rid, (0, 0)) for rid in self.membership.live)), default=0)
        committed_steps = rounds * self.spr
        step_eff, training_eff = efficiencies(self.committed_steps, self.attempted_steps, self.participation)
        return {"status": status, "reason": reason, "rounds_committed": rounds,
                "inner_steps_committed": committed_steps,
                "initial_eval_loss": self.durable.get("initial_eval_loss"),
                "final_eval_loss": evals[-1] if evals else None,
                "wall_s": time.time() - self.durable["started_at"],  # the whole run, across supervisor restarts
                "supervisor_wall_s": time.time() - start,
                "replica_param_digests": digests, "global_param_digest": global_digest,
                "step_efficiency": step_eff, "training_efficiency": training_eff,
                "faults": fault_figures(read_jsonl(Path(self.run_dir) / "faults_fired.jsonl"),
                                        read_jsonl(Path(self.run_dir) / "events.jsonl")),
                "supervisor_starts": self.durable["supervisor_starts"],
                "epoch": self.membership.epoch, "run_dir": self.run_dir}
