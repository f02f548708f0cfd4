"""Replica actor: a thin Ray shell around hsgd.train.trainer.ReplicaTrainer.

Phase methods (concurrency group "phase", one at a time) run at most one level's collectives and
answer a `PhaseAnswer`; control methods answer while a phase runs. A call that raises is this
replica's failure (ActorDiedError: it died; RayTaskError: its own error). A restart keeps only its
identity (actors/lifecycle.py): it rebuilds from the seed (or the resume checkpoint), healed by a peer.
Its faults are actors/replica_faults.py's; its heals and checkpoints actors/replica_state.py's.

After a restart (issue 36; the recovery bench's `restart_breakdown` times each part) __init__ reads
its identity and config and returns at once, so the supervisor's `up` probe is answered within ~10 ms
of the class loading; the trainer (dataset, model, optimizers) builds on a thread of its own while
the supervisor plans its heal. A call that needs it waits for the build (`__getattr__`, at most a
phase call's deadline), and `progress()` answers a fresh trainer's round 0, step 0 until then. A
build that raises makes every call that needs it raise (the replica's own error: it is restarted).
A first start, a spare (ready only when warm) and a replica of k ranks build in __init__. A hot
spare (`topology.spares_per_cluster`) takes the dead replica's id at once and is healed like a restart.

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
import sys  # noqa: E402
import threading  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from actors import lifecycle  # noqa: E402
from actors.hang import install_faulthandler, thread_stacks  # noqa: E402
from actors.rank_group import RankFanOut, RankOf, rank_prefix  # noqa: E402
from actors.replica_faults import FaultHooks  # noqa: E402
from actors.replica_state import StateCalls  # noqa: E402
from hsgd.config.capacity import resolve_level_backend  # noqa: E402
from hsgd.config.layout import layout_of  # noqa: E402
from hsgd.core.faults import FaultSpec  # noqa: E402
from hsgd.core.phases import Phase  # noqa: E402
from hsgd.core.round import CallKind, ErrorKind, GroupJoin, Outcome, Overlap, PhaseAnswer, Progress  # noqa: E402
from hsgd.record.rundir import FolderWriter, write_deadline_s  # noqa: E402
from hsgd.record.steps import StepLog  # noqa: E402
from hsgd.train import sharding  # noqa: E402
from hsgd.train.comm import CollectiveError, LevelGroup, allow_level_overlap, apply_nccl_environment  # noqa: E402
from hsgd.train.overlap import BackgroundReduce  # noqa: E402
from hsgd.train.progress_board import Publisher  # noqa: E402
from hsgd.train.simulate import link_from_config  # noqa: E402
from hsgd.train.trainer import Behind, NonFiniteError, ReplicaTrainer, YieldNow  # noqa: E402

_MODULE_T1 = time.time()  # its imports done

_BUILT = ("trainer", "background")  # built in __init__, or behind it on a restart


@ray.remote(concurrency_groups={"phase": 1, "control": 2, "watch": 1})
class Replica(RankFanOut, FaultHooks, StateCalls):
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
        rank_of: RankOf | None = None,
    ):
        """`backends`: {"inner", "outer"} as planned (resolve_level_backend); `index_table`: the run's.
        k > 1 ranks: `rank_options` (rank 0), the Ray options of its other ranks; `rank_of` (ranks 1..k-1),
        where to form the replica group (actors/rank_group.py)."""
        marks = {"init_begin": time.time()}
        torch.set_num_threads(1)  # several replicas share a few cores
        # a promoted spare that Ray restarts comes back as the replica it replaced (actors/lifecycle.py)
        self.actor_name = ray.get_runtime_context().get_actor_name()
        identity = lifecycle.read_identity(self.actor_name)
        if identity is not None:
            rid, spare = identity["rid"] or rid, bool(identity["spare"])
        self.incarnation = lifecycle.own_incarnation()
        self.rank_of, self.rank = rank_of, rank_of.rank if rank_of else 0
        self.rank_options, self.peers = rank_options, None
        self.made_with = (cfg, run_dir, backends, index_table)  # what ranks 1..k-1 are created with
        install_faulthandler(run_dir, rid if not self.rank else f"{rid}.{self.rank}")
        self.started_at = time.time()
        marks["identity"] = self.started_at
        self.cfg = OmegaConf.create(cfg)
        self.rid, self.run_dir = rid, run_dir
        # its layout, once: its config's sites (a joined site's config names it) and the run's index table
        self.layout = layout_of(self.cfg, index_table)  # (the topology: this id's data stream)
        gpu = bool(ray.get_runtime_context().get_accelerator_ids().get("GPU")) and torch.cuda.is_available()
        # (not `self.backends`: an attribute named like a torch submodule makes Ray's cloudpickle
        # pickle torch.backends with the class, which cannot be pickled)
        self.level_backends = {
            level: resolve_level_backend(backends[level], level=level, gpu=gpu) for level in ("inner", "outer")
        }
        device = "cuda" if self.level_backends["inner"] == "nccl" else "cpu"  # where the inner level reduces
        marks["config"] = time.time()
        self.topo = self.layout.topology
        apply_nccl_environment(self.cfg.comm.configure_timeout_s)  # before any group
        self.inner, self.outer = self._level_group("inner"), self._level_group("outer")  # (configured when joined)
        # sync.fragment_delay: a shard holder's outer reduce runs behind the round's last inner steps
        allow_level_overlap(int(self.cfg.sync.fragment_delay) > 0)
        self._init_state(spare)
        self.startup = _startup_marks(marks)
        self._built, self._build_error = threading.Event(), None
        self._start_build(device, restart=bool(self.incarnation) and not spare)
        self.startup["init_end"] = time.time()
        self.startup["init_s"] = self.startup["init_end"] - marks["init_begin"]

    def _start_build(self, device: str, *, restart: bool) -> None:
        """A restart: answer `up` now, build while the supervisor plans its heal; but a replica of k ranks
        builds first (starting its other ranks' processes takes seconds, which its heal source and every
        member would otherwise spend waiting in the heal). The first start (a config error surfaces
        here) and spares (warmed before they are ready) build in __init__."""
        if restart and self.layout.ranks_per_replica == 1:
            threading.Thread(target=self._build_behind, args=(device,), name="replica-build", daemon=True).start()
        elif restart:  # k > 1: a failed build ends the process, so Ray restarts it
            try:  # (a constructor that raises is never restarted)
                self._build(device)
            except BaseException as err:  # noqa: BLE001 — the replica's own failure, as a restart's build
                print(
                    f"replica {self.rid}: its restart could not start its ranks: {type(err).__name__}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
        else:
            self._build(device)

    def _rank_actor(self, rank_of: RankOf):
        """Rank 0 of k > 1: rank `rank_of.rank` of this replica, a Replica actor of its own that Ray never
        restarts (actors/rank_group.py)."""
        cfg, run_dir, backends, index_table = self.made_with
        return Replica.options(**self.rank_options, max_restarts=0, max_task_retries=0).remote(
            cfg, self.rid, run_dir, backends, self.spare, index_table, rank_of=rank_of
        )

    def _build(self, device: str) -> None:
        """The trainer (dataset, model, optimizers: torch's lazy imports on the first one); k > 1: the
        replica group first (rank 0 creates the other ranks), and rank 0 waits for them to be built."""
        ranks = self._form_ranks(device)
        self.trainer = ReplicaTrainer(self.cfg, self.rid, self.topo, device=device, ranks=ranks, layout=self.layout)
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

    def _build_behind(self, device: str) -> None:
        torch.set_num_threads(1)  # (per thread for OpenMP)
        try:
            self._build(device)
        except BaseException as err:  # noqa: BLE001 — every call that needs the trainer raises it
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
        self.phase, self.phase_since = Phase.IDLE, time.time()
        self.armed, self.slow_s = [], 0.0
        self.pending_now: list[FaultSpec] = []  # injected faults waiting for the next boundary
        self.fault_writer = FolderWriter(write_deadline_s(float(self.cfg.run.io_grace_s)))  # faults_fired.jsonl
        self.yield_at: tuple[int, int, int] | None = None  # (epoch, round, step_in_round)
        self.spare = spare  # a hot spare: warmed, idle, until the supervisor hands it an identity
        # its committed steps, pushed to the run's store (hsgd/train/progress_board.py)
        self.board = Publisher(self.rid)

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
        fresh = dict.fromkeys(("round", "step", "param_bytes", "tokens_per_step"), 0)
        return {"rid": self.rid, **fresh, "outer_buffer_round": None}

    @ray.method(concurrency_group="control")
    def stack_dump(self) -> str:
        """Python stacks of every thread in this process (hang reports, jobs.diagnose)."""
        since = time.time() - self.phase_since
        return thread_stacks(f"replica {self.rid} pid {os.getpid()} phase {self.phase} since {since:.1f}s")

    @ray.method(concurrency_group="control")
    def request_yield(self, epoch: int, round_index: int, step_in_round: int) -> Progress:
        """Ask the inner phase of group epoch `epoch` to return at the boundary before `step_in_round`
        (a replica joins mid-round: every member, the same boundary); another epoch's is ignored."""
        self.yield_at = (epoch, round_index, step_in_round)
        self._fan_out("request_yield", lambda j: (epoch, round_index, step_in_round))  # (they agree at each step)
        return Progress(self.rid, self.trainer.step)

    def _answer(self, outcome: Outcome = Outcome.DONE, error: BaseException | str = "", **result) -> PhaseAnswer:
        """The one place an answer is built, at this replica's committed (round, step)."""
        progress = self.trainer.progress()
        numbers = {key: value for key, value in {**progress, **result}.items() if key not in ("rid", "round", "step")}
        return PhaseAnswer(
            self.rid,
            outcome,
            progress["round"],
            progress["step"],
            str(error),
            getattr(error, "kind", ErrorKind.NONE),
            getattr(error, "what", ""),
            numbers,
        )

    def _phase(self, name: Phase, fn, faults: list[FaultSpec] | None, hook_round: int | None = None) -> PhaseAnswer:
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
            if name == Phase.OUTER:  # the other leaders wait in the all-reduce it never joins: they fail now
                self.outer.abort()
            return self._answer(Outcome.NON_FINITE, err)
        except CollectiveError as err:  # its kind (an ErrorKind) says how it failed, never its text
            return self._answer(Outcome.COLLECTIVE_FAILED, err)
        finally:
            self.phase, self.phase_since = Phase.IDLE, time.time()
            self.armed = []

    @ray.method(concurrency_group="phase")
    def assume(self, rid: str) -> PhaseAnswer:
        """Hot spare: become replica `rid` (healed next). A failed identity write raises: try another spare."""
        refs = self._fan_out("assume", lambda j: (rid,))
        self._serve_as(rid)
        return self._merged(self._answer(pid=os.getpid(), incarnation=self.incarnation), refs)

    @ray.method(concurrency_group="phase")
    def become_spare(self) -> PhaseAnswer:
        """A restarted replica whose identity a spare took over becomes the cluster's next spare."""
        refs = self._fan_out("become_spare", lambda j: ())
        self._serve_as(None)
        return self._merged(self._answer(warm_s=self.trainer.warm_up(), pid=os.getpid()), refs)

    def _join(self, group: LevelGroup, join: GroupJoin | None, then: Phase) -> float:
        """Form `group` when the call carries `join`, after the `join` faults; the seconds it took. Blocks
        until every member joined, the supervisor aborts the rendezvous (CollectiveError `join_aborted`)
        or comm.configure_timeout_s passes (`configure`)."""
        if join is None:
            return 0.0
        self._hook(Phase.JOIN, self.trainer.round, 0)
        t0 = time.monotonic()
        self.phase, self.phase_since = Phase.CONFIGURE, time.time()
        if group is self.inner:
            self.epoch = join.epoch
        elif group is self.outer:
            self.outer_epoch = join.epoch
        group.configure(join.store_addr, join.prefix, join.rank, join.world_size, join.epoch)
        self.phase, self.phase_since = then, time.time()
        return time.monotonic() - t0

    def _agreed_join(self, group: LevelGroup, join: GroupJoin | None, then: Phase) -> float:
        """_join; k > 1: every rank of the replica fails it together, or none does (hsgd.train.sharding.agreed)."""
        return sharding.agreed(lambda: self._join(group, join, then), self.trainer.ranks, f"{self.rid}: {then} join")

    @ray.method(concurrency_group="phase")
    def run_inner(
        self,
        round_index: int,
        faults: list[FaultSpec] | None = None,
        join: GroupJoin | None = None,
        overlap: Overlap | None = None,
        steps: int | None = None,
        store_addr: str | None = None,
    ) -> PhaseAnswer:
        """This round's remaining inner steps, of `steps` (sync.balance's plan; None: all of them;
        `join`: form the group first). `behind` if not at the round (it joins all the same, so its
        peers' first collective fails fast). `overlap`: reduce that shard in the background from the
        snapshot step (hsgd/train/overlap.py). `store_addr`: where its steps are published."""
        self.slow_s = 0.0
        self.board.address(store_addr)

        def hook(phase, r, s):
            if phase == Phase.INNER and not self.rank:  # before each step: the steps so far are committed
                self.board.publish(r, self.trainer.step)
            self._hook(phase, r, s)
            if phase != Phase.INNER:
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
            join_s = self._agreed_join(self.inner, join, Phase.INNER)
            report = self.trainer.run_inner(round_index, self.inner, hook, at_snapshot, steps)
            return {
                "report": report.__dict__,
                "join_s": join_s,
                **({"outcome": Outcome.YIELDED} if report.yielded else {}),
            }

        refs = self._fan_out("run_inner", lambda j: (round_index, None, rank_prefix(join, j), overlap, steps, None))
        return self._merged(self._phase(Phase.INNER, run, faults), refs)

    @ray.method(concurrency_group="phase")
    def cluster_average(self, round_index: int, epoch: int, faults: list[FaultSpec] | None = None) -> PhaseAnswer:
        """inner `none`: cluster mean params on every member (idempotent per (round, epoch)); faults at step 0."""
        refs = self._fan_out("cluster_average", lambda j: (round_index, epoch))
        return self._merged(
            self._phase(
                Phase.INNER_SYNC,
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
        faults: list[FaultSpec] | None = None,
        join: GroupJoin | None = None,
        shard: int = 0,
        shards: int = 1,
        weights: tuple[float, ...] = (),
    ) -> PhaseAnswer:
        """Phase 1 of the two-phase commit (OuterReduce; `join`: form the shard's outer group first):
        reduce into a buffer keyed (round, epoch, shard). Nothing is applied: a failure leaves the
        params untouched."""

        def run():
            # a reduce behind the inner steps (overlap) in the standing group this exchange uses is waited
            # for (keyed by that group's epoch: the supervisor's may have moved on since); any other is abandoned
            behind = self._settle(None if join else (round_index, self.outer_epoch, shard, shards, weights))
            join_s = self._agreed_join(self.outer, join, Phase.OUTER)
            self._hook(Phase.OUTER, round_index, 0)
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
        return self._merged(self._phase(Phase.OUTER, run, faults), refs)

    @ray.method(concurrency_group="phase")
    def outer_commit(self, round_index: int, roots: tuple, faults: list[FaultSpec] | None = None) -> PhaseAnswer:
        """Phase 2, once the supervisor decided commit: inner rank roots[j] broadcasts shard j of the
        buffer, every member applies the same outer step. A round already committed is a no-op."""

        def run():
            self._settle()  # a reduce of an exchange superseded meanwhile
            self._hook(Phase.OUTER_COMMIT, round_index, 0)
            before = self.inner.bytes_sent
            self.trainer.outer_commit(round_index, self.inner, roots)
            return {
                "digest": self.trainer.param_digest(),
                "global_digest": self.trainer.global_digest(),
                "inner_bytes": self.inner.bytes_sent - before,
            }

        refs = self._fan_out(CallKind.OUTER_COMMIT, lambda j: (round_index, roots))
        return self._merged(self._phase(Phase.OUTER_COMMIT, run, faults), refs)

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
        self._ranks_done(refs)
        return loss


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
