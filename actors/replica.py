"""Replica actor: a thin Ray shell around hsgd.train.trainer.ReplicaTrainer.

Phase methods (concurrency group "phase", one at a time) run at most one level's collectives and
answer a `PhaseAnswer`; control methods answer while a phase runs. A call that raises is this
replica's failure (ActorDiedError: it died; RayTaskError: its own error). A restart keeps only its
identity (actors/lifecycle.py): it rebuilds from the seed (or the resume checkpoint), healed by a peer.

The way back after a restart (issue 36; the recovery bench's `restart_breakdown` times each part):
Ray hands the restarted actor a worker (an idle pre-started one when it has one), which imports
torch while it unpickles this class; __init__ then reads its identity and config and returns at
once, so the supervisor's `up` probe is answered within ~10 ms of the class loading. What costs
seconds after that — the trainer (dataset, model, optimizers: the first optimizer pulls in
torch._dynamo, ~1 s) and what holds it — a restart builds on a thread of its own while the
supervisor plans its heal (a yield boundary, or the round's end); any call that needs them waits
for the build (`__getattr__`), and `progress()` answers a fresh trainer's round 0, step 0 until
then, as the built one would. Nothing it trains on changes: the same build from the seed, the same
data stream, the same state after the heal. A build that raises makes every call that needs it raise
(the replica's own error: the supervisor restarts it), where a first start's raises from __init__.
A first start builds in __init__ (a config error surfaces there); a spare builds and warms up there
too (it is ready only when warm). A hot spare (`topology.spares_per_cluster`) skips all of it: it
takes the dead replica's id at once and is healed like a restart.

A replica of k ranks (`topology.gpus_per_replica`, issue 34; actors/rank_group.py): this actor is
rank 0, the one the roster knows. It creates ranks 1..k-1 as Replica actors of their own (`rank_of`),
forms the replica group with them, and fans every phase call out to them (each rank runs the same
body: the same collectives in the same order), answering for all k. Faults, identity, the progress
board and step logs are rank 0's alone. A rank that dies ends rank 0 (the replica fails whole).
"""

from __future__ import annotations

import time

_MODULE_T0 = time.time()  # a restarted process: the worker is up and loads this class (startup breakdown)

import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import ray
import torch
from omegaconf import OmegaConf

from actors import lifecycle
from actors.hang import install_faulthandler
from actors.rank_group import RankPeers, form_replica_group, rank_prefix, replica_group_backend
from hsgd.config.capacity import resolve_level_backend
from hsgd.config.sites import ranks_per_replica
from hsgd.core.round import ErrorKind, Outcome, Overlap, PhaseAnswer
from hsgd.core.topology import topology_of
from hsgd.record.rundir import FolderWriter, write_deadline_s, write_fault_fired
from hsgd.record.steps import StepLog
from hsgd.train import checkpoint, dcp_checkpoint, sharding, state_stream
from hsgd.train.comm import CollectiveError, LevelGroup, allow_level_overlap, apply_nccl_environment
from hsgd.train.overlap import BackgroundReduce
from hsgd.train.progress_board import Publisher
from hsgd.train.simulate import link_from_config
from hsgd.train.trainer import Behind, NonFiniteError, ReplicaTrainer, YieldNow, param_digest

_MODULE_T1 = time.time()  # its imports done


class InjectedError(RuntimeError):
    """The `error` fault: raised inside a phase, it reaches the supervisor as a RayTaskError."""


_BUILT = ("trainer", "background")  # built in __init__, or behind it on a restart


@ray.remote(concurrency_groups={"phase": 1, "control": 2, "watch": 1})
class Replica:
    def __init__(
        self,
        cfg: dict,
        rid: str,
        run_dir: str,
        backends: dict,
        spare: bool = False,
        index_table: dict | None = None,
        *,
        rank_options: dict | None = None,
        rank_of: tuple | None = None,
    ):
        """`backends`: {"inner", "outer"} as planned (resolve_level_backend); `index_table`: the run's.
        k > 1 ranks: `rank_options` (rank 0), the Ray options of its other ranks; `rank_of` (ranks 1..k-1),
        (rank, k, store_addr, prefix) of the replica group to form (actors/rank_group.py)."""
        marks = {"init_begin": time.time()}
        torch.set_num_threads(1)  # several replicas share a few cores
        # a promoted spare that Ray restarts comes back as the replica it replaced (actors/lifecycle.py)
        self.actor_name = ray.get_runtime_context().get_actor_name()
        identity = lifecycle.read_identity(self.actor_name)
        if identity is not None:
            rid, spare = identity["rid"] or rid, bool(identity["spare"])
        self.incarnation = lifecycle.own_incarnation()
        self.rank_of, self.rank = rank_of, rank_of[0] if rank_of else 0
        self.rank_options, self.peers = rank_options, None
        self.made_with = (cfg, run_dir, backends, index_table)  # what ranks 1..k-1 are created with
        install_faulthandler(run_dir, rid if not self.rank else f"{rid}.{self.rank}")
        self.started_at = time.time()
        marks["identity"] = self.started_at
        self.cfg = OmegaConf.create(cfg)
        self.rid, self.run_dir = rid, run_dir
        topo = topology_of(self.cfg, index_table)  # this id's data stream
        gpu = bool(ray.get_runtime_context().get_accelerator_ids().get("GPU")) and torch.cuda.is_available()
        # (not `self.backends`: an attribute named like a torch submodule makes Ray's cloudpickle
        # pickle torch.backends with the class, which cannot be pickled)
        self.level_backends = {
            level: resolve_level_backend(backends[level], level=level, gpu=gpu) for level in ("inner", "outer")
        }
        device = "cuda" if self.level_backends["inner"] == "nccl" else "cpu"  # where the inner level reduces
        marks["config"] = time.time()
        self.topo = topo
        apply_nccl_environment(self.cfg.comm.configure_timeout_s)  # before any group
        self.inner, self.outer = self._level_group("inner"), self._level_group("outer")  # (configured when joined)
        # sync.fragment_delay: a shard holder's outer reduce runs behind the round's last inner steps
        allow_level_overlap(int(self.cfg.sync.fragment_delay) > 0)
        self._init_state(spare)
        self.startup = _startup_marks(marks)
        self._built, self._build_error = threading.Event(), None
        # a restart: answer `up` now, build while the supervisor plans its heal; but a replica of k ranks
        # builds first (starting its other ranks' processes takes seconds, which its heal source and
        # every member would otherwise spend waiting in the heal)
        if self.incarnation and not spare and ranks_per_replica(self.cfg) == 1:
            threading.Thread(target=self._build_behind, args=(device,), name="replica-build", daemon=True).start()
        elif self.incarnation and not spare:  # k > 1: a failed build ends the process, so Ray restarts it
            try:  # (a constructor that raises is never restarted)
                self._build(device)
            except BaseException as err:  # noqa: BLE001 — the replica's own failure, as a restart's build
                print(
                    f"replica {rid}: its restart could not start its ranks: {type(err).__name__}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
        else:  # the first start (a config error surfaces here) and spares (warmed before they are ready)
            self._build(device)
        self.startup["init_end"] = time.time()
        self.startup["init_s"] = self.startup["init_end"] - marks["init_begin"]

    def _build(self, device: str) -> None:
        """The trainer (dataset, model, optimizers: torch's lazy imports on the first one); k > 1: the
        replica group first (rank 0 creates the other ranks), and rank 0 waits for them to be built."""
        ranks = self._form_ranks(device)
        self.trainer = ReplicaTrainer(self.cfg, self.rid, self.topo, device=device, ranks=ranks)
        self.startup["trainer"] = time.time()
        # the other clusters reach their snapshot step at their own pace: within a phase call's deadline
        self.background = BackgroundReduce(
            self.trainer, self.outer, arrival_s=float(self.cfg.supervisor.phase_timeout_s)
        )
        if self.spare:  # (k > 1: every rank warms up in its own build, together: its collectives)
            self.trainer.warm_up()
        if self.peers is not None:
            self.peers.ready()
            self.peers.watch()
        self._open_step_log()
        self.startup["built"] = time.time()
        self._built.set()

    def _form_ranks(self, device: str) -> sharding.ReplicaRanks | None:
        """k > 1: this rank's place in the replica group (rank 0 first creates ranks 1..k-1); else None."""
        k = ranks_per_replica(self.cfg)
        if k <= 1:
            return None
        timeout_s = float(self.cfg.comm.configure_timeout_s)
        if self.rank_of is None:  # rank 0
            cfg, run_dir, backends, index_table = self.made_with

            def make(rank: int, rank_of: tuple):
                return Replica.options(**self.rank_options, max_restarts=0, max_task_retries=0).remote(
                    cfg, self.rid, run_dir, backends, self.spare, index_table, rank_of=rank_of
                )

            self.peers, self.rank_of = RankPeers.start(self.rid, k, make, timeout_s, self.incarnation)
        rank, size, store_addr, prefix = self.rank_of
        return form_replica_group(
            rank,
            size,
            store_addr,
            prefix,
            timeout_s,
            replica=self.rid,
            backend=replica_group_backend(device),
            op_timeout_s=float(self.cfg.supervisor.phase_timeout_s),
        )

    def _fan_out(self, method: str, args_of) -> list:
        """Rank 0 of k > 1: start `method` on the other ranks (rank j with args_of(j)); their refs."""
        return self.peers.call(method, args_of) if self.peers is not None else []

    def _merged(self, own: dict, refs: list) -> dict:
        return self.peers.merge(own, refs) if refs else own

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Ranks 1..k-1: never returns while this process lives (rank 0's RankPeers.watch)."""
        threading.Event().wait()

    def _build_behind(self, device: str) -> None:
        torch.set_num_threads(1)  # (per thread for OpenMP)
        try:
            self._build(device)
        except BaseException as err:  # noqa: BLE001 — every call that needs the trainer raises it: the replica's error
            self._build_error = err
            self._built.set()

    def __getattr__(self, name: str):
        """`trainer` and `background` of a restart still building: wait for them, at most a phase call's
        deadline (a build that long is the replica's failure: it raises, and is restarted)."""
        if name in _BUILT and "_built" in self.__dict__:
            if not self._built.wait(timeout=float(self.cfg.supervisor.phase_timeout_s)):
                raise RuntimeError(
                    f"{self.rid}: its restart did not build its trainer within "
                    f"{self.cfg.supervisor.phase_timeout_s:g}s (supervisor.phase_timeout_s)"
                )
            if self._build_error is not None:
                raise RuntimeError(f"{self.rid}: its restart could not build its trainer") from self._build_error
            return self.__dict__[name]
        raise AttributeError(name)

    def _init_state(self, spare: bool) -> None:
        self.epoch = self.outer_epoch = -1  # the epochs the standing inner and outer groups were formed under
        self.phase, self.phase_since = "idle", time.time()
        self.armed, self.slow_s = [], 0.0
        self.pending_now: list[dict] = []  # injected faults waiting for the next boundary
        self.fault_writer = FolderWriter(write_deadline_s(float(self.cfg.run.io_grace_s)))  # faults_fired.jsonl
        self.yield_at: tuple[int, int, int] | None = None  # (epoch, round, step_in_round)
        self.spare = spare  # a hot spare: warmed, idle, until the supervisor hands it an identity
        self.board = Publisher(
            self.rid
        )  # its committed steps, pushed to the run's store (hsgd/train/progress_board.py)

    def _level_group(self, level: str) -> LevelGroup:
        comm = self.cfg.comm
        return LevelGroup(
            level,
            self.level_backends[level],
            comm.timeout_s,
            comm.configure_timeout_s,
            min_gbps=float(comm.min_gbps),
            link=link_from_config(self.cfg.links[level], seed=self.cfg.seed),
        )

    def _open_step_log(self) -> None:
        """logging.step_times: this replica's committed steps, under the id it trains as (a spare writes none)."""
        if self.trainer.step_log is not None:
            self.trainer.step_log.close()
        self.trainer.step_log = (
            StepLog(os.path.join(self.run_dir, "steps"), self.rid)
            if self.cfg.logging.step_times and not self.spare and not self.rank
            else None
        )

    def _serve_as(self, rid: str | None) -> None:
        """Serve as replica `rid` (its data stream), or as a spare (None). The identity is recorded
        first, so a restart comes back as it; a failed write raises with nothing changed."""
        if self.actor_name:
            lifecycle.write_identity(self.actor_name, rid, spare=rid is None)
        if rid is not None:
            self.trainer.assume_identity(rid)
            self.rid = self.board.rid = rid
        self.spare = rid is None
        self._open_step_log()

    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        """Committed (round, step), phase and process. Answers while a phase runs, so a replica whose
        step advances is slow, never hung; no answer (a GIL-holding hang, a dead process) is no sign of life."""
        return {
            **self._progress(),
            "epoch": self.epoch,
            "phase": self.phase,
            "spare": self.spare,
            "incarnation": self.incarnation,
            "replica_index": self.topo.global_index(self.rid),
            "phase_since": self.phase_since,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "node_id": ray.get_runtime_context().get_node_id(),
            "backends": self.level_backends,
            "startup": self.startup,
            "rank_pids": [os.getpid(), *(self.peers.pids if self.peers else ())],
        }

    def _progress(self) -> dict:
        """The trainer's progress; a restart still building holds a fresh trainer's (round 0, step 0)
        and reports no sizes yet (0: the supervisor keeps the largest it heard)."""
        if self._built.is_set() and self._build_error is None:
            return self.trainer.progress()
        return {
            "rid": self.rid,
            "round": 0,
            "step": 0,
            "param_bytes": 0,
            "tokens_per_step": 0,
            "outer_buffer_round": None,
        }

    @ray.method(concurrency_group="control", num_returns=2)
    def global_state(self) -> tuple[dict, dict]:
        """(meta, state) for a `global` heal; answers while the donor's inner phase runs (outer_commit changes it)."""
        return self._with_ranks("global_state", self._with_meta(self.trainer.global_state()))

    def _with_ranks(self, method: str, own: tuple[dict, dict | None], *args) -> tuple[dict, dict | None]:
        """A heal source's (meta, state) for the whole replica: k > 1, the state is {"ranks": [rank 0's,
        ...]}, each rank's `method` gathered here (a rank that refuses makes the replica refuse)."""
        if self.peers is None or own[1] is None:
            return own
        pairs = [getattr(h, method).options(num_returns=2).remote(*args) for h in self.peers.handles]
        metas = ray.get([meta for meta, _ in pairs], timeout=self.peers.deadline_s)
        refused = next((meta for meta in metas if meta["outcome"] != Outcome.DONE.value), None)
        if refused is not None:
            return refused, None
        apart = [meta for meta in metas if (meta["round"], meta["step"]) != (own[0]["round"], own[0]["step"])]
        if apart:  # a commit landed between the ranks' reads (a global heal reads while the donor trains)
            return self._answer(
                Outcome.COLLECTIVE_FAILED,
                f"{self.rid}: its ranks' states were read at different rounds (a commit in between): asked again",
                bytes=0,
            ), None
        states = [own[1], *ray.get([state for _, state in pairs], timeout=self.peers.deadline_s)]
        return {**own[0], "bytes": sum(meta["bytes"] for meta in [own[0], *metas])}, {"ranks": states}

    def _with_meta(self, state: dict) -> tuple[dict, dict]:
        """A heal source's two objects: a small meta, at the state's own (round, step), and the state."""
        return PhaseAnswer(
            self.rid,
            Outcome.DONE,
            int(state["round"]),
            int(state["step"]),
            result={"pid": os.getpid(), "bytes": _state_bytes(state)},
        ).wire(), state

    @ray.method(concurrency_group="control")
    def digests(self) -> dict:
        """The replica's digests; k > 1: each rank's shard digests combined in rank order as
        hsgd.train.sharding.combined_digest does, gathered through Ray (a control call must not run
        a collective: the phase thread may be in one)."""
        if self.trainer.ranks is None:
            return {
                "param": self.trainer.param_digest(),
                "global": self.trainer.global_digest(),
                "round": self.trainer.round,
                "step": self.trainer.step,
            }
        shards = [self.shard_digests()]
        if self.peers is not None:
            shards += ray.get([h.shard_digests.remote() for h in self.peers.handles], timeout=self.peers.deadline_s)
        return {
            **{key: sharding.digest_of([d[key] for d in shards]) for key in ("param", "global")},
            "round": self.trainer.round,
            "step": self.trainer.step,
        }

    @ray.method(concurrency_group="control")
    def shard_digests(self) -> dict:
        """This rank's own shards' digests (no collective)."""
        return {
            "param": param_digest(self.trainer.params),
            "global": param_digest(self.trainer.outer_opt.global_params),
        }

    @ray.method(concurrency_group="control")
    def stack_dump(self) -> str:
        """Python stacks of every thread in this process (hang reports, jobs.diagnose)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        out = [f"replica {self.rid} pid {os.getpid()} phase {self.phase} since {time.time() - self.phase_since:.1f}s"]
        for ident, frame in sys._current_frames().items():
            out.append(f"--- thread {names.get(ident, ident)} ---")
            out.extend(line.rstrip() for line in traceback.format_stack(frame))
        return "\n".join(out)

    @ray.method(concurrency_group="control")
    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> dict:
        """Ask the inner phase of group epoch `epoch` to return at the boundary before `step_in_round`
        (a replica joins mid-round: every member, the same boundary); another epoch's is ignored."""
        self.yield_at = (epoch, round_index, step_in_round)
        for handle in self.peers.handles if self.peers is not None else ():  # (the ranks agree at each step)
            handle.request_yield.remote(epoch, round_index, step_in_round)
        return {"rid": self.rid, "step": self.trainer.step}

    @ray.method(concurrency_group="control")
    def inject(self, fault: dict) -> dict:
        """A fault from outside the schedule (drills; idle members of a `cluster:` target): a crash at
        once, the others at the phase thread's next step or phase boundary (they act on its work)."""
        if fault["kind"] == "crash":
            self._fire(fault, self.trainer.round, self.trainer.step_in_round)
        self.pending_now.append(fault)
        return self._answer(kind=fault["kind"])

    def _hook(self, phase: str, round_index: int, step_in_round: int) -> None:
        while self.pending_now:
            self._fire(self.pending_now.pop(0), round_index, step_in_round)
        for fault in list(self.armed):
            if fault["phase"] == phase and (
                phase not in ("inner", "inner_sync") or fault.get("step", 0) == step_in_round
            ):
                self.armed.remove(fault)
                self._fire(fault, round_index, step_in_round)

    def _fire(self, fault: dict, round_index: int, step_in_round: int) -> None:
        kind = fault["kind"]
        write_fault_fired(
            self.fault_writer, self.run_dir, self.rid, kind, fault["phase"], round_index, step_in_round, pid=os.getpid()
        )
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
        if kind == "nan":  # the next inner step's loss is NaN, as a diverging replica's
            self.trainer.poison()
        if kind == "error":  # an exception of the replica's own (CUDA OOM, an I/O error, a bug)
            raise InjectedError(f"{self.rid}: injected error in {fault['phase']} of round {round_index}")

    def _fire_startup(self, faults: list[dict] | None) -> None:
        for fault in faults or ():
            self._fire(fault, fault.get("round", self.trainer.round), 0)

    def _answer(self, outcome: Outcome = Outcome.DONE, error: BaseException | str = "", **result) -> dict:
        """The one place an answer is built, at this replica's committed (round, step)."""
        progress = self.trainer.progress()
        return PhaseAnswer(
            self.rid,
            outcome,
            progress["round"],
            progress["step"],
            str(error),
            getattr(error, "kind", ErrorKind.NONE),
            getattr(error, "what", ""),
            {**progress, **result},
        ).wire()

    def _phase(self, name: str, fn, faults: list[dict] | None, hook_round: int | None = None):
        """Run `fn` as phase `name` with `faults` armed (`hook_round`: fire the phase's faults first,
        as of that round) and answer what it returns, or the outcome its exception means."""
        self.phase, self.phase_since = name, time.time()
        self.armed = list(faults or [])
        try:
            if hook_round is not None:
                self._hook(name, hook_round, 0)
            result = dict(fn() or {})
            return self._answer(result.pop("outcome", Outcome.DONE), result.pop("error", ""), **result)
        except Behind as err:
            return self._answer(Outcome.BEHIND, err)
        except NonFiniteError as err:
            if name == "outer":  # the other leaders wait in the all-reduce it never joins: they fail now
                self.outer.abort()
            return self._answer(Outcome.NON_FINITE, err)
        except CollectiveError as err:  # its kind (an ErrorKind) says how it failed, never its text
            return self._answer(Outcome.COLLECTIVE_FAILED, err)
        finally:
            self.phase, self.phase_since = "idle", time.time()
            self.armed = []

    @ray.method(concurrency_group="phase")
    def assume(self, rid: str) -> dict:
        """Hot spare: become replica `rid` (healed next). A failed identity write raises: try another spare."""
        refs = self._fan_out("assume", lambda j: (rid,))
        self._serve_as(rid)
        return self._merged(self._answer(pid=os.getpid(), incarnation=self.incarnation), refs)

    @ray.method(concurrency_group="phase")
    def become_spare(self) -> dict:
        """A restarted replica whose identity a spare took over becomes the cluster's next spare."""
        refs = self._fan_out("become_spare", lambda j: ())
        self._serve_as(None)
        return self._merged(self._answer(warm_s=self.trainer.warm_up(), pid=os.getpid()), refs)

    def _join(self, group: LevelGroup, join: tuple | None, then: str) -> float:
        """Form `group` when the call carries `join` = (epoch, store_addr, prefix, rank, world_size), after
        the `join` faults; the seconds it took. Blocks until every member joined, the supervisor aborts the
        rendezvous (CollectiveError `join_aborted`) or comm.configure_timeout_s passes (`configure`)."""
        if join is None:
            return 0.0
        self._hook("join", self.trainer.round, 0)
        epoch, store_addr, prefix, rank, world_size = join
        t0 = time.monotonic()
        self.phase, self.phase_since = "configure", time.time()
        if group is self.inner:
            self.epoch = epoch
        elif group is self.outer:
            self.outer_epoch = epoch
        group.configure(store_addr, prefix, rank, world_size, epoch)
        self.phase, self.phase_since = then, time.time()
        return time.monotonic() - t0

    def _agreed_join(self, group: LevelGroup, join: tuple | None, then: str) -> float:
        """_join; k > 1: every rank of the replica fails it together, or none does (hsgd.train.sharding.agreed)."""
        return sharding.agreed(lambda: self._join(group, join, then), self.trainer.ranks, f"{self.rid}: {then} join")

    @ray.method(concurrency_group="phase")
    def run_inner(
        self,
        round_index: int,
        faults: list[dict] | None = None,
        join: tuple | None = None,
        overlap: Overlap | None = None,
        steps: int | None = None,
        store_addr: str | None = None,
    ) -> dict:
        """This round's remaining inner steps, of `steps` (sync.balance's plan; None: all of them;
        `join`: form the group first). `behind` if not at the round (it joins all the same, so its
        peers' first collective fails fast). `overlap`: reduce that shard in the background from the
        snapshot step (hsgd/train/overlap.py). `store_addr`: where its steps are published."""
        self.slow_s = 0.0
        self.board.address(store_addr)

        def hook(phase, r, s):
            if phase == "inner" and not self.rank:  # before each step: the steps so far are committed
                self.board.publish(r, self.trainer.step)
            self._hook(phase, r, s)
            if phase != "inner":
                return
            due = self.yield_at is not None and self.yield_at[:2] == (self.epoch, r) and s >= self.yield_at[2]
            if self.trainer.ranks is not None:  # every rank yields at the same boundary, or none does
                due = sharding.any_rank(due, self.trainer.ranks)
            if due:
                self.yield_at = None
                raise YieldNow()
            if self.slow_s:
                time.sleep(self.slow_s)

        def at_snapshot():  # only in the outer group the supervisor named (a restarted process has none)
            if overlap is not None and overlap.epoch == self.outer_epoch:
                self.background.start(
                    (self.trainer.round, overlap.epoch, overlap.shard, overlap.shards, overlap.weights)
                )

        def run():
            join_s = self._agreed_join(self.inner, join, "inner")
            report = self.trainer.run_inner(round_index, self.inner, hook, at_snapshot, steps)
            return {
                "report": report.__dict__,
                "join_s": join_s,
                **({"outcome": Outcome.YIELDED} if report.yielded else {}),
            }

        refs = self._fan_out("run_inner", lambda j: (round_index, None, rank_prefix(join, j), overlap, steps, None))
        return self._merged(self._phase("inner", run, faults), refs)

    @ray.method(concurrency_group="phase")
    def cluster_average(self, round_index: int, epoch: int, faults: list[dict] | None = None) -> dict:
        """inner `none`: cluster mean params on every member (idempotent per (round, epoch)); faults at step 0."""
        refs = self._fan_out("cluster_average", lambda j: (round_index, epoch))
        return self._merged(
            self._phase(
                "inner_sync",
                lambda: self.trainer.cluster_average(round_index, epoch, self.inner),
                faults,
                hook_round=round_index,
            ),
            refs,
        )

    @ray.method(concurrency_group="phase")
    def outer_reduce(
        self,
        round_index: int,
        epoch: int,
        faults: list[dict] | None = None,
        join: tuple | None = None,
        shard: int = 0,
        shards: int = 1,
        weights: tuple[float, ...] = (),
    ) -> dict:
        """Phase 1 of the two-phase commit (OuterReduce; `join`: form the shard's outer group first):
        reduce into a buffer keyed (round, epoch, shard). Nothing is applied: a failure leaves the
        params untouched."""

        def run():
            # a reduce behind the inner steps (overlap) in the standing group this exchange uses is waited
            # for (keyed by that group's epoch: the supervisor's may have moved on since); any other is abandoned
            behind = self._settle(None if join else (round_index, self.outer_epoch, shard, shards, weights))
            join_s = self._agreed_join(self.outer, join, "outer")
            self._hook("outer", round_index, 0)
            before, before_s, before_in = self.outer.bytes_sent, self.outer.link_s, self.outer.bytes_received
            self.trainer.outer_reduce(
                round_index, self.outer_epoch if behind is not None else epoch, self.outer, shard, shards, weights
            )
            spent = behind or {"outer_bytes": 0, "outer_link_bytes": 0, "outer_link_s": 0.0}
            sent = self.outer.bytes_sent - before
            return {
                "outer_bytes": sent + spent["outer_bytes"],
                # this holder's slow-link bytes both ways, and the exchange that moved them (sync.outer_exchange)
                "outer_link_bytes": sent + self.outer.bytes_received - before_in + spent["outer_link_bytes"],
                "outer_exchange": self.trainer.last_exchange,
                "outer_link_s": self.outer.link_s - before_s + spent["outer_link_s"],
                "join_s": join_s,
                "overlapped": behind is not None,
            }

        refs = self._fan_out(
            "outer_reduce", lambda j: (round_index, epoch, None, rank_prefix(join, j), shard, shards, weights)
        )
        return self._merged(self._phase("outer", run, faults), refs)

    @ray.method(concurrency_group="phase")
    def outer_commit(self, round_index: int, roots: tuple, faults: list[dict] | None = None) -> dict:
        """Phase 2, once the supervisor decided commit: inner rank roots[j] broadcasts shard j of the
        buffer, every member applies the same outer step. A round already committed is a no-op."""

        def run():
            self._settle()  # a reduce of an exchange superseded meanwhile
            self._hook("outer_commit", round_index, 0)
            before = self.inner.bytes_sent
            self.trainer.outer_commit(round_index, self.inner, roots)
            return {
                "digest": self.trainer.param_digest(),
                "global_digest": self.trainer.global_digest(),
                "inner_bytes": self.inner.bytes_sent - before,
            }

        refs = self._fan_out("outer_commit", lambda j: (round_index, roots))
        return self._merged(self._phase("outer_commit", run, faults), refs)

    def _settle(self, key: tuple | None = None) -> dict | None:
        """Wait out a background outer reduce (the one keyed `key`; any other is abandoned), within
        the deadline of an outer reduce of the whole model (its all-gather carries every holder's payload)."""
        return self.background.settle(
            key, self.outer.deadline_s(self.trainer.param_bytes * max(1, self.outer.world_size)) + 5.0
        )

    def _load(self, state: dict, scope: str) -> None:
        self._settle()  # its reduce read the state being replaced
        self.trainer.load_state_dict(state, scope=scope)

    @ray.method(concurrency_group="phase")
    def evaluate(self) -> float:
        """Held-out loss of this replica's params (after a commit: the global params). k > 1: every
        rank evaluates (each forward gathers the shards); the losses are the same on every rank."""
        refs = self._fan_out("evaluate", lambda j: ())
        loss = self.trainer.eval_loss()
        if refs:
            ray.get(refs, timeout=self.peers.deadline_s)
        return loss

    @ray.method(concurrency_group="phase")
    def load_state(self, state: dict | None, scope: str, faults: list[dict] | None = None) -> dict:
        """Become the source (`full`) or take its global state (`global`) from `state`, the second
        object of the source's answer. Answers `done` with `bytes`, or `collective_failed`, untouched,
        when the source refused (`state` None). A source that died or raised fails this call."""
        own = state["ranks"][0] if self.peers is not None and state is not None else state

        def run():
            if state is None:  # this replica is fine: its heal is to be planned again
                return {
                    "outcome": Outcome.COLLECTIVE_FAILED,
                    "error": f"{self.rid}: its heal source refused to give its state",
                }
            self._load(own, scope)
            return {"bytes": _state_bytes(own)}  # (k > 1: each rank counts its own; the answers add up)

        # k > 1: a source's state is {"ranks": [rank 0's, ...]} (heal_state, global_state); rank j loads its own
        refs = self._fan_out("load_state", lambda j: (None if state is None else state["ranks"][j], scope))
        return self._merged(self._phase("heal", run, faults, hook_round=self.trainer.round), refs)

    @ray.method(concurrency_group="phase")
    def send_state(self, round_index: int, join: tuple, chunk_mb: float, faults: list[dict] | None = None) -> dict:
        """A `full` heal's source (faults as of `round_index`): join heal group `join` as rank 0 and
        stream its state to every target (hsgd.train.state_stream). Answers `done` with `bytes`, or
        `collective_failed` (a target never joined, a peer died, a chunk timed out): the supervisor
        then heals the targets through the object store."""
        refs = self._fan_out("send_state", lambda j: (round_index, rank_prefix(join, j), chunk_mb))
        return self._merged(
            self._over_heal_group(
                round_index,
                join,
                faults,
                lambda group: {
                    "bytes": state_stream.send_state(
                        group, self.trainer.live_state(), chunk_mb=chunk_mb, device=self.trainer.device
                    ),
                    "pid": os.getpid(),
                },
            ),
            refs,
        )

    @ray.method(concurrency_group="phase")
    def receive_state(self, round_index: int, join: tuple, faults: list[dict] | None = None) -> dict:
        """A heal target (faults as of `round_index`): join heal group `join` (rank >= 1), receive the
        source's whole state, load it `full`. Answers `done` (`bytes`, `transport: group`), or
        `collective_failed` with its state untouched (nothing loads before the last chunk)."""

        def transfer(group: LevelGroup) -> dict:
            state, nbytes = state_stream.receive_state(group, device=self.trainer.device)
            return {"bytes": nbytes, "transport": "group", "state": state}

        refs = self._fan_out("receive_state", lambda j: (round_index, rank_prefix(join, j)))
        return self._merged(self._over_heal_group(round_index, join, faults, transfer), refs)

    def _over_heal_group(self, round_index: int, join: tuple, faults: list[dict] | None, transfer) -> dict:
        """A `heal` phase in its own group (never the standing one), dropped after; answers `transfer(group)`,
        timed. A received `state` is loaded after the group is dropped: the load may wait out an outer reduce."""

        def run():
            group = self._level_group("inner")

            def over_group():  # (k > 1: every rank of the replica fails its part, or none does)
                join_s = self._join(group, join, "heal")
                t0 = time.monotonic()
                return join_s, t0, transfer(group)

            try:
                join_s, t0, answer = sharding.agreed(over_group, self.trainer.ranks, f"{self.rid}: heal transfer")
            finally:
                group.abort()
            if "state" in answer:
                self._load(answer.pop("state"), "full")
            return {**answer, "join_s": join_s, "transfer_s": time.monotonic() - t0}

        return self._phase("heal", run, faults, hook_round=round_index)

    @ray.method(concurrency_group="phase", num_returns=2)
    def heal_state(self, expect: tuple[int, int] | None) -> tuple[dict, dict | None]:
        """(meta, state): a group heal's object-store fallback, only while this replica holds `expect`
        = (round, step), as when chosen as source; else meta `collective_failed`, state None: a source
        restarted meanwhile (Ray runs a queued call on the new process) never hands out fresh state."""
        if expect is not None and (self.trainer.round, self.trainer.step) != tuple(expect):
            return self._answer(
                Outcome.COLLECTIVE_FAILED,
                f"{self.rid}: heal source holds round {self.trainer.round} step {self.trainer.step}, "
                f"not round {expect[0]} step {expect[1]} (restarted since it was chosen)",
                pid=os.getpid(),
                bytes=0,
            ), None
        return self._with_ranks("heal_state", self._with_meta(self.trainer.state_dict()), expect)

    @ray.method(concurrency_group="phase")
    def save_checkpoint(self, directory: str, round_index: int, faults: list[dict] | None = None) -> dict:
        """Its part of the checkpoint of round `round_index`: its `<rid>.pt` file (one rank), or k > 1 its
        `<rid>/` folder, one DCP checkpoint written by every rank of it (hsgd.train.dcp_checkpoint; the
        sha256 answered is that of its manifest.json). `behind` unless it holds exactly that round. A
        write storage refuses (full disk, quota, read-only remount: any exception type) answers
        `io_error`, never raises: the run's problem. Taking the state may still raise."""

        def run():
            if self.trainer.round != round_index:
                raise Behind(
                    f"{self.rid}: checkpoint of round {round_index}, but this replica holds round {self.trainer.round}"
                )
            ranks = self.trainer.ranks
            state = self.trainer.state_dict() if ranks is None else self.trainer.sharded_state()
            try:
                if ranks is None:
                    return {"sha256": checkpoint.save_replica_state(directory, self.rid, state)}
                dcp_checkpoint.save_sharded(
                    state,
                    checkpoint.join_url(directory, self.rid),
                    group=ranks.group,
                    manifest_extra={"round": round_index, "rid": self.rid},
                    timeout_s=float(self.cfg.supervisor.phase_timeout_s),
                )
                return {"sha256": checkpoint.sharded_replica_sha256(directory, self.rid) if not self.rank else ""}
            except Exception as err:  # noqa: BLE001 — storage's failure, see above
                return {
                    "outcome": Outcome.IO_ERROR,
                    "error": f"{self.rid} writing {directory}: {type(err).__name__}: {err}",
                }

        # k > 1: every rank writes its shards (its faults are rank 0's alone)
        refs = self._fan_out("save_checkpoint", lambda j: (directory, round_index))
        # its faults are those of the checkpoint taken after round round_index - 1
        return self._merged(self._phase("checkpoint", run, faults, hook_round=round_index - 1), refs)

    @ray.method(concurrency_group="phase")
    def save_model(self, path: str) -> dict:
        """The committed global model to `path` (model.safetensors); OSError when storage refuses: the run's problem."""
        refs = self._fan_out("save_model", lambda j: (path,))  # (every rank gathers the whole tensors)
        saved = {"rid": self.rid, **self.trainer.save_model(path)}
        if refs:
            ray.get(refs, timeout=self.peers.deadline_s)
        return saved

    @ray.method(concurrency_group="phase")
    def load_checkpoint(
        self, directory: str, sha256: str | None, faults: list[dict] | None = None, fmt: str = checkpoint.FILE_FORMAT
    ) -> dict:
        """Load a checkpoint the caller verified (resume, restore), after its `startup` faults; `fmt` is
        its format (checkpoint.format_of). "file": its `<rid>.pt` (k > 1: each rank cuts its own shards
        out of the whole tensors, ReplicaTrainer.rank_slice). "dcp": its `<rid>/` folder, checked
        against `sha256` and every file against its manifest, then loaded by DCP on every rank,
        resharded to this replica's k (k=1: a world of one). Raises CheckpointError (this replica's
        failure) naming it and its node: a file unreadable or unfit; its state is then untouched."""
        self._fire_startup(faults)
        refs = self._fan_out("load_checkpoint", lambda j: (directory, sha256, None, fmt))
        try:
            if fmt == checkpoint.DCP_FORMAT:
                self._load_sharded(directory, sha256)
            else:
                state = checkpoint.load_replica_state(directory, self.rid, sha256)
                self._load(self.trainer.rank_slice(state), "full")
        except Exception as err:  # noqa: BLE001 — read, sha, unpickling and shape errors alike
            raise checkpoint.CheckpointError(
                f"replica {self.rid} on node {_node_name()} cannot load {directory}: {type(err).__name__}: {err}"
            ) from err
        return self._merged(self._answer(), refs)

    def _load_sharded(self, directory: str, sha256: str | None) -> None:
        """Its DCP folder of a "dcp" checkpoint into this trainer: verified (its manifest against
        `sha256` here; every file by dcp_checkpoint on every rank together), loaded into a template
        (the trainer untouched until DCP read every byte), then applied."""
        ranks = self.trainer.ranks
        # the run manifest's hash of its manifest, on every rank (so all refuse together, none waits in DCP)
        _check_sha(checkpoint.sharded_replica_sha256(directory, self.rid), sha256, directory, self.rid)
        self._settle()  # a background reduce reads the state being replaced
        target = self.trainer.sharded_template()
        dcp_checkpoint.load_sharded(
            target,
            checkpoint.join_url(directory, self.rid),
            group=None if ranks is None else ranks.group,
            timeout_s=float(self.cfg.supervisor.phase_timeout_s),
        )
        self.trainer.load_sharded_state(target)

    @ray.method(concurrency_group="control")
    def reach_checkpoints(self, url: str, nonce: str, faults: list[dict] | None = None) -> dict:
        """At start: can this replica read the nonce the driver wrote under checkpoint.dir?
        {"rid", "node", "problem": None or why not}. `faults`: its `startup` faults."""
        self._fire_startup(faults)
        return {"rid": self.rid, "node": _node_name(), "problem": checkpoint.read_reach_nonce(url, nonce)}


def _startup_marks(marks: dict) -> dict:
    """Wall times (time.time()) of this process's start-up, for the recovery bench's breakdown:
    process created, this module loaded and imported, then __init__'s parts (`init_end`, `init_s`
    in all; `trainer` and `built` when the build ends, behind __init__ on a restart)."""
    try:
        import psutil  # Ray's own dependency

        created = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 — only a figure
        created = None
    return {"process_start": created, "module_t0": _MODULE_T0, "module_t1": _MODULE_T1, **marks}


def _check_sha(actual: str, expected: str | None, directory: str, rid: str) -> None:
    if expected and actual != expected:
        raise checkpoint.CheckpointError(
            f"checkpoint file {checkpoint.join_url(directory, rid)}/manifest.json "
            f"does not match the run manifest's sha256 (corrupt or replaced)"
        )


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state_stream.split_state(state)[1])


def _node_name() -> str:
    """This node as a person finds it: host name, IP address and Ray node id (short)."""
    return f"{socket.gethostname()} ({ray.util.get_node_ip_address()}, {ray.get_runtime_context().get_node_id()[:8]})"
