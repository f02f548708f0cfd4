"""What the supervisor does once a round is over, carried out for it: the committed round's record
(metrics, the commit event, wandb, status), evaluations, the checkpoint due; after a supervisor
restart, the rounds its predecessor committed unrecorded (catch-up); at the run's end, the summary.
It decides nothing: when to evaluate, checkpoint or record late is hsgd.core.round's (`due`,
`unrecorded_rounds`, `evaluation_order`).
"""

from __future__ import annotations

import itertools
import time
import traceback

import ray

from actors import checkpointing
from actors.round_record import SupervisorRecord
from actors.round_runner import RunnerPorts
from hsgd.config.rounds import is_streaming
from hsgd.core.outer_plan import params_agree
from hsgd.core.round import RoundMachine, current_round, due, evaluation_order, unrecorded_rounds
from hsgd.record.metrics import committed_tokens, fallback_summary, late_round_record, round_record, run_summary
from hsgd.record.outer_watch import OuterStepWatch, cluster_trends


class RoundClose:
    def __init__(self, ports: RunnerPorts, record: SupervisorRecord):
        self.p, self.record, self.cfg = ports, record, ports.cfg
        self.attempted_steps = self.committed_steps = 0
        self.participation: list[float] = []
        o = self.cfg.optim.outer
        self.outer_watch = OuterStepWatch(
            f"optim.outer.lr={o.lr}, optim.outer.momentum={o.momentum}, optim.outer.nesterov={o.nesterov}"
        )

    def initial_eval(self) -> None:
        """The loss before any training, once per run (a restarted supervisor finds it in the state).
        With no replica up yet (a first start slower than supervisor.quorum_wait_s) it waits: the
        supervisor asks again at round 0's start, once its replicas are back."""
        state = self.p.state
        if not state.evaluated and self.p.roster.live:
            state.initial_eval_loss, state.evaluated = self.evaluate(), True
            self.record.save_state()
            self.p.log.event("initial_eval", eval_loss=state.initial_eval_loss)

    def committed(self, r: int, machine: RoundMachine, run) -> None:
        """Round r committed: record it (`run`: the round's actors.round_record.RoundRecord)."""
        p, state = self.p, self.p.state
        steps_of, topo = machine.steps_taken, p.topology
        cluster_tokens = committed_tokens(run.commit_digests, topo, steps_of, p.roster.tokens_per_step)
        state.tokens_per_cluster = [
            n + t
            for n, t in itertools.zip_longest(  # saved with the commit
                state.tokens_per_cluster, cluster_tokens, fillvalue=0
            )
        ]
        state.committed_round = r + 1
        self.record.save_state()
        self.committed_steps += sum(steps_of(topo.cluster_of(rid)) for rid in run.inner_participants)
        self.attempted_steps += run.attempted_steps
        self.participation.append(len(run.inner_participants) / topo.num_replicas)
        p.roster.refresh()
        p.log.event(
            "commit",
            round=r,
            epoch=machine.epoch,
            replicas=sorted(run.commit_digests),
            # fragments or a mixing weight: working params agree within each cluster only (invariant 1)
            digests_agree=params_agree(run.commit_digests, topo, streaming=is_streaming(self.cfg)),
        )
        eval_loss = self.evaluate() if due(r + 1, self.cfg.train.eval_every, self.cfg.train.rounds) else None
        record = round_record(
            run,
            steps_per_round=p.steps_per_round,
            eval_loss=eval_loss,
            epoch=machine.epoch,
            t=time.time(),
            cluster_steps=[steps_of(c) for c in range(topo.clusters)],
            cluster_tokens=cluster_tokens,
        )
        p.log.metrics(record)  # before the checkpoint: a crash there must not lose the round's record
        if self.cfg.sync.outer == "diloco" and (
            warning := self.outer_watch.observe(r, eval_loss, cluster_trends(run.losses, topo.cluster_of))
        ):
            p.log.event("outer_step_warning", round=r, detail=warning)
            p.warn(warning)
        self.record.wandb.log_round(record)
        self.record.set_status(
            round=r + 1,
            last_loss=record["loss"],
            last_eval_loss=eval_loss,
            tokens_per_s=record["tokens_per_s"],
            inner_step=record["inner_step"],
        )
        self._checkpoint_if_due(r + 1)

    def _checkpoint_if_due(self, state_round: int) -> None:
        if self.cfg.checkpoint.every and due(state_round, self.cfg.checkpoint.every, self.cfg.train.rounds):
            checkpointing.save(self.p, state_round)

    def evaluate(self) -> float | None:
        roster = self.p.roster
        for rid in evaluation_order(self.p.topology, roster.live, roster.leaders):
            try:
                return float(
                    ray.get(roster.handles[rid].evaluate.remote(), timeout=self.cfg.supervisor.phase_timeout_s)
                )
            except Exception as err:  # noqa: BLE001 — that replica's failure; ask the next one
                roster.down_after(rid, err, "evaluate", -1)
        return None

    def catch_up(self) -> None:
        """After a supervisor restart: record rounds the old one committed unrecorded; take the checkpoint it owed."""
        p, state = self.p, self.p.state
        p.roster.refresh()
        r_now = current_round(p.roster.live.values())
        if r_now > state.committed_round:
            state.committed_round = r_now
            self.record.save_state()
        if r_now == 0:
            return
        for missing in unrecorded_rounds(r_now, (m["round"] for m in p.log.records("metrics"))):
            last = missing == r_now - 1  # only the last one's state is still there to digest and evaluate
            asked = p.roster.ask_all("digests", self.cfg.supervisor.call_timeout_s) if last else {}
            digests = {rid: d["param"] for rid, d in sorted(asked.items()) if d["round"] == r_now}
            p.log.metrics(
                late_round_record(
                    round_index=missing,
                    steps_per_round=p.steps_per_round,
                    live_replicas=len(p.roster.live),
                    epoch=state.epoch,
                    digests=digests,
                    eval_loss=self.evaluate() if last else None,
                    t=time.time(),
                )
            )
            p.log.event("round_recorded_late", round=missing)
        self._checkpoint_if_due(r_now)

    def summary(self, status: str, reason: str | None, start: float) -> dict:
        """The summary from the record (files and memory), else from the durable state alone: owed whatever broke."""
        p, log = self.p, self.p.log
        try:
            return run_summary(
                status=status,
                reason=reason,
                durable=p.state.to_dict(),
                steps_per_round=p.steps_per_round,
                digests=p.roster.ask_all("digests", self.cfg.supervisor.call_timeout_s),
                metrics=log.records("metrics"),
                fired=log.read_jsonl("faults_fired.jsonl"),
                events=log.records("events"),
                not_fired=p.injector.not_fired(),
                committed_steps=self.committed_steps,
                attempted_steps=self.attempted_steps,
                participation=self.participation,
                supervisor_started=start,
                now=time.time(),
                run_dir=p.run_dir,
            )
        except Exception as err:  # noqa: BLE001
            p.warn(f"the full summary could not be made:\n{traceback.format_exc()}")
            note = f"summary from the durable state only ({type(err).__name__}: {err})"
            return fallback_summary(
                status=status,
                reason=f"{reason}; {note}" if reason else note,
                durable=p.state.to_dict(),
                metrics=log.records("metrics"),
                steps_per_round=p.steps_per_round,
                now=time.time(),
                run_dir=p.run_dir,
                supervisor_started=start,
            )
