"""Replica actor: a thin Ray shell around hsgd.train.trainer.ReplicaTrainer.

Its methods are the messages the supervisor sends. Phase methods (concurrency group "phase", one
at a time) run at most one level's collectives; control methods (group "control") answer while a
phase is in flight: progress, digests, stack dumps, fault injection.

Every phase method answers a `PhaseAnswer` dict: {"outcome": done | behind | collective_failed,
"rid", "round", "step", ...}. `behind` means the call names a round this replica has not reached
(it must be healed; it is never reported done); `collective_failed` means this replica is fine but
its group broke (a peer failed or timed out). The method itself never raises for those: when the
actor call raises, the replica died (ActorDiedError) or hit an error of its own (RayTaskError),
which the supervisor treats as this replica's failure.

State kept across a restart: none. A restarted replica rebuilds from the seed (or the resume
checkpoint) in __init__ and is healed by the supervisor from a live peer.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import ray
import torch
from omegaconf import OmegaConf

from actors.hang import install_faulthandler
from hsgd.train import checkpoint
from hsgd.train.comm import CollectiveError, LevelGroup
from hsgd.core.topology import Topology
from hsgd.core.round import Outcome
from hsgd.train.trainer import Behind, ReplicaTrainer, YieldNow

CONCURRENCY_GROUPS = {"phase": 1, "control": 2}


class FaultFired(RuntimeError):
    pass


class InjectedError(RuntimeError):
    """The `error` fault: raised inside a phase, it reaches the supervisor as a RayTaskError."""


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class Replica:
    def __init__(self, cfg: dict, rid: str, run_dir: str, backend: str, spare: bool = False):
        torch.set_num_threads(1)  # several replicas share a few cores
        install_faulthandler(run_dir, rid)
        self.started_at = time.time()
        self.cfg = OmegaConf.create(cfg)
        self.rid, self.run_dir = rid, run_dir
        topo = Topology(self.cfg.topology.clusters, self.cfg.topology.replicas_per_cluster)
        device = "cuda" if backend == "nccl" else "cpu"
        self.trainer = ReplicaTrainer(self.cfg, rid, topo, device=device)
        comm = self.cfg.comm
        self.inner = LevelGroup("inner", backend, comm.timeout_s, comm.configure_timeout_s, **_link(comm))
        self.outer = LevelGroup("outer", backend, comm.timeout_s, comm.configure_timeout_s, **_link(comm))
        self.epoch = -1
        self.phase = "idle"
        self.phase_since = time.time()
        self.armed: list[dict] = []
        self.slow_s = 0.0
        self.pending_now: list[dict] = []  # injected faults waiting for the next boundary
        self.yield_at: tuple[int, int, int] | None = None  # (epoch, round, step_in_round)
        self.spare = spare  # a hot spare: warmed, idle, until the supervisor hands it an identity
        self.warm_s = self.trainer.warm_up() if spare else 0.0

    # -- control group --------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        """This replica's committed (round, step), its phase and process. Control group: answers
        while a phase runs, so a replica whose step advances is seen as slow, never hung. No answer
        (a GIL-holding hang, a dead process) is no sign of life."""
        return {**self.trainer.progress(), "epoch": self.epoch, "phase": self.phase, "spare": self.spare,
                "phase_since": self.phase_since, "pid": os.getpid(), "started_at": self.started_at,
                "node_id": ray.get_runtime_context().get_node_id()}

    @ray.method(concurrency_group="control")
    def global_state(self) -> dict:
        """The global params and outer state, for a `global` heal of another cluster's replica.
        Control group: a donor busy in its own inner phase answers at once (these tensors change
        only in outer_commit)."""
        return self.trainer.global_state()

    @ray.method(concurrency_group="control")
    def digests(self) -> dict:
        """sha256 of the params and of the global params (equal digests = bitwise-equal state)."""
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
    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> dict:
        """Ask the inner phase of group epoch `epoch` to return at the boundary before
        `step_in_round` (a replica joins the cluster mid-round; every member is asked for the same
        boundary). A request for another epoch is stale and ignored at the boundary."""
        self.yield_at = (epoch, round_index, step_in_round)
        return {"rid": self.rid, "step": self.trainer.step}

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
        if kind == "error":  # an exception of the replica's own (CUDA OOM, an I/O error, a bug)
            raise InjectedError(f"{self.rid}: injected error in {fault['phase']} of round {round_index}")

    def _phase(self, name: str, fn, round_index: int, faults: list[dict] | None):
        self.phase, self.phase_since = name, time.time()
        self._arm(faults)
        try:
            result = fn()
            return {"outcome": Outcome.DONE.value, "ok": True, "rid": self.rid, **(result or {}),
                    **self.trainer.progress()}  # a result's own "outcome" (yielded) wins
        except Behind as err:
            return {"outcome": Outcome.BEHIND.value, "ok": False, "rid": self.rid, "error": str(err),
                    **self.trainer.progress()}
        except CollectiveError as err:
            return {"outcome": Outcome.COLLECTIVE_FAILED.value, "ok": False, "rid": self.rid, "error": str(err),
                    **self.trainer.progress()}
        finally:
            self.phase, self.phase_since = "idle", time.time()
            self.armed = []

    # -- phase group ----------------------------------------------------------------------------
    @ray.method(concurrency_group="phase")
    def assume(self, rid: str) -> dict:
        """Hot spare: become replica `rid` (its data stream and name). The supervisor heals it from a
        live member of the cluster next, like any replica that joins."""
        self.trainer.assume_identity(rid)
        self.rid, self.spare = rid, False
        return {"outcome": Outcome.DONE.value, "rid": rid, **self.trainer.progress(), "pid": os.getpid()}

    @ray.method(concurrency_group="phase")
    def become_spare(self) -> dict:
        """A restarted replica whose identity a spare took over becomes the cluster's next spare."""
        self.spare = True
        self.warm_s = self.trainer.warm_up()
        return {"outcome": Outcome.DONE.value, "rid": self.rid, "warm_s": self.warm_s, "pid": os.getpid()}

    def _join(self, group: LevelGroup, join: tuple | None, then: str) -> float:
        """Form `group` first when the call carries `join` = (epoch, store_addr, prefix, rank,
        world_size): a fresh group per epoch. Blocks until every member joined or
        comm.configure_timeout_s passes, then raises CollectiveError (the call answers
        `collective_failed`: a member did not come; the supervisor re-forms the group). Returns the
        seconds it took (0.0: the standing group is used)."""
        if join is None:
            return 0.0
        epoch, store_addr, prefix, rank, world_size = join
        t0 = time.monotonic()
        self.phase, self.phase_since = "configure", time.time()
        if group is self.inner:
            self.epoch = epoch
        group.configure(store_addr, prefix, rank, world_size, epoch)
        self.phase, self.phase_since = then, time.time()
        return time.monotonic() - t0

    @ray.method(concurrency_group="phase")
    def run_inner(self, round_index: int, faults: list[dict] | None = None, join: tuple | None = None) -> dict:
        """Run this round's remaining inner steps, syncing in the cluster's inner group. `join`: this
        call forms that group first (see `_join`): one round trip for a cluster that (re-)forms. The
        committed step is readable on the control channel (`progress`) all along, so the supervisor
        can tell slow from hung. `behind` if this replica has not reached the round (it joins the
        group first all the same, so its peers' first collective fails fast rather than their join
        waiting out its timeout)."""
        self.slow_s = 0.0

        def hook(phase, r, s):
            self._hook(phase, r, s)
            if phase == "inner" and self.yield_at is not None and self.yield_at[:2] == (self.epoch, r) \
                    and s >= self.yield_at[2]:
                self.yield_at = None
                raise YieldNow()
            if self.slow_s and phase == "inner":
                time.sleep(self.slow_s)

        def run():
            join_s = self._join(self.inner, join, "inner")
            report = self.trainer.run_inner(round_index, self.inner, hook)
            return {"report": report.__dict__, "join_s": join_s,
                    **({"outcome": Outcome.YIELDED.value} if report.yielded else {})}
        return self._phase("inner", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def cluster_average(self, round_index: int, epoch: int, faults: list[dict] | None = None) -> dict:
        """inner `none`: the cluster's mean params on every member (idempotent per (round, epoch))."""
        def run():
            self._hook("inner_sync", round_index, 0)  # one average per round: schedule it at step 0
            self.trainer.cluster_average(round_index, epoch, self.inner)
        return self._phase("inner_sync", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def outer_reduce(self, round_index: int, epoch: int, faults: list[dict] | None = None,
                     join: tuple | None = None) -> dict:
        """Leaders, phase 1 of the two-phase commit: all-reduce the pseudo-gradient into a buffer
        keyed by (round, epoch). Nothing is applied; a failure leaves the params untouched. `join`:
        the leaders changed, so this call forms the leaders' group first (see `_join`)."""
        def run():
            join_s = self._join(self.outer, join, "outer")
            self._hook("outer", round_index, 0)
            before = self.outer.bytes_sent
            self.trainer.outer_reduce(round_index, epoch, self.outer)
            return {"outer_bytes": self.outer.bytes_sent - before, "join_s": join_s}
        return self._phase("outer", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def outer_commit(self, round_index: int, root: int, faults: list[dict] | None = None) -> dict:
        """Phase 2, only after the supervisor decided commit: the member of inner rank `root`
        (the leader) broadcasts its buffer in the cluster and every member applies the same outer
        step. A round already committed here is a no-op (`done`)."""
        def run():
            self._hook("outer_commit", round_index, 0)
            before = self.inner.bytes_sent
            self.trainer.outer_commit(round_index, self.inner, root)
            return {"digest": self.trainer.param_digest(), "global_digest": self.trainer.global_digest(),
                    "inner_bytes": self.inner.bytes_sent - before}
        return self._phase("outer_commit", run, round_index, faults)

    @ray.method(concurrency_group="phase")
    def evaluate(self) -> float:
        """Held-out loss of this replica's params (after a commit: the global params)."""
        return self.trainer.eval_loss()

    @ray.method(concurrency_group="phase")
    def get_state(self, faults: list[dict] | None = None) -> dict:
        """Full state for a `full` heal; travels through the object store, never through the
        supervisor. Phase group: never read while this replica's own phase mutates it."""
        self._arm(faults)
        self._hook("heal", self.trainer.round, 0)
        return self.trainer.state_dict()

    @ray.method(concurrency_group="phase")
    def load_state(self, state: dict, scope: str, faults: list[dict] | None = None) -> dict:
        """Become the source (`full`) or take its global state (`global`). A source that died
        surfaces here as an error of this call."""
        self.phase, self.phase_since = "heal", time.time()
        self._arm(faults)
        self._hook("heal", self.trainer.round, 0)
        try:
            self.trainer.load_state_dict(state, scope=scope)
            tensors = state["params"] if scope == "full" else state["outer"]["global_params"]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            return {"outcome": Outcome.DONE.value, "ok": True, "rid": self.rid, "bytes": nbytes,
                    **self.trainer.progress()}
        finally:
            self.phase, self.phase_since = "idle", time.time()

    @ray.method(concurrency_group="phase")
    def save_checkpoint(self, directory: str, round_index: int, faults: list[dict] | None = None) -> dict:
        """Write this replica's state for the checkpoint of round `round_index` (its state after
        round_index - 1 committed). `behind` unless this replica holds exactly that round."""
        def run():
            self._hook("checkpoint", round_index - 1, 0)  # the checkpoint taken after round round_index - 1
            if self.trainer.round != round_index:
                raise Behind(f"{self.rid}: checkpoint of round {round_index}, but this replica holds "
                             f"round {self.trainer.round}")
            return {"sha256": checkpoint.save_replica_state(directory, self.rid, self.trainer.state_dict())}
        return self._phase("checkpoint", run, self.trainer.round, faults)

    @ray.method(concurrency_group="phase")
    def load_checkpoint(self, directory: str, sha256: str | None) -> dict:
        """Restore (resume, or every replica after a total loss) from a durable checkpoint."""
        state = checkpoint.load_replica_state(directory, self.rid, sha256)
        self.trainer.load_state_dict(state, scope="full")
        return {"outcome": Outcome.DONE.value, "ok": True, "rid": self.rid, **self.trainer.progress()}


def _link(comm) -> dict:
    """LevelGroup's payload-scaled timeouts, when the config has comm.min_gbps."""
    gbps = comm.get("min_gbps") if hasattr(comm, "get") else None
    return {"min_gbps": float(gbps)} if gbps else {}
