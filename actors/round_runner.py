"""Carrying out one round machine's effects with Ray, and turning what Ray says into the machine's
observations. It decides nothing (hsgd/core/round/__init__.py says what happens after any failure)
and keeps no record of calls in flight (hsgd/core/round/calls.py): it maps Ray refs to call ids.

    Phase      one Ray call per replica (heals through actors/heals.py); the answer, or Ray's
               error for it as messages.raised classifies it (`error`: killed restartable), as an Answer
    Kill       hang report with every stack of its group, then kill (actors/hang.py)
    Reap       logged only: its process is gone and Ray restarts it already
    Yield      request_yield on each member's control channel (no answer waited for)
    Late       site_late in the record; the abandoned calls go to the roster (`late`), which holds
               their replicas out of every round until the calls end
    AbortJoin  the group's rendezvous is released in the run's store (hsgd.train.comm)
    StepTimed  a sample for the learned step deadline; PhaseEnded: phase_end in the record

Every tick (TICK_S), and at once after an answer of a broken collective (a peer's death shows there
first), it reads the steps of replicas in run_inner off the run's progress board in one store round
trip (hsgd/train/progress_board.py; by calls if it fails), asks replicas that are down whether they
are back (Up), reads deaths and restarts from Ray's actor table (Lost; an idle replica is asked
whether it runs, every IDLE_POLL_S, only while the table does not list its actor; the questions:
actors/probes.py) and ticks the machine's clock. Every wait is bounded: one `ray.wait` of at most TICK_S.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.hang import kill_hung
from actors.heals import Heals
from actors.probes import Probes
from actors.replica_calls import FETCH_S, call, progress_board, up
from actors.round_record import RoundRecord
from hsgd.config.layout import RunLayout
from hsgd.config.schema import HsgdConfig
from hsgd.core.quarantine import takes_spare
from hsgd.core.round import (
    AbortJoin,
    Answer,
    CallKind,
    Kill,
    Late,
    Lost,
    Outcome,
    Phase,
    PhaseAnswer,
    PhaseEnded,
    Reap,
    RoundClosed,
    RoundMachine,
    StepTimed,
    Yield,
    raised,
)
from hsgd.train.comm import abort_rendezvous

TICK_S = 0.5  # how often the machine's clock ticks and in-flight replicas are asked for progress
IDLE_POLL_S = 2.0  # how often live replicas with no call in flight are asked whether they still run
STATUS_MIN_S = 0.1  # status.json is rewritten at most this often (it is O(replicas) to build)


@dataclass
class RunnerPorts:
    """What a round's runner, actors/checkpointing.py and the final heal may touch: never the supervisor itself."""

    roster: Any
    log: Any
    injector: Any
    clock: Any
    set_status: Callable[..., None]
    save_epoch: Callable[[int], None]
    store: Any
    store_addr: str | None
    run_id: str
    run_dir: str
    stack_dumps: bool = True
    cfg: HsgdConfig | None = None
    state: Any = None  # hsgd.record.run_state.RunState
    save_state: Callable[[], None] = lambda: None
    warn: Callable[[str], None] = print
    steps_per_round: int = 0
    topology: Any = None  # the run's now (sites joined or drained); the layout's is the configured one
    layout: RunLayout | None = None


class RoundRunner:
    def __init__(self, machine: RoundMachine, ports: RunnerPorts):
        self.m, self.p, self.r = machine, ports, machine.round
        self.calls: dict[Any, tuple[int, str]] = {}  # ref -> call id (phase id, rid)
        self.record = RoundRecord(self.r, ports.log, ports.clock)
        self.heals = Heals(
            ports.roster.handles, ports.log, store_addr=ports.store_addr, run_id=ports.run_id, round_index=self.r
        )
        self.probes = Probes(machine, ports, progress_board(ports, list(ports.roster.handles)))
        self.deaths_logged = 0  # how many of the machine's `deaths` are logged
        self.phase = "starting"  # what the status shows (the view's phase)

    def drive(self) -> None:
        m, roster = self.m, self.p.roster
        self._carry_out(m.start(time.monotonic()))
        last_tick = last_idle = last_status = 0.0
        while not m.done:
            waiting = list(self.calls) + self.probes.refs() + self.heals.watched()
            ready = (
                ray.wait(waiting, num_returns=1, timeout=TICK_S, fetch_local=False)[0]
                if waiting
                else time.sleep(TICK_S) or []
            )
            if ready and len(waiting) > 1:  # and every other answer already in: the machine takes them at once
                ready = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=False)[0]
            seen = [o for ref in ready for o in self._read(ref)]
            self._carry_out(m.observe_all(seen, time.monotonic()) if seen else [])
            now = time.monotonic()
            if now - last_tick >= (
                TICK_S if not any(getattr(o, "outcome", None) == Outcome.COLLECTIVE_FAILED for o in seen) else 0.05
            ):
                last_tick, idle = now, now - last_idle >= IDLE_POLL_S
                self._carry_out(m.observe_all(self.probes.ask(idle=idle), now))
                last_idle = now if idle else last_idle
                if roster.spares:
                    roster.spares.check(self.p.log)
                for rid in roster.deaths(m.progress, self.r, self.phase):  # Ray's actor table
                    if rid not in m.calls.busy:  # no call would ever have said so
                        self.p.log.event(
                            "idle_replica_lost", rid=rid, round=self.r, detail="died while idle (Ray's actor table)"
                        )
                    self._carry_out(m.observe(Lost(rid, "died"), now))
                self._carry_out(m.tick(now))
            self._log_deaths()
            self.record.non_finite(m.void, m.out, m.benched_now, final=False)
            if now - last_status >= STATUS_MIN_S:
                last_status = now
                self._status()
        self._log_deaths()
        self.record.non_finite(m.void, m.out, m.benched_now, final=True)
        self.record.void_not_counted([rid for c in m.void for rid in m.ids[c]])
        self._status()  # the round's final view, before its commit is logged
        # replicas held out of this round (their late calls still ran) stay live; a late cluster's calls still
        # run (or are paused): nobody calls those replicas until they end
        held_out = {rid: roster.live[rid] for rid in roster.late if rid in roster.live}
        roster.live = {**held_out, **m.progress}
        now = time.monotonic()
        roster.late.update({rid: (ref, now) for ref, (_, rid) in self.calls.items() if rid in m.late_members})

    def _carry_out(self, effects: list) -> None:
        p = self.p
        for e in effects:
            if isinstance(e, Phase):
                self._issue(e)
            elif isinstance(e, PhaseEnded):
                self.record.phase_ended(e)
                if e.phase.kind is CallKind.HEAL:
                    self.heals.forget(e.phase.id)
            elif isinstance(e, StepTimed):
                p.clock.observe("inner_step", e.seconds, 1)
                p.clock.observe(f"inner_step/c{self.m.cluster_of(e.rid)}", e.seconds, 1)
            elif isinstance(e, Kill):
                kill_hung(e, p, self.m)
            elif isinstance(e, Reap):  # not killed: a kill now could hit the process Ray is starting
                p.log.event("presumed_dead", rid=e.rid, reason=e.reason)
            elif isinstance(e, Yield):
                self.record.yield_requested(e)
                for rid in e.rids:
                    p.roster.handles[rid].request_yield.remote(e.epoch, e.round, e.at_step)  # control channel
            elif isinstance(e, RoundClosed):  # saved before any yield is asked: a successor follows it
                p.state.round_plan = {"round": e.round, "closed_at": {str(c): step for c, step in e.ends}}
                p.save_state()
                self.record.closed(e, self.m.settings.close_s)
            elif isinstance(e, Late):  # slow, not dead: nobody is killed; its abandoned calls are waited out
                p.state.round_plan = {**p.state.round_plan, "late": [*p.state.round_plan.get("late", []), e.cluster]}
                p.save_state()  # before the commit: a successor leaves it out too
                self.record.late(e)
            elif isinstance(e, AbortJoin):
                self.record.join_aborted(e)
                abort_rendezvous(p.store, p.store_addr, f"{p.run_id}/{e.prefix}", e.reason)
            else:
                raise TypeError(f"not an effect: {e!r}")

    def _issue(self, phase: Phase) -> None:
        p, kind = self.p, phase.kind
        if kind is CallKind.OUTER_COMMIT:
            p.log.event("commit_decision", round=self.r, clusters=sorted({self.m.cluster_of(x) for x in phase.calls}))
        if kind in (CallKind.OUTER_REDUCE, CallKind.OUTER_COMMIT):
            p.injector.supervisor_faults(self.r, kind.record)
        fault_phases = kind.fault_phases + (("join",) if phase.forms_group else ())
        involved = set(phase.calls) | {c.source for c in phase.calls.values() if kind is CallKind.HEAL}
        armed = (
            p.injector.arm(self.r, fault_phases, self.m.plan(), only=involved, handles=p.roster.handles)
            if p.injector.pending(self.r, fault_phases)
            else {}
        )
        self.record.phase_begun(phase, self.m.leaders, self.m.cluster_of)
        if phase.forms_group:
            p.save_epoch(phase.epoch)  # before the group is used: a successor never reuses an epoch
        for rid in phase.calls:
            self.calls[call(phase, rid, armed, p, self.heals, self.m.progress)] = (phase.id, rid)

    def _read(self, ref) -> list:
        if ref in self.calls:
            if ref in self.heals.receives:  # a heal over the group: its answer, or a fallback issued
                phase_id, rid = self.calls[ref]
                after = self.heals.group_answer(ref, waited=rid in self.m.pending(phase_id))
                if after is not ref:
                    self.calls[after] = self.calls.pop(ref)
                    return []
            return [self._answer(ref)]
        if ref in self.probes:
            return self.probes.answer(ref)
        said = self.heals.source_answer(ref)  # a heal source's answer: its state is ready, or it is lost
        if isinstance(said, Lost) and said.cause == "error":  # it raised while giving its state
            self.p.roster.restart_raised(said.rid, self.phase, self.r, "raised while giving its state")
        return [said] if said is not None else []

    def _answer(self, ref) -> Answer:
        phase_id, rid = self.calls.pop(ref)
        flight = self.m.calls.inflight.get(phase_id)
        try:
            answer = PhaseAnswer.read(ray.get(ref, timeout=FETCH_S))
        except Exception as err:  # noqa: BLE001 — whose failure is it? (messages.raised)
            heal = flight is not None and flight.phase.kind is CallKind.HEAL
            outcome = raised(
                actor_gone=isinstance(err, RayActorError),  # died or unavailable
                source_failed=heal and self.heals.source_failed(phase_id, rid),
            )
            detail = type(err).__name__ if outcome == Outcome.DIED else f"{type(err).__name__}: {str(err)[-300:]}"
            answer = PhaseAnswer(rid, outcome, error=detail)
            if outcome == Outcome.ERROR:  # the replica raised: killed, restarted clean
                self.p.roster.restart_raised(rid, self.phase, self.r, detail)
        if flight is not None and rid in flight.pending:  # (a stale answer is not the round's)
            self.record.answered(flight.phase, answer)
        return Answer(phase_id, rid, answer.outcome, answer.round, answer.step, answer.error_kind, answer.error)

    def _log_deaths(self) -> None:
        """Each death the machine took in is logged once (with its incarnation, unless Ray's actor
        table showed it first); with hot spares, a ready one takes over the dead one's id, unless the
        death had it quarantined (hsgd.core.quarantine.takes_spare)."""
        roster = self.p.roster
        for rid, cause in self.m.deaths[self.deaths_logged :]:
            self.deaths_logged += 1
            roster.died(rid, cause, self.phase, self.r)
            self.heals.release_groups_of(
                rid,
                cause,
                partial(abort_rendezvous, self.p.store, self.p.store_addr),
                cluster=self.m.cluster_of(rid),
                epoch=self.m.epoch,
            )
            quarantined = self.p.state.quarantined if self.p.state is not None else {}  # (by this death, maybe)
            if (
                roster.spares
                and rid not in self.m.progress
                and takes_spare(rid, quarantined)
                and (answer := roster.promote_spare(rid)) is not None
            ):
                self.probes.forget(rid)  # the old process's
                roster.note_up(rid, answer)
                self._carry_out(self.m.observe(up(rid, answer), time.monotonic()))

    def _status(self) -> None:
        m, self.phase = self.m, self.m.view_phase
        self.p.set_status(
            epoch=m.epoch,
            phase=self.phase,
            round=self.r,
            members={f"c{c}": list(m.members(c)) for c in m.participating() if m.members(c)},
            leaders={f"c{c}": r for c, r in m.leaders.items()},
        )
