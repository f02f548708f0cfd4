"""A replica's k rank processes (issue 34, `topology.gpus_per_replica`): its fixed replica group, and
rank 0's handles of ranks 1..k-1 (`RankPeers`). Rank 0 is the Replica actor the roster knows; ranks
1..k-1 are Replica actors too (actors/replica.py, built with `rank_of`), running the same phase bodies
and collectives in the same order. Why the group is WORLD and never reconfigured: docs/scaling.md.

Protocol
- Rank 0 starts a store of the replica's own (`hsgd.train.comm.start_store`, a fresh secret);
  `RankPeers.start` creates ranks 1..k-1 in the replica's bundle (`ClusterPlacement.options(c, i)`),
  never restarted by Ray (`max_restarts=0`), owned by rank 0, which watches them (`RankPeers.watch`)
  and ends its own process at once when one ends: Ray brings rank 0 back, which starts all k afresh.
- Every rank calls `form_replica_group(rank, size, store_addr, prefix, timeout_s, ...)` with one
  `store_addr` and a prefix naming the replica and its incarnation: (1) hsgd's arrival barrier in the
  store (hsgd.train.comm's step 1); (2) c10d's `init_process_group` over that prefix, under the same
  timeout (gloo on CPU; `cpu:gloo,cuda:nccl` on GPU): the default group, the replica's k ranks; (3)
  the background group (`ReplicaRanks.background`, gloo) an outer reduce behind the inner steps agrees
  over (sync.fragment_delay, hsgd.train.overlap), never interleaving with FSDP2's on the first.
- Rank 0 fans every phase call out (`RankPeers.call`: rank j's own arguments, e.g. its level groups
  under `<prefix>/rank<j>`), runs its own part, then merges the answers (`RankPeers.merge`): a rank
  that raised is the replica's own error; a rank whose answer is not `done` makes it the replica's.
Failures: a rank that dies fails the replica whole (it comes back whole, healed by a peer); a rank
that never comes: after `timeout_s` (a Replica passes `supervisor.call_timeout_s` +
`comm.configure_timeout_s`: a process start, then the rendezvous) each rank that came raises
CollectiveError kind `configure` naming the replica and the missing rank(s); a connect that fails
or outlasts `timeout_s`: kind `configure`; the supervisor's abort: kind `join_aborted`, with its
reason. The group's collectives run under `op_timeout_s` (torch.distributed raises past it).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import ray
import torch.distributed as dist

from hsgd.core.round import ErrorKind, GroupJoin, Outcome, PhaseAnswer
from hsgd.train import sharding
from hsgd.train.comm import (
    CollectiveError,
    _await_members,
    new_run_secret,
    rendezvous_address,
    shard_prefix,
    start_store,
)
from hsgd.train.sharding import REPLICA_LEVEL, ReplicaRanks
from hsgd.train.trainer import param_digest


def form_replica_group(
    rank: int,
    size: int,
    store_addr: str,
    prefix: str,
    timeout_s: float,
    *,
    replica: str = "",
    backend: str = "gloo",
    op_timeout_s: float | None = None,
) -> ReplicaRanks:
    """Join this process's replica group as `rank` of `size` (the module's protocol); returns its
    ReplicaRanks. `replica`: the id errors name (default: `prefix`); `op_timeout_s`: the group's
    collective timeout (default `timeout_s`). Raises CollectiveError (the module's failures)."""
    from torchft.process_group import create_store_client

    who = replica or prefix
    if dist.is_initialized():
        raise RuntimeError(f"replica {who}: rank {rank} already holds a replica group in this process")
    try:
        reason = _await_members(store_addr, prefix, rank, size, timeout_s)
    except TimeoutError as err:  # "rank(s) 1 of 2 did not arrive within 3s"
        raise CollectiveError(
            f"replica {who}: {REPLICA_LEVEL} group: {err} (rank {rank} waited)", ErrorKind.CONFIGURE
        ) from None
    except Exception as err:  # noqa: BLE001 — the store is gone or unreachable
        raise CollectiveError(
            f"replica {who}: {REPLICA_LEVEL} group: the store at its rendezvous did not "
            f"answer rank {rank}: {type(err).__name__}",
            ErrorKind.CONFIGURE,
        ) from err
    if reason is not None:
        raise CollectiveError(f"replica {who}: {REPLICA_LEVEL} group aborted: {reason}", ErrorKind.JOIN_ABORTED)
    store = create_store_client(f"{store_addr}/{prefix}/c10d", timeout=timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=op_timeout_s or timeout_s)
        )
        # the background group: a collective of every rank, in the same order (right after the first)
        background = dist.new_group(
            list(range(size)), timeout=timedelta(seconds=op_timeout_s or timeout_s), backend="gloo"
        )
    except Exception as err:  # noqa: BLE001 — a rank died between the barrier and the connect
        raise CollectiveError(
            f"replica {who}: {REPLICA_LEVEL} group: rank {rank} could not connect "
            f"({backend}): {str(err).splitlines()[0] if str(err) else type(err).__name__}",
            ErrorKind.CONFIGURE,
        ) from err
    return ReplicaRanks(rank, size, dist.group.WORLD, background)


def rank_prefix(join: GroupJoin | None, rank: int) -> GroupJoin | None:
    """Rank `rank`'s join of a level group: the replica's join under hsgd.train.comm.shard_prefix, the
    group of rank `rank` of every replica (the supervisor's abort of the replica's prefix reaches it)."""
    if join is None or rank == 0:
        return join
    return replace(join, prefix=shard_prefix(join.prefix, rank))


def replica_group_backend(device: str) -> str:
    """The replica group's backend: gloo on the CPU; on GPU nccl for FSDP2's tensors and gloo for the
    small host-side agreements (hsgd.train.sharding's `agreed`, digests)."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


@dataclass(frozen=True)
class RankOf:
    """Rank `rank` of a replica of `size` ranks: where it forms the replica group (the module's protocol)."""

    rank: int
    size: int
    store_addr: str
    prefix: str


class RankPeers:
    """Rank 0's handles of ranks 1..k-1 of its replica (the module's protocol)."""

    def __init__(self, rid: str, handles: list, store, deadline_s: float):
        self.rid, self.handles, self.deadline_s = rid, handles, deadline_s
        self.pids: list[int] = []  # of ranks 1..k-1, once ready (progress() reports them: diagnostics, drills)
        self.store = store  # the replica group's store: kept alive as long as rank 0 is

    @classmethod
    def start(
        cls,
        rid: str,
        k: int,
        make: Callable[[RankOf], object],
        arrive_s: float,
        deadline_s: float,
        incarnation: int,
    ) -> tuple[RankPeers, RankOf]:
        """Rank 0's store and ranks 1..k-1 (`make(rank_of)` creates one); returns them and rank 0's own RankOf.
        `arrive_s`: the store's wait for a rank to connect; `deadline_s`: for a built rank's answers."""
        host = ray.util.get_node_ip_address()
        store = start_store(host, arrive_s)
        store_addr = rendezvous_address(host, store.port, new_run_secret())
        prefix = f"replica-group/{rid}/{incarnation}"
        handles = [make(RankOf(j, k, store_addr, prefix)) for j in range(1, k)]
        return cls(rid, handles, store, deadline_s), RankOf(0, k, store_addr, prefix)

    def ready(self) -> None:
        """Wait until ranks 1..k-1 are built (their __init__ formed the group and built the trainer)."""
        answers = ray.get([h.progress.remote() for h in self.handles], timeout=self.deadline_s)
        self.pids = [answer["pid"] for answer in answers]

    def call(self, method: str, args_of: Callable[[int], tuple]) -> list:
        """Start `method` on ranks 1..k-1, rank j with the arguments args_of(j); their refs."""
        return [getattr(h, method).remote(*args_of(j)) for j, h in enumerate(self.handles, start=1)]

    def merge(self, own: PhaseAnswer, refs: list) -> PhaseAnswer:
        """Rank 0's answer `own` with ranks 1..k-1's (`refs`): the first that is not `done` when
        rank 0's is. A rank that raised, died or did not answer within the deadline raises: the
        replica's own error (it is restarted whole)."""
        answers = [PhaseAnswer.read(answer) for answer in ray.get(refs, timeout=self.deadline_s)]
        if own.outcome is not Outcome.DONE:
            return own
        for answer in answers:
            if answer.outcome is not Outcome.DONE:
                return replace(
                    own, outcome=answer.outcome, error=answer.error, error_kind=answer.error_kind, what=answer.what
                )
        return replace(own, result=_with_bytes_summed(own.result, [answer.result for answer in answers]))

    def watch(self) -> None:
        """A thread that ends this process (rank 0) when any other rank ends: the replica fails
        whole, as if rank 0 had been killed (module protocol). Daemon: it never holds a shutdown."""
        refs = [h.watch.remote() for h in self.handles]

        def wait() -> None:
            done, _ = ray.wait(refs, num_returns=1)  # a watch call returns only when its rank is gone
            rank = refs.index(done[0]) + 1
            print(
                f"replica {self.rid}: rank {rank} ({self.rid}.{rank}) is gone: the replica fails whole",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

        threading.Thread(target=wait, name="rank-watch", daemon=True).start()


_BYTES = ("bytes", "inner_bytes", "outer_bytes", "outer_link_bytes")  # each rank's of its own shards


def _with_bytes_summed(own: dict, answers: list[dict]) -> dict:
    """Rank 0's answer with the byte counts of every rank added up (each rank moves its own shards),
    also those of an inner phase's `report`."""
    merged = {**own, **{key: own[key] + sum(a.get(key, 0) for a in answers) for key in _BYTES if key in own}}
    if isinstance(own.get("report"), dict) and "inner_bytes" in own["report"]:
        merged["report"] = {
            **own["report"],
            "inner_bytes": own["report"]["inner_bytes"]
            + sum(a.get("report", {}).get("inner_bytes", 0) for a in answers),
        }
    return merged


class RankFanOut:
    """The k-rank part of actors/replica.py's Replica (mixed into it): rank 0 creates ranks 1..k-1
    (the Replica's `_rank_actor`), every rank forms the replica group, and rank 0 fans each phase
    call out (`_fan_out`) and merges the answers (`_merged`); ranks 1..k-1 are watched (`watch`)."""

    def _form_ranks(self, device: str) -> ReplicaRanks | None:
        """k > 1: this rank's place in the replica group (rank 0 first creates ranks 1..k-1); else None."""
        k = self.layout.ranks_per_replica
        if k <= 1:
            return None
        # a rank's arrival waits for a new process (Ray's worker start, torch's import: a control call's
        # deadline, as a replica's own start) and then the rendezvous; once built, a rank answers within
        # a phase call's deadline (its build, a spare's warm-up, any phase's part)
        sup = self.cfg.supervisor
        arrive_s = float(sup.call_timeout_s + self.cfg.comm.configure_timeout_s)
        if self.rank_of is None:  # rank 0
            self.peers, self.rank_of = RankPeers.start(
                self.rid, k, self._rank_actor, arrive_s, float(sup.phase_timeout_s), self.incarnation
            )
        return form_replica_group(
            self.rank_of.rank,
            self.rank_of.size,
            self.rank_of.store_addr,
            self.rank_of.prefix,
            arrive_s,
            replica=self.rid,
            backend=replica_group_backend(device),
            op_timeout_s=float(self.cfg.supervisor.phase_timeout_s),
        )

    def _fan_out(self, method: str, args_of: Callable[[int], tuple]) -> list:
        """Rank 0 of k > 1: start `method` on the other ranks (rank j with args_of(j)); their refs."""
        return self.peers.call(method, args_of) if self.peers is not None else []

    def _merged(self, own: PhaseAnswer, refs: list) -> PhaseAnswer:
        return self.peers.merge(own, refs) if refs else own

    def _ranks_done(self, refs: list) -> None:
        """Wait for the other ranks' part of a call whose answer is rank 0's alone (their errors raise)."""
        if refs:
            ray.get(refs, timeout=self.peers.deadline_s)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Ranks 1..k-1: never returns while this process lives (rank 0's RankPeers.watch)."""
        # no deadline by design: this call ends only with the process, which is what rank 0 watches for
        threading.Event().wait()

    def _with_ranks(self, method: str, own: tuple[PhaseAnswer, dict | None], *args) -> tuple[PhaseAnswer, dict | None]:
        """A heal source's (meta, state) for the whole replica: k > 1, the state is {"ranks": [rank 0's,
        ...]}, each rank's `method` gathered here (a rank that refuses makes the replica refuse)."""
        if self.peers is None or own[1] is None:
            return own
        pairs = [getattr(h, method).options(num_returns=2).remote(*args) for h in self.peers.handles]
        metas = ray.get([meta for meta, _ in pairs], timeout=self.peers.deadline_s)
        refused = next((meta for meta in metas if meta.outcome is not Outcome.DONE), None)
        if refused is not None:
            return refused, None
        apart = [meta for meta in metas if (meta.round, meta.step) != (own[0].round, own[0].step)]
        if apart:  # a commit landed between the ranks' reads (a global heal reads while the donor trains)
            return self._answer(
                Outcome.COLLECTIVE_FAILED,
                f"{self.rid}: its ranks' states were read at different rounds (a commit in between): asked again",
                bytes=0,
            ), None
        states = [own[1], *ray.get([state for _, state in pairs], timeout=self.peers.deadline_s)]
        nbytes = sum(meta.result["bytes"] for meta in [own[0], *metas])
        return replace(own[0], result={**own[0].result, "bytes": nbytes}), {"ranks": states}

    def _ranks_shard_digests(self) -> list[dict]:
        """Ranks 1..k-1's own shard digests, in rank order, through Ray (no collective: a control call)."""
        if self.peers is None:
            return []
        return ray.get([h.shard_digests.remote() for h in self.peers.handles], timeout=self.peers.deadline_s)

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
        shards = [self.shard_digests(), *self._ranks_shard_digests()]
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
