"""A replica's k rank processes (issue 34, `topology.gpus_per_replica`): its fixed replica group, and
the `RankWorker` actors of ranks 1..k-1 (rank 0 is the Replica actor itself, which fans each call out).

Protocol
- `start_rank_workers(rid, k, options)` creates the k-1 `RankWorker`s of replica `rid` with the Ray
  options of one rank inside the replica's bundle (`ClusterPlacement.options(c, i)`), never restarted
  by Ray (`max_restarts=0`): a rank's death is the whole replica's failure, and the Replica actor
  brings all k back together.
- Every rank calls `form_replica_group(rank, size, store_addr, prefix, timeout_s, ...)` with the same
  `store_addr` (the run's store, `hsgd.train.comm.rendezvous_address`: its secret keeps the keys
  private) and a prefix naming the replica and its incarnation (a restarted replica forms under a
  fresh prefix, so it never reads a dead incarnation's keys). Step 1 is hsgd's arrival barrier in the
  store (hsgd.train.comm's protocol, step 1: the supervisor may abort it with `abort_rendezvous` once
  it knows a rank is dead); step 2 is c10d's `init_process_group` (gloo on CPU, nccl on GPU) over the
  same prefix, bounded by the same timeout.
- The group is this process's default (WORLD) group, holding exactly the replica's k ranks. Why:
  FSDP2's DeviceMesh (`torch.distributed.device_mesh.DeviceMesh.from_group`, in
  hsgd.train.sharding.shard_model) reads this process's rank from the default group (torch 2.13: `get_rank()`, which raises without one), and so
  does `new_group`; a rank actor is a process of its own hosting one rank of one replica, so its
  default group can be that replica's, rank for rank. hsgd's inner/outer levels are torchft groups
  of their own and never touch it.
- The group is never reconfigured: its k ranks share one model's shards, so a rank that dies leaves
  every other rank's shard useless on its own (no rank may keep a half-updated shard). The replica
  is failed as a whole and comes back whole, healed by a peer, as a replica of one process does.
Failures: a rank that never comes: after `timeout_s` every rank that came raises CollectiveError
kind `configure` whose one line names the replica and the missing rank(s); the supervisor's abort:
kind `join_aborted` with its reason; a connect that fails or outlasts `timeout_s`: kind `configure`.
The group's collectives run under `op_timeout_s` (torch.distributed raises past it).

`RankWorker`'s methods are thin calls into its ReplicaTrainer (built with `ranks`), each called on
every rank of the replica alike, in the same order (hsgd.train.sharding's "replica" level).
"""
from __future__ import annotations

from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from hsgd.core.round import ErrorKind
from hsgd.train.comm import CollectiveError, LevelGroup, _await_members
from hsgd.train.sharding import REPLICA_LEVEL, ReplicaRanks


def form_replica_group(rank: int, size: int, store_addr: str, prefix: str, timeout_s: float, *,
                       replica: str = "", backend: str = "gloo", op_timeout_s: float | None = None
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
        raise CollectiveError(f"replica {who}: {REPLICA_LEVEL} group: {err} (rank {rank} waited)",
                              ErrorKind.CONFIGURE) from None
    except Exception as err:  # noqa: BLE001 — the store is gone or unreachable
        raise CollectiveError(f"replica {who}: {REPLICA_LEVEL} group: the store at its rendezvous did not "
                              f"answer rank {rank}: {type(err).__name__}", ErrorKind.CONFIGURE) from err
    if reason is not None:
        raise CollectiveError(f"replica {who}: {REPLICA_LEVEL} group aborted: {reason}", ErrorKind.JOIN_ABORTED)
    store = create_store_client(f"{store_addr}/{prefix}/c10d", timeout=timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=op_timeout_s or timeout_s))
    except Exception as err:  # noqa: BLE001 — a rank died between the barrier and the connect
        raise CollectiveError(f"replica {who}: {REPLICA_LEVEL} group: rank {rank} could not connect "
                              f"({backend}): {str(err).splitlines()[0] if str(err) else type(err).__name__}",
                              ErrorKind.CONFIGURE) from err
    return ReplicaRanks(rank, size, dist.group.WORLD)


def start_rank_workers(rid: str, k: int, options: dict) -> list:
    """The RankWorker handles of ranks 1..k-1 of replica `rid`, each with `options` (one rank's
    resources in the replica's bundle: ClusterPlacement.options(c, i)), never restarted by Ray."""
    return [RankWorker.options(**options, max_restarts=0).remote(rid, j) for j in range(1, k)]


@ray.remote(max_restarts=0)
class RankWorker:
    """Rank `rank` of replica `rid` (logs and stacks name it `<rid>.<rank>`)."""

    def __init__(self, rid: str, rank: int):
        torch.set_num_threads(1)  # several ranks share a few cores
        self.name, self.rid, self.rank = f"{rid}.{rank}", rid, rank
        self.ranks: ReplicaRanks | None = None
        self.trainer = None
        self.levels: dict[str, LevelGroup] = {}

    def form(self, size: int, store_addr: str, prefix: str, timeout_s: float, backend: str = "gloo") -> int:
        self.ranks = form_replica_group(self.rank, size, store_addr, prefix, timeout_s, replica=self.rid,
                                        backend=backend)
        return self.ranks.size

    def build(self, cfg: dict, topology: tuple[int, int], device: str = "cpu") -> int:
        """The sharded ReplicaTrainer (`topology`: (clusters, replicas per cluster)); its param count here."""
        from omegaconf import OmegaConf

        from hsgd.core.topology import Topology
        from hsgd.train.trainer import ReplicaTrainer

        self.trainer = ReplicaTrainer(OmegaConf.create(cfg), self.rid, Topology(*topology), device=device,
                                      ranks=self.ranks)
        return sum(p.numel() for p in self.trainer.params)

    def join(self, level: str, backend: str, store_addr: str | None, prefix: str, rank: int, world_size: int,
             epoch: int, timeout_s: float) -> None:
        """Join this rank's group of `level` (rank j of each replica; world 1: alone, no store)."""
        self.levels[level] = group = LevelGroup(level, backend, timeout_s, timeout_s)
        group.configure(store_addr, prefix, rank=rank, world_size=world_size, epoch=epoch)

    def run_inner(self, round_index: int) -> list[float]:
        return self.trainer.run_inner(round_index, self.levels["inner"]).losses

    def outer_reduce(self, round_index: int, epoch: int) -> None:
        self.trainer.outer_reduce(round_index, epoch, self.levels["outer"])

    def outer_commit(self, round_index: int, roots: tuple[int, ...]) -> None:
        self.trainer.outer_commit(round_index, self.levels["inner"], roots)

    def param_digest(self) -> str:
        return self.trainer.param_digest()

    def eval_loss(self) -> float:
        return self.trainer.eval_loss()

    def leave(self) -> None:
        """Abort its level groups and leave the replica group (the process may then end)."""
        for group in self.levels.values():
            group.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
