"""Replica actor: a thin Ray shell around hsgd.train.trainer.ReplicaTrainer.

Its methods are the messages the supervisor sends. Phase methods (group "phase", one at a time)
run one level's collectives; control methods (group "control") answer while a phase is in
flight: progress, digests, stack dumps. A phase method never raises for a failed collective: it
returns {"ok": False, "error": ...} so the supervisor can tell "my peer died" (this replica is
fine, re-plan) from "I died" (the actor call itself raises).

State kept across a restart: none. A restarted replica rebuilds from the seed (or the resume
checkpoint) in __init__ and is healed by the supervisor from a live peer.
"""
from __future__ import annotations

import faulthandler
import io
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import ray
import torch
from omegaconf import OmegaConf

from actors.hang import install_faulthandler
from hsgd.train import checkpoint
from hsgd.train.comm import CollectiveError, LevelGroup
from hsgd.core.topology import Topology
from hsgd.train.trainer import ReplicaTrainer

CONCURRENCY_GROUPS = {"phase": 1, "control": 2}


class FaultFired(RuntimeError):
    pass


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class Replica:
    def __init__(self, cfg: dict, rid: str, run_dir: str, backend: str):
        torch.set_num_threads(1)  # several replicas share a few cores
        install_faulthandler(run_dir, rid)
        self.started_at = time.time()
        self.cfg = OmegaConf.create(cfg)
        self.rid, self.run_dir = rid, run_dir
        topo = Topology(self.cfg.topology.clusters, self.cfg.topology.replicas_per_cluster)
        device = "cuda" if backend == "nccl" else "cpu"
        self.trainer = ReplicaTrainer(self.cfg, rid, topo, device=device)
        comm = self.cfg.comm
        self.inner = LevelGroup("inner", backend, comm.timeout_s, comm.configure_timeout_s)
        self.outer = LevelGroup("outer", backend, comm.timeout_s, comm.configure_timeout_s)
        self.epoch = -1
        self.phase = "idle"
        self.phase_since = time.time()
        self.armed: list[dict] = []
        self.slow_s = 0.0
        self.pending_now: list[dict] = []  # injected faults waiting for the next boundary

    # -- control group --------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        return {**self.trainer.progress(), "epoch": self.epoch, "phase": self.phase,
                "phase_since": self.phase_since, "pid": os.getpid(), "started_at": self.started_at,
                "node_id": ray.get_runtime_context().get_node_id()}

    @ray.method(concurrency_group="control")
    def digests(self) -> dict:
        return {"param": self.trainer.param_digest(), "global": self.trainer.global_digest(),
                "round": self.trainer.round, "step": self.trainer.step}

    @ray.method(concurrency_group="control")
    def stack_dump(self) -> str:
        """Python stacks of every thread in this process (for hang reports and jobs.diagnose)."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        out = [f"replica {self.rid} pid {os.getpid()} phase {self.phase} since {time.time() - self.phase_since:.1f}s"]
        for ident, frame in frames.items():
            out.append(f"--- thread {names.get(ident, ident)} ---")
            out.extend(line.rstrip() for line in traceback.format_stack(frame))
        return "\n".join(out)

    @ray.method(concurrency_group="control")
    def inject(self, fault: dict) -> dict:
        """A fault from outside the schedule (drills; idle members of a `cluster:` target). A crash
        fires at once; the others fire at the phase thread's next step or phase boundary, where
        they stop, slow or cut off the work itself rather than this control thread."""
        if fault["kind"] == "crash":
            self._fire(fault, self.trainer.round, self.trainer.step_in_round)
        self.pending_now.append(fault)
        return {"ok": True, "rid": self.rid, "kind": fault["kind"]}

    # -- faults ---------------------------------------------------------------------------------
    def _arm(self, faults: list[dict] | None) -> None:
        self.armed = list(faults or [])

    def _hook(self, phase: str, round_index: int, step_in_round: int) -> None:
        while self.pending_now:
            self._fire(self.pending_now.pop(0), round_index, step_in_round)
        for fault in list(self.armed):
            if fault["phase"] != phase:
                continue
            if phase in ("inner", "inner_sync") and fault.get("step", 0) != step_in_round:
                continue
            self.armed.remove(fault)
            self._fire(fault, round_index, step_in_round)

    def _fire(self, fault: dict, round_index: int, step_in_round: int) -> None:
        kind = fault["kind"]
        record = {"t": time.time(), "rid": self.rid, "kind": kind, "phase": fault["phase"],
                  "round": round_index, "step": step_in_round, "pid": os.getpid()}
        with open(os.path.join(self.run_dir, "faults_fired.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if kind == "crash":
            os._exit(17)
        if kind == "kill":
            ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
            time.sleep(60)  # ray.kill is asynchronous; never run another step
        if kind == "hang":
            end = time.monotonic() + float(fault.get("seconds") or 3600)
            while time.monotonic() < end:
                sum(range(3_000_000))  # C loop: holds the GIL for ~20-50 ms at a time
        if kind == "comm":
            self.inner.abort()
            self.outer.abort()
        if kind == "slow":
            self.slow_s = float(fault.get("seconds") or 0.5)

    def _phase(self, name: str, fn, round_index: int, faults: list[dict] | None):
        self.phase, self.phase_since = name, time.time()
        self._arm(faults)
        try:
            result = fn()
            return {"ok": True, "rid": self.rid, **(result or {}), **self.trainer.progress()}
        except CollectiveError as err:
            return {"ok": False, "rid": self.rid, "error": str(err), **self.trainer.progress()}
        finally:
            self.phase, self.phase_since = "idle", time.time()
            self.armed = []

    # -- phase group ----------------------------------------------------------------------------
    @ray.method(concurrency_group="phase")
    def configure(self, epoch: int, store_addr: str, inner: tuple, outer: tuple | None) -> dict:
        """inner/outer: (prefix, rank, world_size); outer is None for a non-leader."""
        def run():
            self.epoch = epoch
            self.inner.configure(store_addr, inner[0], inner[1], inner[2], epoch)
            if outer is not None:
                self.outer.configure(store_addr, outer[0], outer[1], outer[2], epoch)
            else:  # not a leader: this replica must never issue an outer collective
                self.outer.abort()
            return {"epoch": epoch}
        return self._phase("configure", run, -1, None)

    @ray.method(concurrency_group="phase")
    def run_inner(self, round_index: int, faults: list[dict] | None = None) -> dict:
        self.slow_s = 0.0

        def hook(phase, r, s):
            self._hook(phase, r, s)
            if self.slow_s and phase == "inner":
                time.sleep(self.slow_s)

        def run():
            report = self.trainer.run_inner(round_index, self.inner, hook)
            return {"report": report.__dict__}
        return self._phase("inner", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def cluster_average(self, round_index: int, faults: list[dict] | None = None) -> dict:
        def run():
            self._hook("inner_sync", round_index, self.trainer.steps_per_round)
            self.trainer.cluster_average(round_index, self.inner)
        return self._phase("inner_sync", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def outer_reduce(self, round_index: int, faults: list[dict] | None = None) -> dict:
        def run():
            self._hook("outer", round_index, 0)
            before = self.outer.bytes_sent
            self.trainer.outer_reduce(round_index, self.outer)
            return {"outer_bytes": self.outer.bytes_sent - before}
        return self._phase("outer", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def discard_outer(self) -> dict:
        self.trainer.discard_outer_buffer()
        return {"ok": True}

    @ray.method(concurrency_group="phase")
    def outer_commit(self, round_index: int, root: int, faults: list[dict] | None = None) -> dict:
        def run():
            self._hook("outer_commit", round_index, 0)
            before = self.inner.bytes_sent
            self.trainer.outer_commit(round_index, self.inner, root)
            return {"digest": self.trainer.param_digest(), "global_digest": self.trainer.global_digest(),
                    "inner_bytes": self.inner.bytes_sent - before}
        return self._phase("outer_commit", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def evaluate(self) -> float:
        return self.trainer.eval_loss()

    @ray.method(concurrency_group="phase")
    def get_state(self, faults: list[dict] | None = None) -> dict:
        """Full state for a heal; travels through the object store, never through the supervisor."""
        self._arm(faults)
        self._hook("heal", self.trainer.round, 0)
        return self.trainer.state_dict()

    @ray.method(concurrency_group="phase")
    def load_state(self, state: dict, scope: str, faults: list[dict] | None = None) -> dict:
        self.phase, self.phase_since = "heal", time.time()
        self._arm(faults)
        self._hook("heal", self.trainer.round, 0)
        try:
            self.trainer.load_state_dict(state, scope=scope)
            nbytes = sum(t.numel() * t.element_size() for t in state["params"])
            return {"ok": True, "rid": self.rid, "bytes": nbytes, **self.trainer.progress()}
        finally:
            self.phase, self.phase_since = "idle", time.time()

    @ray.method(concurrency_group="phase")
    def save_checkpoint(self, directory: str, faults: list[dict] | None = None) -> dict:
        def run():
            self._hook("checkpoint", self.trainer.round, 0)
            return {"sha256": checkpoint.save_replica_state(directory, self.rid, self.trainer.state_dict())}
        return self._phase("checkpoint", run, self.trainer.round, faults)

    @ray.method(concurrency_group="phase")
    def load_checkpoint(self, directory: str, sha256: str | None) -> dict:
        state = checkpoint.load_replica_state(directory, self.rid, sha256)
        self.trainer.load_state_dict(state, scope="full")
        return {"ok": True, **self.trainer.progress()}
