"""The supervisor's record. `SupervisorRecord`, of the run: the run log (events, metrics, every
file the supervisor writes, through the log's writer thread with a deadline), durable-state saves,
status.json, wandb and the summary. Storage never masters the run loop: records wait in memory while
the run folder fails; only one unwritable for `run.io_grace_s` ends the run.

`RoundRecord`, of one round: the replicas' numbers, the phase timings and the round's events. It
decides nothing and calls nobody: the runner hands it each answer and each PhaseEnded.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from omegaconf import OmegaConf

from hsgd.core.deadlines import storage_problem
from hsgd.core.round import (
    AbortJoin,
    CallKind,
    Late,
    NonFinite,
    Outcome,
    Phase,
    PhaseAnswer,
    PhaseEnded,
    RoundClosed,
    Yield,
)
from hsgd.core.topology import parse_replica_id
from hsgd.record.events import RunLog
from hsgd.record.run_state import STATE_FILE, RunState
from hsgd.record.rundir import write_deadline_s
from hsgd.record.wandb import WandbSink


class RunFailed(RuntimeError):
    """The run ends failed; the message is the summary's reason."""


class SupervisorRecord:
    def __init__(self, cfg, run_dir: str, state: RunState, resolved_config: dict, resume_round: int | None):
        """`resume_round`: the resumed checkpoint's round (a first start drops later, retrained, rounds' metrics)."""
        self.run_dir, self.state = run_dir, state
        self.io_grace_s = float(cfg.run.io_grace_s)
        self.log = RunLog(run_dir, warn=self.warn, write_timeout_s=write_deadline_s(self.io_grace_s))
        first = state.supervisor_starts == 1
        if first and resume_round is not None:
            self.log.rewrite_metrics([m for m in self.log.records("metrics") if m.get("round", 0) < resume_round])
        self.view: dict[str, Any] = {"phase": "starting", "round": 0, "epoch": state.epoch}
        self.wandb = WandbSink(
            cfg if first else OmegaConf.merge(cfg, {"logging": {"wandb": {"mode": "disabled"}}}),
            run_dir,
            resolved_config if first else {},
            on_error=self._wandb_failed,
            finish_s=max(5.0, self.io_grace_s / 2),
        )

    def save_state(self) -> None:
        """The durable state, whole, through the run log: waits at most the write deadline; a
        failure is the folder's health (run_dir_unwritable), and the next save writes it all again."""
        self.log.write_file(STATE_FILE, self.state.to_json())

    @staticmethod
    def warn(message: str) -> None:
        """A warning on the console (the driver's, through Ray's log forwarding); never raises."""
        with contextlib.suppress(Exception):  # even the console may be a full disk
            print(f"[hsgd] warning: {message}", file=sys.stderr, flush=True)

    def _wandb_failed(self, what: str, error: str) -> None:
        self.log.event("write_failed", what=what, error=error)
        self.warn(f"{what} failed, wandb logging is off for the rest of the run: {error}")

    def set_status(self, **fields) -> None:
        """The live view: answered by the supervisor's status() and mirrored to status.json for jobs.status."""
        self.view.update(fields, updated=time.time())
        # best effort, never waited for: a write still queued is replaced by this newer view
        self.log.write_file("status.json", json.dumps(self.view, default=str), wait=False)

    def check_storage(self) -> None:
        problem = storage_problem(*self.log.unwritable_s(), grace_s=self.io_grace_s, run_dir=self.run_dir)
        if problem is not None:
            raise RunFailed(problem)

    def settle_storage(self) -> None:
        """The run's end with the folder failing or records in memory: retry (writing status.json, which
        tells when the folder is back) until all is written, or RunFailed once the outage passes run.io_grace_s."""
        while self.log.unwritable_s()[0] > 0 or not self.log.flush():
            self.check_storage()
            self.set_status(phase="waiting_for_storage")
            time.sleep(0.5)

    def publish(self, summary: dict) -> dict:
        """Write summary.json (within the write deadline), close; returned even unwritten: the driver prints it."""
        if not self.log.write_file("summary.json", json.dumps(summary, indent=2, sort_keys=True)):
            down_s, error = self.log.unwritable_s()
            self.warn(
                f"summary.json could not be written to {self.run_dir} ({error or 'the write timed out'}); "
                f"the driver prints it"
            )
        self.wandb.finish(summary)
        self.log.event("run_end", status=summary["status"])
        self.set_status(phase="done", status=summary["status"])
        self.log.flush(self.log.writer.deadline_s)
        return summary


class RoundRecord:
    def __init__(self, round_index: int, log, clock):
        self.r, self.log, self.clock = round_index, log, clock
        self.losses: dict[str, list[float]] = {}
        self.tokens = self.inner_bytes = self.outer_bytes = self.attempted_steps = 0
        self.seconds = {kind.seconds_key: 0.0 for kind in CallKind}  # metrics.jsonl's `seconds`
        self.inner_participants: set[str] = set()
        self.late_steps = 0  # sync.balance=time: replica-steps of late clusters, lost to the round
        self.commit_digests: dict[str, str] = {}
        self.global_digests: dict[str, str] = {}
        self.attempts = 1
        self.heals_done: dict[str, tuple[int, str]] = {}  # target -> (bytes, transport: group | object_store)
        self.steps_run: dict[int, int] = {}  # run_inner phase id -> steps its members ran
        self.join_s: dict[int, float] = {}  # phase id -> the longest its members took to form their group
        # outer_reduce phase id -> its slowest holder's time in the outer collectives (the link's wait
        # included: holders exchange at once); and whether every holder's reduce ran behind the inner steps
        self.outer_link_s: dict[int, float] = {}
        self.reduce_overlapped: dict[int, bool] = {}
        # cluster -> its holders' slow-link bytes sent + received (every attempt); outer_reduce phase id ->
        # the exchange its holders ran (sync.outer_exchange, decided by the group's size: one per phase)
        self.cluster_link_bytes: dict[int, int] = {}
        self.exchanges: dict[int, str] = {}
        self.non_finite_what: dict[str, str] = {}  # rid -> what its non_finite answer named (loss | grad_norm | ...)
        self.logged_void: set[int] = set()
        self.logged_benched: set[int] = set()

    def yield_requested(self, e: Yield) -> None:
        self.log.event(
            "yield_requested",
            cluster=e.cluster,
            round=self.r,
            reason=e.reason,
            at_step=e.at_step,
            replicas=sorted(e.rids),
        )

    def join_aborted(self, e: AbortJoin) -> None:
        self.log.event(
            "join_aborted",
            cluster=e.cluster,
            round=self.r,
            epoch=e.epoch,
            prefix=e.prefix,
            dead=list(e.dead),
            reason=e.reason,
        )

    def closed(self, e: RoundClosed, close_s: float | None) -> None:
        """sync.balance=time: the round's close, each cluster's asked step."""
        self.log.event("round_closed", round=self.r, close_s=close_s, steps=dict(e.ends))

    def late(self, e: Late) -> None:
        """sync.balance=time: a late cluster's steps are lost to the round; its members take no part in it."""
        self.late_steps += e.steps * len(e.members)
        self.inner_participants.difference_update(e.members)
        self.log.event(
            "site_late",
            cluster=e.cluster,
            round=self.r,
            steps=e.steps,
            replicas=list(e.members),
            waiting_on=list(e.abandoned),
            reason=e.reason,
        )

    @property
    def outer_exchange(self) -> str | None:
        """The exchange of the round's last outer reduce (the committed one); None when none ran."""
        return self.exchanges[max(self.exchanges)] if self.exchanges else None

    @property
    def outer_overlapped(self) -> bool:
        """The committed exchange's reduce (the round's last) ran behind the inner steps on every holder."""
        return bool(self.reduce_overlapped) and self.reduce_overlapped[max(self.reduce_overlapped)]

    def phase_begun(self, phase: Phase, leaders: dict[int, str], cluster_of) -> None:
        """phase_begin; a `membership` of the group a phase forms (not the whole run's view: O(clusters²)
        when every cluster forms its group), and `cluster_reform` for a cluster re-formed."""
        log, inner = self.log, phase.kind is CallKind.RUN_INNER
        log.event(
            "phase_begin",
            phase=phase.kind.record,
            round=self.r,
            cluster=phase.cluster,
            epoch=phase.epoch,
            replicas=sorted(phase.calls),
            reason=phase.reason or None,
        )
        if inner:
            self.inner_participants.update(phase.calls)
        if not phase.forms_group:
            return
        if inner:
            members, leads = {f"c{phase.cluster}": list(phase.calls)}, {f"c{phase.cluster}": leaders.get(phase.cluster)}
        else:  # the leaders' group (one per shard): one per round at most
            members = {f"c{cluster_of(rid)}": [rid] for rid in phase.calls}
            leads = {f"c{cluster_of(rid)}": rid for rid in phase.calls}
        log.event(
            "membership",
            epoch=phase.epoch,
            members=members,
            leaders=leads,
            standby=[],
            level="inner" if inner else "outer",
            cluster=phase.cluster,
        )
        if inner and phase.reason != "round start":
            log.event(
                "cluster_reform",
                cluster=phase.cluster,
                round=self.r,
                epoch=phase.epoch,
                members=sorted(phase.calls),
                reason=phase.reason,
            )

    def answered(self, phase: Phase, answer: PhaseAnswer) -> None:
        """One call's answer (the replica's, or the one the runner made of Ray's error for it)."""
        kind, rid, outcome, value = phase.kind, answer.rid, answer.outcome, answer.result
        if value.get("join_s"):
            self.join_s[phase.id] = max(self.join_s.get(phase.id, 0.0), value["join_s"])
        if kind is CallKind.RUN_INNER and "report" in value:
            rep = value["report"]
            self.steps_run[phase.id] = max(self.steps_run.get(phase.id, 0), rep["steps_done"])
            self.tokens += rep["tokens"]
            self.inner_bytes += rep["inner_bytes"]
            self.attempted_steps += rep["steps_done"]
            self.losses.setdefault(rid, []).extend(rep["losses"])
        if kind is CallKind.OUTER_REDUCE:
            self.outer_bytes += value.get("outer_bytes", 0)
            self.outer_link_s[phase.id] = max(self.outer_link_s.get(phase.id, 0.0), value.get("outer_link_s", 0.0))
            self.reduce_overlapped[phase.id] = self.reduce_overlapped.get(phase.id, True) and bool(
                value.get("overlapped")
            )
            cluster = parse_replica_id(rid)[0]
            self.cluster_link_bytes[cluster] = self.cluster_link_bytes.get(cluster, 0) + value.get(
                "outer_link_bytes", 0
            )
            if value.get("outer_exchange"):
                self.exchanges[phase.id] = value["outer_exchange"]
        if kind is CallKind.OUTER_COMMIT and outcome == Outcome.DONE:
            self.inner_bytes += value.get("inner_bytes", 0)
            self.commit_digests[rid] = value["digest"]
            self.global_digests[rid] = value["global_digest"]
        if kind is CallKind.HEAL and outcome == Outcome.DONE:
            self.heals_done[rid] = (value.get("bytes", 0), value.get("transport", "object_store"))
        if outcome == Outcome.NON_FINITE:
            self.non_finite_what.setdefault(rid, answer.what)  # logged once per cluster
        elif outcome not in (Outcome.DONE, Outcome.DIED, Outcome.YIELDED):
            self.log.event(
                "collective_failed" if outcome == Outcome.COLLECTIVE_FAILED else "replica_error",
                rid=rid,
                phase=kind.record,
                round=self.r,
                cluster=phase.cluster,
                outcome=outcome.value,
                detail=answer.error[:300],
                **({"error_kind": answer.error_kind.value} if answer.error_kind else {}),
            )

    def phase_ended(self, ended: PhaseEnded) -> None:
        phase, seconds = ended.phase, max(0.0, ended.ended - ended.started)
        join_s = min(seconds, self.join_s.pop(phase.id, 0.0))  # forming the group, in the same call
        failed = {rid: how.split(": ", 1) for rid, how in ended.answers.items() if how not in ("done", "yielded")}
        ok = sorted(rid for rid, how in ended.answers.items() if how == "done")
        yielded = sorted(rid for rid, how in ended.answers.items() if how == "yielded")
        self.log.event(
            "phase_end",
            phase=phase.kind.record,
            round=self.r,
            cluster=phase.cluster,
            seconds=seconds,
            ok=ok,
            failed=failed,
            **({"yielded": yielded} if yielded else {}),
        )
        key, work_s = phase.kind.seconds_key, seconds - join_s
        self.seconds[key] = max(self.seconds[key], work_s) if key == "inner" else self.seconds[key] + work_s
        self.seconds["heal_configure"] += join_s
        if phase.kind is CallKind.HEAL:
            for rid in ok:
                heal, (nbytes, transport) = phase.calls[rid], self.heals_done.get(rid, (None, "object_store"))
                self.log.event(
                    "heal_end",
                    target=rid,
                    source=heal.source,
                    scope=heal.scope,
                    seconds=seconds,
                    bytes=nbytes,
                    gbps=round(nbytes * 8 / 1e9 / seconds, 4) if nbytes and seconds else None,
                    transport=transport,
                )
        if not failed and phase.kind in (CallKind.OUTER_REDUCE, CallKind.OUTER_COMMIT):
            self.clock.observe(phase.kind.record, work_s, 1)
        steps_run = self.steps_run.pop(phase.id, 0)
        if phase.kind is CallKind.RUN_INNER and not failed and steps_run:
            # the step deadline's sure sample: progress polls may never land inside a short phase,
            # and without samples the deadline is the ceiling (a hang would go unseen for minutes)
            self.clock.observe("inner_step", work_s, steps_run)
            self.clock.observe(f"inner_step/c{phase.cluster}", work_s, steps_run)  # sync.balance plans by these
        if phase.kind is CallKind.RUN_INNER and failed:
            self.attempts += 1

    def non_finite(
        self, void: dict[int, NonFinite], out: set[int], benched_now: dict[int, str], *, final: bool
    ) -> None:
        """One `non_finite` per void cluster and round after its phase (`rids`: its reporters); a benched one warns."""
        for c, nf in void.items():
            if c not in self.logged_void and (final or c in out):
                self.logged_void.add(c)
                self.log.event(
                    "non_finite",
                    rid=nf.rids[0],
                    rids=list(nf.rids),
                    cluster=c,
                    round=self.r,
                    phase=nf.phase.record,
                    what=self.non_finite_what.get(nf.rids[0], ""),
                    detail=nf.detail[:300],
                )
        for c, reason in benched_now.items():
            if c not in self.logged_benched:
                self.logged_benched.add(c)
                self.log.event("cluster_benched", cluster=c, round=self.r, reason=reason)
                print(f"[hsgd] WARNING: cluster c{c} benched: {reason}", flush=True)

    def void_not_counted(self, members_of_void: list[str]) -> None:
        """A void cluster's work is not the round's: its steps were not committed."""
        for rid in members_of_void:
            self.inner_participants.discard(rid)
            self.losses.pop(rid, None)
