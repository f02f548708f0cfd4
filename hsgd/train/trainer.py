"""What one replica owns and the work it does when the supervisor tells it to.

A `ReplicaTrainer` holds a full model copy (this rank's shards when `ranks` is given: sharding.py),
its inner optimizer, the round-start global params with the outer optimizer (outer.py) and its
counters: `round` (committed rounds) and `step` (committed inner steps in total). Its data position
and its inner learning rate are functions of its step, so a healed or resumed replica needs no
data-loader or RNG state. Each phase method runs ONE level's collectives, never both:
`run_inner` (inner.py), `cluster_average`, `outer_reduce` and `outer_commit` (outer.py).
Failures:
- A failed collective raises `hsgd.train.comm.CollectiveError` and leaves the state exactly where
  the last committed step left it (a localsgd step whose average failed is rolled back, so its
  retry never applies the optimizer step twice); the step in flight is redone after re-planning.
- A non-finite loss or gradient norm sets a flag on the device (no per-step host sync), read once
  at the phase's end, where `run_inner` raises `NonFiniteError`: the replica must be healed.
  `outer_reduce` raises it before sending a non-finite pseudo-gradient.
- Sharded, replica-level collectives run inside the phase methods, so every rank raises together.
Phase calls are idempotent per (round, phase): a call for a round already committed is a no-op,
one for a round this replica has not reached raises `Behind`.
Heals: `state_dict` (`full`, rank j from rank j) and `global_state`; checkpoints: `state_dict`, or
`sharded_state` resharded by DCP (sharding.ShardedState). Narrative: docs/concepts.md.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from typing import Any

import torch

from hsgd.config.auto import outer_step_of
from hsgd.config.layout import RunLayout, layout_of
from hsgd.config.rounds import is_streaming
from hsgd.core.topology import Topology
from hsgd.train import sharding, task
from hsgd.train.buckets import GradBuckets
from hsgd.train.checkpoint import write_atomic
from hsgd.train.inner import (  # YieldNow, NonFiniteError: re-exported, the replica actor's names for them
    InnerPhase,
    NonFiniteError,
    YieldNow,
    build_inner_optimizer,
    optimizer_implementation,
)
from hsgd.train.outer import OuterSync
from hsgd.train.sharding import ReplicaRanks, ShardedState
from hsgd.train.simulate import pacer_from_config
from hsgd.train.state_stream import join_state, split_state

__all__ = ["Behind", "NonFiniteError", "ReplicaTrainer", "YieldNow", "param_digest"]


class Behind(RuntimeError):
    """A phase call for a round this replica has not reached: it must be healed first."""


def param_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the tensors, in order: equal digests = bitwise-equal params."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReplicaTrainer(InnerPhase, OuterSync, ShardedState):
    """One replica (or one rank of a sharded one): the state it owns, its phases (InnerPhase,
    OuterSync), its heal and checkpoint state (here and ShardedState), its evaluation and digests."""

    def __init__(
        self,
        cfg: Any,
        rid: str,
        topology: Topology,
        *,
        device: str = "cpu",
        dataset: task.Dataset | None = None,
        ranks: ReplicaRanks | None = None,
        layout: RunLayout | None = None,
    ):
        """`layout`: the run's (its steps per round; its clusters for an auto outer step); None: the config's
        (`layout_of`: a test, a benchmark). `topology`: this replica's, which its data stream follows."""
        layout = layout if layout is not None else layout_of(cfg)
        self.cfg, self.rid, self.topology, self.device = cfg, rid, topology, device
        self.ranks = ranks if sharding.is_sharded(ranks) else None  # None: one process holds the whole replica
        self.device_type = torch.device(device).type
        self.global_index = topology.global_index(rid)
        self.deterministic = bool(cfg.train.deterministic) and self.device_type == "cuda"
        if self.deterministic:  # before the first cuBLAS call: the workspace size is read once
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.dataset = dataset or task.build_dataset(cfg)
        torch.manual_seed(cfg.seed)  # identical initial params on every replica
        self.model = task.build_model(cfg, self.dataset.vocab_size).to(device)
        if self.ranks is not None:  # sharded after the same seed: rank j's shards are k=1's rows
            sharding.shard_model(self.model, self.ranks, self.device_type)
        self.sharded = list(self.model.parameters())  # the module's own (DTensors when sharded)
        self.params = [sharding.local(p) for p in self.sharded]  # this rank's (k=1: the params themselves)
        self.param_names = [name for name, _ in self.model.named_parameters()]  # aligned with params
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)  # what a heal or outer sync moves
        # the whole replica's (sharded: every rank's together; a DTensor's numel is the whole tensor's),
        # what the supervisor scales deadlines by: a heal through the object store carries every rank's state
        self.replica_param_bytes = sum(p.numel() * p.element_size() for p in self.sharded)
        self.loss_fn = task.build_loss(cfg)
        # the steps run the compiled module; heals, checkpoints and evaluation use self.model's params
        self.step_model = torch.compile(self.model) if cfg.train.compile else self.model
        self.inner_opt = build_inner_optimizer(cfg, self.params, device)
        self.foreach = optimizer_implementation(cfg, device) != "single"
        self._init_outer(cfg, outer_step_of(cfg, layout))  # the global params, outer optimizer, codec
        self.grad_accum = int(cfg.data.grad_accum)
        per_batch = getattr(self.dataset, "tokens_per_batch", None) or cfg.data.batch_size * cfg.model.block_size
        self.tokens_per_step = int(per_batch) * self.grad_accum
        self.steps_per_round = layout.steps_per_round
        # inner ddp: gradient buckets all-reduced from backward hooks as they fill (bucket_mb <= 0: after backward)
        # (sharded: FSDP2's own per-block buckets reduce inside the replica; the shards after backward)
        bucket_mb = float(cfg.comm.bucket_mb)
        bucketed = cfg.sync.inner == "ddp" and bucket_mb > 0 and self.ranks is None
        self.buckets = GradBuckets(self.params, bucket_mb) if bucketed else None
        self.round, self.step = 0, 0
        self.round_steps = self.steps_per_round  # this round's inner steps (sync.balance plans fewer)
        self.round_losses: list[float] = []
        # simulated step time / stragglers: None unless configured
        self.pacer = pacer_from_config(cfg, topology.cluster_of(rid))
        self.step_log = None  # logging.step_times: an hsgd.record.steps.StepLog, told each committed step
        # [loss, grad norm] ever non-finite since the last heal/commit: on the device, read at a phase's end
        self._nonfinite = torch.zeros(2, dtype=torch.bool, device=device)
        self._poisoned = False  # test hook (the `nan` fault): the next step's loss is NaN
        self._host_buffers: dict[int, torch.Tensor] = {}  # pinned state_dict buffers (CUDA), reused

    def assume_identity(self, rid: str) -> None:
        """A hot spare takes over `rid`: its data stream (the global replica index) and name. The
        state itself arrives by a heal, as for any replica that (re)joins."""
        self.rid = rid
        self.global_index = self.topology.global_index(rid)

    def warm_up(self) -> float:
        """Pay a fresh process's one-time costs now (the first forward/backward, compilation, the
        first optimizer step's lazy imports): the step model's gradients are dropped after and the
        optimizer steps copies, so the replica's state is untouched. Returns the seconds it took."""
        start = time.perf_counter()
        with self._numerics():
            loss = self.loss_fn(self.step_model, self._train_batch(0))
        loss.backward()
        self._link_grads()
        copies = [p.detach().clone().requires_grad_(True) for p in self.params]
        for c, p in zip(copies, self.params, strict=True):
            c.grad = None if p.grad is None else p.grad.detach().clone()
            p.grad = None
        if self.ranks is not None:
            self.model.zero_grad(set_to_none=True)
        build_inner_optimizer(self.cfg, copies, self.device).step()
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def poison(self) -> None:
        """Test hook (the `nan` fault): the next inner step's loss is NaN, as a diverging replica's."""
        self._poisoned = True

    # -- counters -------------------------------------------------------------------------------
    @property
    def step_in_round(self) -> int:
        return self.step - self.round * self.steps_per_round

    def _schedule_step(self) -> float:
        """Where the inner lr schedule stands: a cluster that takes fewer steps in a round (sync.balance=steps)
        covers the same stretch of it per round, so its step s is at round * spr + s * spr / its steps; under
        `time` its steps are not known ahead (a run after the close ends early), so step s is where it is."""
        if self.round_steps == self.steps_per_round or self.cfg.sync.balance == "time":
            return self.step
        return self.round * self.steps_per_round + self.step_in_round * self.steps_per_round / self.round_steps

    def progress(self) -> dict:
        return {
            "rid": self.rid,
            "round": self.round,
            "step": self.step,
            "param_bytes": self.replica_param_bytes,
            "tokens_per_step": self.tokens_per_step,
            "outer_buffer_round": None if self._outer_buffer is None else self._outer_buffer[0][0],
        }

    def _require(self, round_index: int, what: str) -> bool:
        """True if the call's work is still to do; False if the round is already committed here."""
        if round_index > self.round:
            raise Behind(f"{self.rid}: {what} for round {round_index}, but this replica holds round {self.round}")
        return round_index == self.round

    # -- evaluation, digests, the final model ---------------------------------------------------
    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss of the global params on task.py's evaluation batches. After a commit they are this
        replica's params; under streaming (fragments, a mixing weight) they are swapped in for it."""
        saved = [p.detach().clone() for p in self.params] if is_streaming(self.cfg) else None
        if saved is not None:
            self.outer_opt.copy_global_into(self.params)
        self.model.eval()
        try:
            losses = []
            for i in range(self.cfg.train.eval_batches):
                batch = self.dataset.batch("val", seed=task.EVAL_SEED, replica_index=-1, step=i, micro=0)
                with self._numerics():
                    losses.append(self.loss_fn(self.model, task.to_device(batch, self.device)).detach().float())
        finally:
            self.model.train()
            if self.ranks is not None:  # a no-grad forward leaves the root's params gathered (no backward
                sharding.reshard(self.model)  # reshards them): the next step would read that stale copy
            if saved is not None:
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)
        return sum(torch.stack(losses).tolist()) / len(losses)

    def param_digest(self) -> str:
        """Sharded: one digest of the whole replica, combined from its ranks' (every rank calls it)."""
        digest = param_digest(self.params)
        return digest if self.ranks is None else sharding.combined_digest(digest, self.ranks)

    def global_digest(self) -> str:
        digest = param_digest(self.outer_opt.global_params)
        return digest if self.ranks is None else sharding.combined_digest(digest, self.ranks)

    def save_model(self, path: str) -> dict:
        """Write the committed global model (the global params of round `round`) to `path` as
        safetensors, under the module's parameter names (a tied weight once), with the round, the
        plug-ins and the digest as metadata (`write_atomic`). Load it back with `model.load_state_dict(
        safetensors.torch.load_file(path), strict=False)`. Raises OSError when it cannot be written.
        Sharded: every rank calls it; the whole tensors are gathered and rank 0 writes the same file
        as k=1 (its digest is the replica's combined one); the others return without writing."""
        from safetensors.torch import save

        globals_ = self.outer_opt.global_params
        if self.ranks is not None:
            globals_ = sharding.full_tensors(globals_, self.sharded)
        tensors = {name: g.detach().to("cpu").contiguous() for name, g in zip(self.param_names, globals_, strict=True)}
        meta = {
            "round": str(self.round),
            "step": str(self.round * self.steps_per_round),
            "model_target": str(self.cfg.model._target_),
            "data_source": str(self.dataset.source),
            "global_digest": self.global_digest(),
        }
        if self.ranks is not None and self.ranks.rank != 0:
            return {"path": str(path), "round": self.round, "bytes": 0, "global_digest": meta["global_digest"]}
        write_atomic(str(path), lambda f: f.write(save(tensors, metadata=meta)))
        return {
            "path": str(path),
            "round": self.round,
            "bytes": os.path.getsize(path),
            "global_digest": meta["global_digest"],
        }

    # -- state for heal and checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a `full` heal or a checkpoint carries, on the host. On CUDA the tensors are
        this trainer's pinned buffers, reused by the next call: serialize or copy them before.
        Sharded: this rank's shards only (plain local tensors), loaded by rank j of the target."""
        skeleton, tensors = split_state(self.live_state())
        copies = []
        for i, t in enumerate(tensors):
            if t.device.type != "cuda":
                copies.append(t.detach().clone())
                continue
            buf = self._host_buffers.get(i)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._host_buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copies.append(buf.copy_(t.detach(), non_blocking=True))
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)  # the one wait for every non-blocking copy above
        return join_state(skeleton, copies)

    def live_state(self) -> dict:
        """state_dict's tree holding this trainer's own tensors, not copies, where they live (a heal
        over the process group streams them out at once, from the phase thread, which nothing
        else mutates meanwhile). Never modify it or keep it past that call."""
        snapshot = self._outer_snapshot
        return {
            "rid": self.rid,
            "round": self.round,
            "step": self.step,
            "params": list(self.params),
            "inner_opt": self.inner_opt.state_dict(),
            "outer": self.outer_opt.state_dict(),
            "outer_residual": None if self.outer_residual is None else list(self.outer_residual),
            "outer_snapshot": None if snapshot is None else {"round": snapshot[0], "flat": snapshot[1]},
            "round_losses": list(self.round_losses),
        }

    def global_state(self) -> dict:
        """What a `global` heal needs: the round-start global params and outer state. They change
        only in outer_commit, so this may be read while an inner phase runs."""
        return {
            "rid": self.rid,
            "round": self.round,
            "step": self.round * self.steps_per_round,
            "outer": copy.deepcopy(self.outer_opt.state_dict()),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, scope: str = "full") -> None:
        """scope `full`: become the source (same cluster). scope `global`: take only the global
        params, outer state and round (the source is in another cluster): params restart from the
        global params at the round's first step with a fresh inner optimizer, and the residual at
        zero (another cluster's is not ours to send). Either way the non-finite flags start clear."""
        full = scope == "full"
        self.outer_opt.load_state_dict(state["outer"])
        residual = state.get("outer_residual") if full else None
        self.outer_residual = None if residual is None else [r.detach().to("cpu").clone() for r in residual]
        snapshot = state.get("outer_snapshot") if full else None  # a source past the snapshot step: send the same
        self._outer_snapshot = (
            None if snapshot is None else (int(snapshot["round"]), snapshot["flat"].detach().to("cpu").clone())
        )
        self.round = int(state["round"])
        self.step = int(state["step"]) if full else self.round * self.steps_per_round  # `global`: ours is gone
        self.round_losses = list(state.get("round_losses", [])) if full else []
        if full:
            for p, src in zip(self.params, state["params"], strict=False):
                p.copy_(src.to(p.device))
            self.inner_opt.load_state_dict(state["inner_opt"])
        else:
            self.outer_opt.copy_global_into(self.params)
            self.inner_opt = build_inner_optimizer(self.cfg, self.params, self.device)
        self._outer_buffer = self._averaged = self._pre_average = None
        self._nonfinite.zero_()
