"""The supervisor's record of the run: the run log (events, metrics, and every file the supervisor
writes, each through the log's writer thread with a deadline), the durable state's saves, the live
status view (status.json), wandb, the run folder's grace, and the summary at the run's end.

Storage is never the run loop's master: events and metrics wait in memory while the run folder
fails, and only a folder that stays unwritable for `run.io_grace_s` ends the run (`check_storage`).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

from omegaconf import OmegaConf

from hsgd.core.deadlines import storage_problem
from hsgd.record.events import RunLog
from hsgd.record.run_state import STATE_FILE, RunState
from hsgd.record.rundir import write_deadline_s
from hsgd.record.wandb import WandbSink


class RunFailed(RuntimeError):
    """The run ends failed; the message is the summary's reason."""


class SupervisorRecord:
    def __init__(self, cfg, run_dir: str, state: RunState, resolved_config: dict, resume_round: int | None):
        """`resume_round`: the resumed checkpoint's round; the first incarnation drops the metrics
        of the rounds after it (trained again, each recorded once), as a restore does."""
        self.run_dir, self.state = run_dir, state
        self.io_grace_s = float(cfg.run.io_grace_s)
        self.log = RunLog(run_dir, warn=self.warn, write_timeout_s=write_deadline_s(self.io_grace_s))
        first = state.supervisor_starts == 1
        if first and resume_round is not None:
            self.log.rewrite_metrics([m for m in self.log.records("metrics") if m.get("round", 0) < resume_round])
        self.view: dict[str, Any] = {"phase": "starting", "round": 0, "epoch": state.epoch}
        self.wandb = WandbSink(cfg if first else OmegaConf.merge(cfg, {"logging": {"wandb": {"mode": "disabled"}}}),
                               run_dir, resolved_config if first else {}, on_error=self._wandb_failed,
                               finish_s=max(5.0, self.io_grace_s / 2))

    def save_state(self) -> None:
        """The durable state, whole, through the run log: waits at most the write deadline; a
        failure is the folder's health (run_dir_unwritable), and the next save writes it all again."""
        self.log.write_file(STATE_FILE, self.state.to_json())

    @staticmethod
    def warn(message: str) -> None:
        """A warning on the console (the driver's, through Ray's log forwarding); never raises."""
        try:
            print(f"[hsgd] warning: {message}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 — even the console may be a full disk
            pass

    def _wandb_failed(self, what: str, error: str) -> None:
        self.log.event("write_failed", what=what, error=error)
        self.warn(f"{what} failed, wandb logging is off for the rest of the run: {error}")

    def set_status(self, **fields) -> None:
        """The live view: answered by the supervisor's status() and mirrored to status.json for jobs.status."""
        self.view.update(fields, updated=time.time())
        # best effort, never waited for: a write still queued is replaced by this newer view
        self.log.write_file("status.json", json.dumps(self.view, default=str), wait=False)

    def check_storage(self) -> None:
        """RunFailed when the run folder has failed writes for longer than run.io_grace_s."""
        problem = storage_problem(*self.log.unwritable_s(), grace_s=self.io_grace_s, run_dir=self.run_dir)
        if problem is not None:
            raise RunFailed(problem)

    def settle_storage(self) -> None:
        """The run's end with the folder failing or records still in memory: keep trying (a write
        of status.json each time, which also tells when the folder is back) until everything is
        written, or RunFailed once the outage passes run.io_grace_s."""
        while self.log.unwritable_s()[0] > 0 or not self.log.flush():
            self.check_storage()
            self.set_status(phase="waiting_for_storage")
            time.sleep(0.5)

    def publish(self, summary: dict) -> dict:
        """Write summary.json (waiting at most the write deadline), close the record. A summary
        that cannot be written is still returned: the driver prints it on the console."""
        if not self.log.write_file("summary.json", json.dumps(summary, indent=2, sort_keys=True)):
            down_s, error = self.log.unwritable_s()
            self.warn(f"summary.json could not be written to {self.run_dir} ({error or 'the write timed out'}); "
                      f"the driver prints it")
        self.wandb.finish(summary)
        self.log.event("run_end", status=summary["status"])
        self.set_status(phase="done", status=summary["status"])
        self.log.flush(self.log.writer.deadline_s)
        return summary
