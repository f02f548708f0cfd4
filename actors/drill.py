"""Failure drills: start a run in the background (a notebook, a script), watch it, break it on
purpose, and wait for it to heal (docs/faults.md, "Drills", shows the API). The run is the ordinary
`jobs.train` path on an embedded Ray, in `drill.run_dir`. Every blocking call takes a timeout and
raises `DrillError` saying what it waited for and what the run looked like then. Waits read the
run's record (events.jsonl, faults_fired.jsonl: every death and commit once, in order), not
status.json alone: that is only the newest state, and may reach the disk before or after its events.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path

import ray

from actors.launch import compose_config, connect_ray, run_training
from actors.roster import replica_actor_name
from actors.supervisor import supervisor_actor_name
from hsgd.config import validate
from hsgd.core.faults import FAULT_KINDS, FaultSpec
from hsgd.core.phases import FAULT, Phase
from hsgd.core.site_requests import RequestError, RequestKind, write_request
from hsgd.record.run_state import RunState
from hsgd.record.rundir import FolderWriter, read_jsonl, write_deadline_s, write_fault_fired
from hsgd.record.rundir import read_json as _read_json

_DOWN = ("replica_down", "hang_detected")  # a replica lost
_FAILURES = (*_DOWN, "supervisor_start")  # what the record counts as a failure since an injection
# events.jsonl is stamped by the supervisor's clock, an injection by this process's: on another node
# a failure may seem to come just before the injection that caused it
_CLOCK_SKEW_S = 1.0


class DrillError(RuntimeError):
    pass


class Drill:
    def __init__(self, overrides: list[str] | tuple[str, ...] = (), run_dir: str | None = None):
        self.overrides = list(overrides)
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="hsgd-drill-")) / "run"
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owns_ray = False
        self._injected: list[dict] = []

    def start(self, timeout_s: float = 180.0) -> Drill:
        """Start the run in a background thread; return once its supervisor is driving rounds."""
        cfg = compose_config(["logging.progress=false", *self.overrides])
        validate(cfg)
        self.cfg = cfg
        self._writer = FolderWriter(write_deadline_s(float(cfg.run.io_grace_s)))  # faults_fired.jsonl
        self._owns_ray = connect_ray(cfg)  # ours, so the run does not shut it down under us

        def target() -> None:
            try:
                self.summary = run_training(cfg, str(self.run_dir))
            except BaseException as err:  # noqa: BLE001 — surfaced by wait_* calls
                self.error = err

        self._thread = threading.Thread(target=target, name="hsgd-drill-run", daemon=True)
        self._thread.start()
        self.wait_for(
            lambda st: st.get("phase") not in (None, "starting", "waiting_for_replicas"),
            timeout_s,
            "the supervisor to start driving rounds",
        )
        return self

    def stop(self, timeout_s: float = 180.0) -> dict:
        """Ask the supervisor to finish the round in flight and end the run (status `stopped`)."""
        if self.summary is None and self._alive():
            with contextlib.suppress(Exception):  # a restarting supervisor: wait_done still bounds us
                ray.get(self._supervisor().request_stop.remote(), timeout=30)
        return self.wait_done(timeout_s)

    def wait_done(self, timeout_s: float = 600.0) -> dict:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                raise DrillError(f"the run did not end within {timeout_s:.0f}s; last state: {self._brief()}")
        if self.error is not None:
            raise DrillError(f"the run raised {type(self.error).__name__}: {self.error}") from self.error
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        return self.summary or {}

    def state(self) -> dict:
        """Membership per cluster (live and down), leaders, epoch, round, phase, losses, recent events."""
        status = _read_json(self.run_dir / "status.json")
        live = _members(status)
        clusters: dict[str, dict] = {}
        for rid in _read_json(self.run_dir / "run.json").get("replicas", []):
            c = "c" + rid[1:].split("r")[0]
            entry = clusters.setdefault(c, {"live": [], "down": [], "leader": (status.get("leaders") or {}).get(c)})
            entry["live" if rid in live else "down"].append(rid)
        events = read_jsonl(self.run_dir / "events.jsonl")
        recent = [e for e in events if e["event"] not in ("phase_begin", "phase_end")][-10:]
        shown = ("epoch", "round", "phase", "last_loss", "last_eval_loss", "status")
        return {
            "clusters": clusters,
            **{k: status.get(k) for k in shown},
            "recent_events": recent,
            "done": self.summary is not None or not self._alive(),
        }

    def wait_for(
        self,
        predicate=None,
        timeout_s: float = 120.0,
        what: str = "a condition",
        *,
        phase: str | None = None,
        round: int | None = None,
    ) -> dict:
        """Poll status.json until predicate(status) (or the phase/round given) holds."""
        if predicate is None:

            def predicate(st: dict) -> bool:
                return (phase is None or st.get("phase") == phase) and (
                    round is None or (st.get("round") or 0) >= round
                )

            what = f"phase={phase} round>={round}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = _read_json(self.run_dir / "status.json")
            if status and predicate(status):
                return status
            if not self._alive():
                raise DrillError(f"the run ended while waiting for {what}: {self.error or self.summary}")
            time.sleep(0.1)
        raise DrillError(f"timed out after {timeout_s:.0f}s waiting for {what}; last state: {self._brief()}")

    def inject(
        self,
        kind: str,
        target: str,
        *,
        round: int | None = None,
        phase: str | None = None,
        step: int = 0,
        seconds: float | None = None,
    ) -> dict:
        """Break something. With no round/phase: now. Else at that (round, phase, step) boundary,
        exactly like a `faults.schedule` entry. target: c0r1 | leader:c1 | cluster:c1 | supervisor."""
        if kind not in FAULT_KINDS:
            raise DrillError(f"kind {kind!r} unknown; valid: {'|'.join(FAULT_KINDS)}")
        record = {"t": time.time(), "kind": kind, "target": target}
        if round is not None or phase is not None:
            if phase not in Phase.having(FAULT) or round is None:
                raise DrillError(f"a scheduled fault needs round and phase (one of {'|'.join(Phase.having(FAULT))})")
            raw = {
                "kind": kind,
                "target": target,
                "round": round,
                "phase": phase,
                "step": step,
                **({} if seconds is None else {"seconds": seconds}),
            }
            record["scheduled"] = ray.get(self._supervisor().add_fault.remote(raw), timeout=30)
        elif target == "supervisor":
            if kind == "kill":  # logged where in-process faults log themselves
                write_fault_fired(self._writer, self.run_dir, "supervisor", kind, Phase.NOW, None, None)
                ray.kill(self._supervisor(), no_restart=False)
            elif kind == "crash":
                self._supervisor().crash.remote()
            else:
                raise DrillError(f"{kind!r} cannot target the supervisor; valid: kill|crash")
        else:
            record["rids"] = self._resolve(target)
            for rid in record["rids"]:
                if kind == "kill":  # from outside, as an operator or a node failure would
                    write_fault_fired(self._writer, self.run_dir, rid, kind, Phase.NOW, None, None)
                    ray.kill(self._replica(rid), no_restart=False)
                else:
                    self._replica(rid).inject.remote(FaultSpec(kind, rid, 0, phase=Phase.NOW, seconds=seconds))
        self._injected.append(record)
        return record

    def drain_site(self, cluster: str) -> str:
        """Ask the run to drain `cluster` (c<k>) at its next round's start: one request file in
        run_dir/requests/, exactly as `python -m jobs.status <run> drain-site c<k>`; its id."""
        try:
            return write_request(self.run_dir, RequestKind.DRAIN, cluster).id
        except RequestError as err:
            raise DrillError(str(err)) from err

    def add_site(self, replicas: int, label: str | None = None, name: str | None = None) -> str:
        """Ask the run for a new site of `replicas` replicas (placed by node `label`, else its own
        placement group) at its next round's start: one request file, exactly as `python -m jobs.status
        <run> add-site replicas=N [label=L] [name=S]`; its id. DrillError on fields that cannot be valid."""
        try:
            return write_request(self.run_dir, RequestKind.ADD_SITE, replicas=replicas, label=label, name=name).id
        except RequestError as err:
            raise DrillError(str(err)) from err

    def wait_site_request(self, request_id: str, timeout_s: float = 120.0) -> dict:
        """Wait for the supervisor's `site_request` event for `request_id` (applied or refused); that event."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [
                e
                for e in read_jsonl(self.run_dir / "events.jsonl")
                if e["event"] == "site_request" and e.get("id") == request_id
            ]
            if found:
                return found[0]
            if not self._alive():  # the run ended before a round start read it
                raise DrillError(
                    f"the run ended before site request {request_id} was decided: "
                    f"{self.error or (self.summary or {}).get('status')}"
                )
            time.sleep(0.1)
        raise DrillError(
            f"site request {request_id} not decided {timeout_s:.0f}s after it was written; last state: {self._brief()}"
        )

    def wait_down(self, timeout_s: float = 60.0) -> list[dict]:
        """Wait until events.jsonl records the last injection (a kill, crash or hang, now) taking down
        what it hit; those events: `replica_down` or `hang_detected` per replica hit, or `supervisor_start`
        for the supervisor."""
        last = self._last()
        if last.get("scheduled") is not None or last["kind"] not in ("kill", "crash", "hang"):
            raise DrillError(f"wait_down is for a kill, crash or hang injected now, not {last}")
        # only the kind the target can go down as: a supervisor that started just before a replica
        # kill is no record of that kill (and carries no rid)
        kinds = ("supervisor_start",) if last["target"] == "supervisor" else _DOWN
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failures = [
                e
                for e in read_jsonl(self.run_dir / "events.jsonl")
                if e["event"] in kinds and e["t"] >= last["t"] - _CLOCK_SKEW_S
            ]
            if self._took_effect(last, failures):
                return failures
            self._raise_if_ended("the fault to take effect")
            time.sleep(0.1)
        raise DrillError(
            f"{last['target']} not recorded down {timeout_s:.0f}s after the injection; last state: {self._brief()}"
        )

    def wait_recovered(self, timeout_s: float = 180.0) -> dict:
        """Wait until the record shows the last injection took effect (`wait_down`'s events, or its
        faults_fired.jsonl line with its round), then a `commit` naming every replica after the last
        failure and after the round the fault fired in (a fault at the commit in flight lets that
        round commit without its victim), and status.json caught up (its round past that commit,
        every replica a member). Returns {"recovered_s": injection to that commit, "detections"}.
        Not "a commit since the last replica_up": a member may still be healing, and one back
        during the outer exchange sits that round out."""
        last = self._last()
        t0 = last["t"]
        everyone = set(self._info()["replicas"])
        # a fault that fires inside a replica (or at a scheduled moment) names its round when it fires
        fires_later = last.get("scheduled") is not None or (last.get("rids") and last["kind"] != "kill")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = [e for e in read_jsonl(self.run_dir / "events.jsonl") if e["t"] >= t0 - _CLOCK_SKEW_S]
            failures = [e for e in events if e["event"] in _FAILURES]
            fired_round = -1
            if fires_later:
                fired = [
                    f["round"]
                    for f in read_jsonl(self.run_dir / "faults_fired.jsonl")
                    if f["t"] >= t0 - _CLOCK_SKEW_S
                    and f.get("round") is not None
                    and (not last.get("rids") or f.get("rid") in last["rids"])
                ]
                fired_round = max(fired, default=None)
            back = _returned(events, failures)
            if fired_round is not None and back is not None and self._took_effect(last, failures):
                # after every replica that went down came back: a commit logged just after a death
                # may still name the dead one (it applied the commit before it died)
                since = max([e["t"] for e in failures] + [back], default=t0)
                commit = next(
                    (
                        e
                        for e in events
                        if e["event"] == "commit"
                        and e["t"] > since
                        and e["round"] > fired_round
                        and everyone <= set(e.get("replicas") or ())
                    ),
                    None,
                )
                status = _read_json(self.run_dir / "status.json")
                if commit is not None and (status.get("round") or 0) > commit["round"] and everyone <= _members(status):
                    return {"recovered_s": commit["t"] - t0, "detections": [e["event"] for e in failures]}
            if not self._alive() and self.summary is not None and self.summary.get("status") == "completed":
                return {"recovered_s": None, "detections": [e["event"] for e in failures], "run_ended": True}
            self._raise_if_ended("the run to recover")
            time.sleep(0.2)
        raise DrillError(f"not recovered {timeout_s:.0f}s after the last injection; last state: {self._brief()}")

    def _last(self) -> dict:
        if not self._injected:
            raise DrillError("nothing was injected")
        return self._injected[-1]

    @staticmethod
    def _took_effect(last: dict, failures: list[dict]) -> bool:
        """Whether the record shows what the injection takes down gone (True for a fault that
        takes nobody down, or one at a scheduled moment: its fired record says when it fired)."""
        if last.get("scheduled") is not None or last["kind"] not in ("kill", "crash", "hang"):
            return True
        if last["target"] == "supervisor":
            return any(e["event"] == "supervisor_start" for e in failures)
        down = {e.get("rid") for e in failures if e["event"] in _DOWN}
        return set(last.get("rids") or ()) <= down

    def _raise_if_ended(self, what: str) -> None:
        if self.summary is not None and self.summary.get("status") != "completed":
            raise DrillError(
                f"the run ended as {self.summary.get('status')} while waiting for {what}: {self.summary.get('reason')}"
            )
        if not self._alive() and self.summary is None:
            raise DrillError(f"the run ended while waiting for {what}: {self.error}")

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _info(self) -> dict:
        info = _read_json(self.run_dir / "run.json")
        if not info:
            raise DrillError(f"{self.run_dir}/run.json is missing: is the run started?")
        return info

    def _replica(self, rid: str):
        # a hot spare may serve this id now: the supervisor's durable identity map says which actor
        name = RunState.read(self.run_dir).identity.get(rid) or replica_actor_name(self._info()["run_id"], rid)
        return ray.get_actor(name, namespace=self._info()["namespace"])

    def _supervisor(self):
        return ray.get_actor(supervisor_actor_name(self._info()["run_id"]), namespace=self._info()["namespace"])

    def _resolve(self, target: str) -> list[str]:
        status = _read_json(self.run_dir / "status.json")
        if target.startswith("leader:"):
            leader = (status.get("leaders") or {}).get(target.split(":", 1)[1])
            if leader is None:
                raise DrillError(f"{target}: that cluster has no leader now (state: {self._brief()})")
            return [leader]
        if target.startswith("cluster:"):
            prefix = target.split(":", 1)[1] + "r"
            return [rid for rid in self._info()["replicas"] if rid.startswith(prefix)]
        if target not in self._info()["replicas"]:
            raise DrillError(f"unknown target {target!r}; valid: a replica id, leader:c<k>, cluster:c<k>, supervisor")
        return [target]

    def _brief(self) -> str:
        st = _read_json(self.run_dir / "status.json")
        return json.dumps({k: st.get(k) for k in ("phase", "round", "epoch", "members", "status")}, default=str)


def _members(status: dict) -> set[str]:
    return {rid for members in (status.get("members") or {}).values() for rid in members}


def _returned(events: list[dict], failures: list[dict]) -> float | None:
    """When the last replica down in `failures` came back (`replica_up` or `spare_promoted` after its
    last down); None while one is still away; 0.0 when none went down."""
    last_down: dict[str, float] = {}
    for e in failures:
        if e["event"] in _DOWN and e.get("rid"):
            last_down[e["rid"]] = max(last_down.get(e["rid"], 0.0), e["t"])
    back = 0.0
    for rid, t_down in last_down.items():
        ups = [
            e["t"]
            for e in events
            if e["event"] in ("replica_up", "spare_promoted") and e.get("rid") == rid and e["t"] > t_down
        ]
        if not ups:
            return None
        back = max(back, min(ups))
    return back
