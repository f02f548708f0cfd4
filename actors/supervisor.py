"""Supervisor actor: carries out hsgd.core.round.RoundMachine's actions, one machine per round
through actors/round_runner.py, and decides nothing itself (hsgd/core/round/__init__.py says what
happens after any failure). Between rounds it brings back restarted replicas and hands dead ones'
ids to hot spares (actors/roster.py), records, evaluates and checkpoints (actors/round_close.py),
restores after a total loss (actors/checkpointing.py) and waits for quorum. Heals go replica ->
object store -> replica, never through it.

Durable state: one `RunState` (hsgd/record/run_state.py), saved whole on every change. A
restarted supervisor reads it, waits for replicas still in a phase of its predecessor, asks every
replica for its progress, and resumes: max committed wins. Its writes and their deadline:
actors/round_record.py. Whatever ends the run, `run` returns a summary.
"""

from __future__ import annotations

import os
import time
import traceback

import ray
from omegaconf import OmegaConf

from actors import checkpointing
from actors.fault_injector import FaultInjector
from actors.quarantine import Quarantine
from actors.replica_calls import heal_at_rest
from actors.roster import Roster
from actors.round_close import RoundClose
from actors.round_record import RunFailed, SupervisorRecord
from actors.round_runner import TICK_S, RoundRunner, RunnerPorts
from actors.site_changes import SiteChanges, topology_of_run
from hsgd.config.layout import RunLayout, layout_of
from hsgd.core.deadlines import PhaseClock
from hsgd.core.membership import quorum_problem
from hsgd.core.quarantine import takes_spare
from hsgd.core.round import (
    CallKind,
    Heal,
    Phase,
    RoundMachine,
    RoundSettings,
    current_round,
    heals_at_rest,
    round_settings,
)
from hsgd.core.round.balance import StepPlan, close_after_s, fragment_delay_of, plan_for_round
from hsgd.record.run_state import RunState


def supervisor_actor_name(run_id: str) -> str:
    return f"hsgd:{run_id}:supervisor"


@ray.remote(concurrency_groups={"run": 1, "status": 4})
class Supervisor:
    def __init__(
        self,
        cfg: dict,
        run_dir: str,
        run_id: str,
        resolved_config: dict,
        resume_round: int | None = None,
        layout: RunLayout | None = None,
    ):
        """`resume_round`: the resumed checkpoint's round (actors/round_record.py); `layout`: the driver's."""
        self.cfg = OmegaConf.create(cfg)
        self.run_dir, self.run_id = run_dir, run_id
        self.layout = layout or layout_of(self.cfg)
        self.spr = self.layout.steps_per_round
        self.state = RunState.load(run_dir, run_id)  # another run's state is never loaded
        configured = self.layout.with_indices(self.state.replica_indices).topology
        topology = topology_of_run(configured, run_dir, run_id)  # + joined sites
        self.state.replica_indices = dict(topology.index_table)
        self.state.supervisor_starts += 1
        self.record = SupervisorRecord(self.cfg, run_dir, self.state, resolved_config, resume_round)
        self.log, self.warn = self.record.log, self.record.warn
        self.roster = Roster(
            topology,
            run_id,
            self.state,
            self.log,
            call_timeout_s=self.cfg.supervisor.call_timeout_s,
            spares_per_cluster=self.cfg.topology.spares_per_cluster,
            save=self.record.save_state,
        )
        w = self.cfg.watchdog
        self.clock = PhaseClock(multiple=w.multiple, floor_s=w.floor_s, ceiling_s=w.ceiling_s)
        self.injector = FaultInjector(self.cfg, self.layout, run_dir, self.state, self.log, save=self.record.save_state)
        self.ports = self._ports(topology)  # the store's fields are set when run() starts it
        self.quarantine = Quarantine(
            self.cfg,
            run_id,
            run_dir,
            self.state,
            self.roster,
            self.log,
            self.record.save_state,
            injected=self.injector.explains_death,
        )
        self.roster.on_death = self.quarantine.death
        self.sites = SiteChanges(
            self.cfg, run_dir, topology, self.roster, self.log, self.state, self.record.save_state, resume_round
        )
        self.stop_requested = False
        self.close = RoundClose(self.ports, self.record)
        self.record.save_state()
        self.log.event("supervisor_start", starts=self.state.supervisor_starts, pid=os.getpid())

    def _ports(self, topology) -> RunnerPorts:
        """What the round's runner, the checkpoints and the round's close may touch."""
        return RunnerPorts(
            roster=self.roster,
            log=self.log,
            injector=self.injector,
            clock=self.clock,
            run_id=self.run_id,
            set_status=self.record.set_status,
            save_epoch=self._save_epoch,
            store=None,
            store_addr=None,
            run_dir=self.run_dir,
            stack_dumps=bool(self.cfg.watchdog.stack_dumps),
            cfg=self.cfg,
            state=self.state,
            save_state=self.record.save_state,
            warn=self.warn,
            steps_per_round=self.spr,
            topology=topology,
            layout=self.layout,
        )

    @property
    def topology(self):
        """The run's topology now: the configured sites, widened or narrowed by site changes (ports hold it)."""
        return self.ports.topology

    # -- status channel (answers while a phase runs) -----------------------------------------------------
    @ray.method(concurrency_group="status")
    def status(self) -> dict:
        return dict(self.record.view)

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
        self.injector.record_fired("supervisor", "crash", "now", self.record.view.get("round"))
        os._exit(17)

    def _start_store(self) -> tuple:
        """The groups' store, listening on this node's address only (never the wildcard), and the
        rendezvous address replicas join under: `host:port/<secret>`, a fresh secret of 128 random
        bits per store, so nobody outside the run can name a group (the store has no auth)."""
        from hsgd.train.comm import new_run_secret, rendezvous_address, start_store

        host = ray.util.get_node_ip_address()
        store = start_store(host, self.cfg.comm.configure_timeout_s)
        return store, rendezvous_address(host, store.port, new_run_secret())

    @ray.method(concurrency_group="run")
    def run(self) -> dict:
        """Drive rounds until train.rounds are committed, a stop is requested, or the run fails;
        returns summary.json's content (also written); re-issued by the driver to a restarted one.
        Never raises: any exception ends the run `failed` (its type and message the reason), with a
        summary all the same; so does a run folder failing writes past run.io_grace_s, while a
        shorter outage at the end is waited out, so its records land."""
        start = time.time()
        roster, status, reason = self.roster, "completed", None
        try:
            self.ports.store, self.ports.store_addr = self._start_store()
            self.record.set_status(phase="waiting_for_replicas")
            roster.rejoin(self.cfg.supervisor.quorum_wait_s)
            self._await_idle()
            self.close.initial_eval()
            self.close.catch_up()
            while True:
                self.record.check_storage()
                r = self._bring_back()
                if r >= self.cfg.train.rounds:
                    break
                if self.stop_requested:
                    status, reason = "stopped", f"stop requested; stopped after round {r}"
                    self.log.event("run_stopped", round=r)
                    break
                self.ports.topology = self.sites.at_round_start(r)  # site requests: drain, join
                if r == 0:
                    self.close.initial_eval()  # (none yet when no replica was up at the start)
                self._round(r)
            self._final_heal()
            checkpointing.save_model(self.ports)
            self.record.settle_storage()
        except RunFailed as err:
            status, reason = "failed", str(err)
        except Exception as err:  # noqa: BLE001 — a bug or a failure nobody foresaw: the run still ends with its summary
            status, reason = "failed", f"{type(err).__name__}: {err}"
            self.warn(f"the supervisor raised, the run ends failed:\n{traceback.format_exc()}")
        if status == "failed":
            self.log.event("run_failed", reason=reason)
        summary = self.close.summary(status, reason, start)
        quarantined = len(self.state.quarantined)
        return self.record.publish(
            {**summary, "topology": self.sites.at_run_end(), "replicas_quarantined": quarantined}
        )

    def _bring_back(self) -> int:
        """Between rounds: hot spares take the ids of the dead, restarted replicas rejoin; the round to run."""
        roster = self.roster
        for rid in roster.missing() + sorted(roster.gone):  # (a quarantined id takes none: takes_spare)
            if (
                rid not in roster.live
                and takes_spare(rid, self.state.quarantined)
                and (answer := roster.promote_spare(rid, wait_s=1.0)) is not None
            ):
                roster.admit(rid, answer)
        boundary = self.cfg.supervisor.rejoin == "boundary"
        roster.rejoin(self.cfg.supervisor.rejoin_wait_s if boundary and roster.missing() else 0.0)
        roster.refresh()
        return current_round(roster.live.values())

    def _settings(self, plan: StepPlan | None = None) -> RoundSettings:
        """The next round's settings: hsgd.core.round.machine.round_settings says why each deadline is what it is."""
        return round_settings(
            steps_per_round=self.spr,
            sync=self.cfg.sync,
            supervisor=self.cfg.supervisor,
            comm=self.cfg.comm,
            param_bytes=self.roster.param_bytes,
            clock=self.clock,
            cluster_steps=plan.steps if plan else (),
            clusters=self.topology.clusters,
            close_s=self._close_s(),
        )

    def _recorded_close(self, r: int) -> dict:
        """sync.balance=time: round r's close and late clusters, as a predecessor recorded them (RoundClosed, Late)."""
        saved = self.state.round_plan or {}
        if saved.get("round") != r or self.cfg.sync.balance != "time" or "closed_at" not in saved:
            return {}
        return {"closed_at": {int(c): int(n) for c, n in saved["closed_at"].items()}, "late": saved.get("late", [])}

    def _close_s(self) -> float | None:
        """sync.balance=time: when this round's inner phases close (hsgd/core/round/balance.py); None otherwise."""
        if self.cfg.sync.balance != "time":
            return None
        gone = self.roster.drained_clusters  # a drained site's step time never sets the close
        learned = [
            None if c in gone else self.clock.median(f"inner_step/c{c}", None) for c in range(self.topology.clusters)
        ]
        return close_after_s(self.cfg.sync.round_s, self.spr, learned, lead_s=RoundSettings.yield_lead_s)

    def _plan(self, r: int) -> StepPlan | None:
        """sync.balance=steps: round r's inner steps per cluster (hsgd/core/round/balance.py), planned once
        and saved before any call; a successor, or a retry of the round, follows the recorded plan."""
        if self.cfg.sync.balance != "steps":
            return None
        clusters = range(self.topology.clusters)
        gone = self.roster.drained_clusters  # a drained site's step times never set the others' steps
        plan, fresh = plan_for_round(
            r,
            self.state.round_plan,
            steps_per_round=self.spr,
            configured=[None if c in gone else self.layout.expected_step_s(c) for c in clusters],
            learned=[None if c in gone else self.clock.median(f"inner_step/c{c}", None) for c in clusters],
        )
        if fresh:
            self.state.round_plan = plan.to_dict()
            self.record.save_state()
        s = self.cfg.sync  # a delay clamped to a shorter plan is recorded with it
        every = s.inner_every if s.inner == "localsgd" else 1
        self.log.event(
            "round_plan",
            round=plan.round,
            steps=list(plan.steps),
            step_s=list(plan.step_s),
            source=plan.source,
            **(
                {"fragment_delay": [fragment_delay_of(s.fragment_delay, n, every) for n in plan.steps]}
                if s.fragment_delay
                else {}
            ),
        )
        return plan

    def _round(self, r: int) -> None:
        """Run round r through the machine; record it, or restore / wait for quorum / fail."""
        roster = self.roster
        settings = self._settings(self._plan(r))
        machine = RoundMachine(
            self.topology,
            settings,
            r,
            progress=roster.available(self.cfg.supervisor.phase_timeout_s),  # (not replicas whose late call runs)
            leaders=roster.leaders,
            epoch=self.state.epoch,
            committed_round=self.state.committed_round,
            configured=roster.configured,
            outer_configured=roster.outer_configured,
            benched=self.state.benched,  # non-finite: durable, until a resume
            non_finite_rounds=self.state.non_finite_rounds,
            **self._recorded_close(r),
        )
        self.injector.supervisor_faults(r, "inner")
        run = RoundRunner(machine, self.ports)
        run.drive()
        self.state.epoch = machine.epoch
        roster.leaders, roster.configured = machine.leaders, machine.configured_groups()
        roster.outer_configured = machine.outer_configured
        self.state.benched = sorted(machine.benched)
        self.state.non_finite_rounds = {str(c): r_nf for c, r_nf in machine.non_finite_rounds.items()}
        self.record.save_state()
        if machine.outcome == "committed":
            self.close.committed(r, machine, run.record)
            return
        self._await_idle()  # a round that ended early may leave calls in flight: never call a busy replica
        if machine.outcome == "restore":
            try:
                restored = checkpointing.restore(self.ports, machine.reason)
            except checkpointing.RestoreFailed as err:
                raise RunFailed(f"{machine.reason}; {err}") from err
            self.state.committed_round = restored
            self.record.save_state()
        elif machine.outcome == "below_quorum":
            self._await_quorum(machine.reason)
        else:
            raise RunFailed(machine.reason)

    def _await_quorum(self, reason: str) -> None:
        sup = self.cfg.supervisor
        self.log.event("quorum_wait", reason=reason, wait_s=sup.quorum_wait_s)
        self.record.set_status(phase="quorum_wait")
        deadline = time.monotonic() + sup.quorum_wait_s
        while time.monotonic() < deadline:
            self.record.check_storage()
            self.roster.rejoin(min(5.0, max(0.0, deadline - time.monotonic())))
            live, topo = self.roster.live, self.topology
            counts = [sum(rid in live for rid in topo.cluster_members(c)) for c in range(topo.clusters)]
            if quorum_problem(counts, self.topology.floors(sup.min_replicas_per_cluster), sup.min_clusters) is None:
                return
        raise RunFailed(f"quorum lost: {reason}; waited {sup.quorum_wait_s:.0f}s for replicas to return")

    def _await_idle(self) -> None:
        comm = self.cfg.comm
        self.roster.await_idle(
            comm.configure_timeout_s + comm.timeout_s + self.cfg.watchdog.floor_s,
            lambda busy: self.record.set_status(phase="waiting_for_replicas", busy=busy),
            TICK_S,
            min_gbps=float(comm.min_gbps),
        )

    def _save_epoch(self, epoch: int) -> None:
        """A group is formed under `epoch`: saved before it exists, so a successor never reuses it."""
        if epoch > self.state.epoch:
            self.state.epoch = epoch
            self.record.save_state()

    def _final_heal(self) -> None:
        """Replicas back from the last round (or admitted behind at its boundary) heal before the run ends."""
        roster = self.roster
        if roster.missing():
            self.record.set_status(phase="final_heal")
            roster.rejoin(self.cfg.supervisor.rejoin_wait_s)
        heals_by_cluster = heals_at_rest(self.topology, roster.available(self.cfg.supervisor.phase_timeout_s))
        if not heals_by_cluster:
            return
        top = current_round(roster.live.values())
        for c, heals in heals_by_cluster.items():
            phase = Phase(
                id=-1,
                kind=CallKind.HEAL,
                round=top,
                cluster=c,
                epoch=self.state.epoch,
                calls={h.target: Heal(h.source, h.scope) for h in heals},
            )
            heal_at_rest(phase, self.ports, roster.live, self._settings().heal_s)
        roster.refresh()
        view = roster.plan(self.state.epoch)
        self.record.set_status(
            members={f"c{c}": list(m) for c, m in view.members.items()},
            leaders={f"c{c}": r for c, r in view.leaders.items()},
        )
