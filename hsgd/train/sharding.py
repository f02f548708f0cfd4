"""A replica larger than one device: its model sharded with FSDP2 over the replica's k rank processes.

Protocol (hsgd.train.trainer.ReplicaTrainer with `ranks`):
- `ReplicaRanks(rank, size, group)`: this process is rank `rank` of the `size` ranks of one replica;
  `group`, a ProcessGroup of exactly those k processes, is fixed for the replica's life. Its
  collectives are the "replica" level, issued by every rank in the same order from the same phase method.
- `shard_model` applies FSDP2 `fully_shard` per transformer block, then to the root: every parameter
  is sharded on dim 0, so rank j's local shards have the same length, order and shapes in every
  replica, and everything hsgd does per parameter applies to rank j's shards over rank j's groups.
- The replica's batch is split evenly across its ranks (`rows_of`).
- Replica-wide numbers are combined here: the global gradient norm (`clip_grad_norm_`), the
  phase-end losses and non-finite flags (`combine_phase_end`), a digest (`combined_digest`).
- After each collective of another level, every rank learns whether any failed (`agreed`), and all
  raise the first rank's error together.
- An outer reduce behind the inner steps (hsgd.train.overlap) agrees over `background` (`behind()`),
  a second group of the same k ranks, from that one thread only.
- `ShardedState`: the trainer's state as a sharded (DCP) checkpoint holds it, and `rank_slice`.
Failures: a replica-level collective that fails or times out raises (torch.distributed's error,
under the group's timeout); the replica is then failed as a whole and rebuilt.
Narrative: docs/scaling.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

REPLICA_LEVEL = "replica"  # the level of this module's collectives (see the module's protocol)


@dataclass(frozen=True)
class ReplicaRanks:
    """This process is rank `rank` of the `size` ranks of one replica; `group` holds exactly them;
    `background` too (a second group, for the thread of a reduce behind the inner steps; or None)."""

    rank: int
    size: int
    group: Any  # torch.distributed.ProcessGroup
    background: Any = None  # torch.distributed.ProcessGroup of the same ranks, or None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ReplicaRanks.rank {self.rank} must be in [0, size={self.size})")

    def behind(self) -> ReplicaRanks:
        """These ranks over `background`: what a reduce behind the inner steps agrees over (the
        module's protocol). Raises ValueError when the replica group was formed without one."""
        if self.background is None:
            raise ValueError(
                f"rank {self.rank} of a replica of {self.size}: its replica group was formed without "
                f"a background group, so no outer reduce may run behind its inner steps"
            )
        return ReplicaRanks(self.rank, self.size, self.background)


def is_sharded(ranks: ReplicaRanks | None) -> bool:
    return ranks is not None and ranks.size > 1


def _transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one (each its own all-gather unit): a GPT's `transformer.h`
    blocks, else every direct child holding parameters (a plug-in model of another shape)."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks)
    return [m for m in model.children() if any(True for _ in m.parameters())]


def shard_model(model: torch.nn.Module, ranks: ReplicaRanks, device_type: str) -> torch.nn.Module:
    """FSDP2 over the replica group: each block, then the root. On CUDA the compute runs in bf16
    with fp32 gradient reduction and fp32 master shards; on the CPU in fp32. The model must hold
    identical full params on every rank (built after the same seed). Returns the same module."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(ranks.group, device_type)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device_type == "cuda"
        else MixedPrecisionPolicy()
    )
    for block in _transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # FSDP2 re-pads and re-saves its local shards at its lazy init (the first forward) unless they
    # are unchanged; running it now makes the local tensors handed out by local() final.
    model._get_fsdp_state()._lazy_init()
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered (unsharded) parameter of the FSDP2 modules in `model`, so the next
    forward gathers the shards as they are then (no collective)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, sharing its storage: writing it writes the
    shard); a plain tensor passes through."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t._local_tensor  # to_local() under no_grad returns this same tensor
    return t


def full_tensors(shards: list[torch.Tensor], templates: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole tensors of `shards` (this rank's local pieces, shaped like `templates`' — the
    model's sharded DTensor params — local shards): an all-gather over the replica group per
    tensor, on every rank (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return [
        DTensor.from_local(
            s.to(t.device), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        ).full_tensor()
        for s, t in zip(shards, templates, strict=True)
    ]


def rows_of(batch: Any, ranks: ReplicaRanks | None) -> Any:
    """This rank's contiguous slice of the replica's batch, cut on dim 0 of every tensor in it
    (tuples, lists and dicts are walked). Raises ValueError when the rows do not split evenly."""
    if not is_sharded(ranks):
        return batch
    if isinstance(batch, torch.Tensor):
        rows = batch.shape[0]
        if rows % ranks.size:
            raise ValueError(
                f"data.batch_size: {rows} rows do not split evenly across the replica's "
                f"{ranks.size} ranks; use a multiple of {ranks.size}"
            )
        per = rows // ranks.size
        return batch[ranks.rank * per : (ranks.rank + 1) * per]
    if isinstance(batch, dict):
        return {k: rows_of(v, ranks) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(rows_of(v, ranks) for v in batch)
    return batch


@torch.no_grad()
def clip_grad_norm_(
    grads: list[torch.Tensor], max_norm: float, ranks: ReplicaRanks, foreach: bool = False
) -> torch.Tensor:
    """The replica's global gradient norm from this rank's local gradient shards (the sum of
    squares all-reduced over the replica group), and, when max_norm > 0, every shard scaled by
    min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does. Returns the norm."""
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=ranks.group)
    norm = squares.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if foreach:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        else:
            for g in grads:
                g.mul_(coef.to(g.device))
    return norm


def combine_phase_end(
    losses: list[torch.Tensor], flags: torch.Tensor, ranks: ReplicaRanks
) -> tuple[list[float], torch.Tensor]:
    """Once per phase, on the replica group: the replica's losses (the mean of its ranks' losses
    of their equal slices) and the non-finite flags OR'd over its ranks, so every rank reports the
    same losses and all raise together or none does."""
    packed = torch.cat([flags.float().to("cpu"), torch.stack(losses).float().to("cpu") if losses else torch.zeros(0)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=ranks.group)
    return (packed[2:] / ranks.size).tolist(), (packed[:2] > 0).to(flags.device)


def any_rank(flag: bool, ranks: ReplicaRanks) -> bool:
    """True on every rank when `flag` is true on any rank of the replica."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ranks.group)
    return bool(t.item() > 0)


def agreed(fn: Callable[[], Any], ranks: ReplicaRanks | None, what: str) -> Any:
    """Run `fn` (one level collective) on this rank, then agree with the replica's other ranks: if
    any raised hsgd.train.comm.CollectiveError, every rank raises the lowest such rank's error (its
    kind kept, its text naming the rank); else returns fn's result. Unsharded: just `fn()`."""
    from hsgd.train.comm import CollectiveError

    if not is_sharded(ranks):
        return fn()
    result, failure = None, None
    try:
        result = fn()
    except CollectiveError as err:
        failure = (str(err), str(err.kind))
    failures: list[Any] = [None] * ranks.size
    dist.all_gather_object(failures, failure, group=ranks.group)
    for rank, failed in enumerate(failures):
        if failed is not None:
            message, kind = failed
            raise CollectiveError(
                message if rank == ranks.rank else f"{what}: rank {rank} of this replica failed: {message}", kind
            )
    return result


def combined_digest(shard_digest: str, ranks: ReplicaRanks) -> str:
    """sha256 over the k ranks' shard digests in rank order: one digest of the whole replica's
    state, the same on every rank (a collective: every rank calls it)."""
    digests: list[Any] = [None] * ranks.size
    dist.all_gather_object(digests, shard_digest, group=ranks.group)
    return digest_of(digests)


def digest_of(shard_digests: list[str]) -> str:
    """One digest of a replica from its ranks' shard digests, in rank order (combined_digest's)."""
    return hashlib.sha256("".join(shard_digests).encode()).hexdigest()


# -- the state a sharded (DCP) checkpoint holds: resharded on load --------------------------------------
class ShardedState:
    """ReplicaTrainer's state as a sharded checkpoint holds it (hsgd.train.dcp_checkpoint), and a whole
    replica's state cut to this rank's shards. Mixed into hsgd.train.trainer.ReplicaTrainer (its params,
    optimizers, `sharded` templates and `load_state_dict`); every method is local (no collective)."""

    def sharded_state(self) -> dict:
        """The state a sharded checkpoint holds (hsgd.train.dcp_checkpoint), flat and keyed by parameter
        name: the params, the inner optimizer's per-parameter slots, the global params, the outer
        momentum and the error-feedback residual, each as a DTensor of this rank's shard (the mesh,
        placements and shape of its `self.sharded` param; k=1: the plain full tensor), so DCP reshards
        a load to any k; ints and flags as plain values. Taken between rounds only (a checkpoint is):
        the round's losses and a fragment_delay snapshot are empty there, and not carried. Copies:
        safe to keep. Every rank of the replica calls it (no collective)."""
        if self.round_losses or self._outer_snapshot is not None:
            raise ValueError(
                f"{self.rid}: a sharded state is taken between rounds (round {self.round} has "
                f"losses or an outer snapshot pending)"
            )
        return self.sharded_template()

    def sharded_template(self) -> dict:
        """sharded_state's keys and layout at any moment (what DCP loads a checkpoint into, in place;
        mid-round the round's losses and snapshot are left out, as a checkpoint never has them)."""
        inner = self.inner_opt.state_dict()["state"]
        sgd = self.outer_opt.state_dict()["sgd"]["state"]
        state = {
            "round": self.round,
            "step": self.step,
            "inner_started": bool(inner),
            "momentum_started": any(s.get("momentum_buffer") is not None for s in sgd.values()),
            "residual_started": self.outer_residual is not None,
        }
        for i, name in enumerate(self.param_names):
            state.update(
                self._param_entries(
                    i,
                    name,
                    {
                        "param": self.params[i],
                        "global": self.outer_opt.global_params[i],
                        "momentum": sgd.get(i, {}).get("momentum_buffer"),
                        "residual": None if self.outer_residual is None else self.outer_residual[i],
                        **{f"inner.{slot}": inner.get(i, {}).get(slot) for slot in self._inner_slots()},
                    },
                )
            )
            state[f"inner.step/{name}"] = (
                torch.as_tensor(inner.get(i, {}).get("step", 0.0), dtype=torch.float32).detach().to("cpu").clone()
            )
        return state

    def _inner_slots(self) -> tuple[str, ...]:
        """The inner optimizer's per-parameter tensors (each shaped like its parameter)."""
        if self.cfg.optim.inner.name == "sgd":
            return ("momentum_buffer",) if float(self.cfg.optim.inner.momentum) else ()
        return ("exp_avg", "exp_avg_sq")

    def _param_entries(self, i: int, name: str, tensors: dict) -> dict:
        """`{kind/name: DTensor (k=1: tensor)}` of parameter i's tensors (a None as zeros: a slot not
        started yet, its flag says so), each a detached CPU copy of this rank's shard."""
        local = self.params[i]
        out = {}
        for kind, t in tensors.items():
            t = torch.zeros(local.shape, dtype=torch.float32) if t is None else t.detach().to("cpu", copy=True)
            out[f"{kind}/{name}"] = t if self.ranks is None else self._as_dtensor(t, i)
        return out

    def _as_dtensor(self, shard: torch.Tensor, i: int):
        """This rank's `shard` of parameter i as a DTensor laid out like `self.sharded[i]` (no collective)."""
        from torch.distributed.tensor import DTensor

        template = self.sharded[i]
        return DTensor.from_local(
            shard,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )

    @torch.no_grad()
    def load_sharded_state(self, state: dict) -> None:
        """Become the replica `state` describes (sharded_state's keys, loaded by DCP into a
        `sharded_state()` of this trainer, resharded to its k): a `full` load, the flags deciding
        which optimizer slots were started; non-finite flags clear, as after any load."""

        def shard_of(key: str) -> torch.Tensor:
            return local(state[key]).detach().to("cpu").clone()

        names = list(enumerate(self.param_names))
        inner = {}
        if state["inner_started"]:
            steps = self.cfg.optim.inner.name != "sgd"  # AdamW counts its steps per parameter; SGD does not
            inner = {
                i: {
                    **({"step": state[f"inner.step/{name}"].clone()} if steps else {}),
                    **{slot: shard_of(f"inner.{slot}/{name}") for slot in self._inner_slots()},
                }
                for i, name in names
            }
        outer = self.outer_opt.state_dict()
        momentum = (
            {i: {"momentum_buffer": shard_of(f"momentum/{name}")} for i, name in names}
            if state["momentum_started"]
            else {}
        )
        self.load_state_dict(
            {
                "round": int(state["round"]),
                "step": int(state["step"]),
                "round_losses": [],
                "params": [shard_of(f"param/{name}") for _, name in names],
                "inner_opt": {"state": inner, "param_groups": self.inner_opt.state_dict()["param_groups"]},
                "outer": {
                    "global_params": [shard_of(f"global/{name}") for _, name in names],
                    "sgd": {"state": momentum, "param_groups": outer["sgd"]["param_groups"]},
                },
                "outer_residual": [shard_of(f"residual/{name}") for _, name in names]
                if state["residual_started"]
                else None,
                "outer_snapshot": None,
            },
            scope="full",
        )

    def rank_slice(self, state: dict) -> dict:
        """A whole replica's `state_dict` (a k=1 checkpoint's file) cut to this rank's shards: every
        per-parameter tensor to the dim-0 chunk FSDP2 gives this rank (torch.chunk, as `fully_shard`
        cuts it); k=1: `state` itself. Raises ValueError when a tensor's cut is not this rank's shape."""
        if self.ranks is None:
            return state

        def cut(i: int, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() == 0:
                return t
            chunks = torch.chunk(t, self.ranks.size, dim=0)
            piece = chunks[self.ranks.rank] if self.ranks.rank < len(chunks) else t[:0]
            if piece.shape != self.params[i].shape:
                raise ValueError(
                    f"{self.rid}: parameter {self.param_names[i]}: a whole tensor of {tuple(t.shape)} "
                    f"cuts to {tuple(piece.shape)} on rank {self.ranks.rank}, not its shard's "
                    f"{tuple(self.params[i].shape)}"
                )
            return piece.clone()

        def cut_optimizer(sd: dict) -> dict:
            return {
                **sd,
                "state": {
                    i: {slot: cut(int(i), v) if torch.is_tensor(v) else v for slot, v in slots.items()}
                    for i, slots in sd["state"].items()
                },
            }

        outer = state["outer"]
        residual = state.get("outer_residual")
        return {
            **state,
            "params": [cut(i, t) for i, t in enumerate(state["params"])],
            "inner_opt": cut_optimizer(state["inner_opt"]),
            "outer": {
                **outer,
                "global_params": [cut(i, g) for i, g in enumerate(outer["global_params"])],
                "sgd": cut_optimizer(outer["sgd"]),
            },
            "outer_residual": None if residual is None else [cut(i, r) for i, r in enumerate(residual)],
        }
