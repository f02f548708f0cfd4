"""Outer sync: what crosses the slow link once per round.

DiLoCo (arXiv 2311.08105, Algorithm 1), per round:
    pseudo_grad = global_params_at_round_start - local_params        (per cluster, by its leader)
    pseudo_grad = mean over clusters (outer all-reduce among leaders)
    global_params = OuterOpt(global_params, pseudo_grad)               (Nesterov SGD, lr 0.7, mom 0.9)
    local_params = global_params                                       (inner optimizer state kept)

`average` (hierarchical local SGD) is the same with plain SGD, lr 1 and no momentum: the new global
params are the mean of the clusters' params. `none` never crosses clusters.

Every replica keeps the global params and the outer optimizer state — not only the leader — so
any replica can become leader, and a commit is applied by every replica from the same reduced
pseudo-gradient (bitwise-identical results on every replica, without shipping parameters).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch

from hsgd.core.outer_plan import fragment_of_params, fragment_of_round, shard_bounds
from hsgd.core.phases import Phase
from hsgd.train import sharding
from hsgd.train.codec import ALIGN, compress_with_feedback, make_codec
from hsgd.train.comm import LevelGroup
from hsgd.train.exchange import exchange_of, gather_mean, reduce_scatter_mean
from hsgd.train.inner import NonFiniteError


def outer_hyperparameters(algorithm: str, lr: float, momentum: float, nesterov: bool) -> dict:
    """`average` ignores optim.outer: it is exactly parameter averaging."""
    if algorithm == "average":
        return {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    return {"lr": lr, "momentum": momentum, "nesterov": nesterov and momentum > 0}


class OuterOptimizer:
    """Owns the round-start global params (on CPU) and the outer SGD state that updates them."""

    def __init__(
        self, params: list[torch.Tensor], *, lr: float, momentum: float, nesterov: bool, pin_memory: bool = False
    ):
        self.global_params = [p.detach().to("cpu", copy=True) for p in params]
        if pin_memory:  # GPU runs: faster host<->device copies at every round boundary
            self.global_params = [g.pin_memory() for g in self.global_params]
        for g in self.global_params:
            g.requires_grad_(True)
        self._sgd = torch.optim.SGD(self.global_params, lr=lr, momentum=momentum, nesterov=nesterov)

    def pseudo_gradient(self, params: list[torch.Tensor], index: list[int] | None = None) -> list[torch.Tensor]:
        """global - local, on CPU; detached copies (never tensors with autograd history).
        `index`: which global params `params` are (a fragment); None = all of them, in order."""
        chosen = self.global_params if index is None else [self.global_params[i] for i in index]
        return [g.detach() - p.detach().to("cpu") for g, p in zip(chosen, params, strict=True)]

    @torch.no_grad()
    def step(self, mean_pseudo_gradient: list[torch.Tensor], index: list[int] | None = None) -> None:
        """Apply the averaged pseudo-gradient to the global params (`index`: only those, a
        fragment; the others get no gradient, so SGD leaves them and their momentum untouched)."""
        chosen = self.global_params if index is None else [self.global_params[i] for i in index]
        for g, d in zip(chosen, mean_pseudo_gradient, strict=True):
            g.grad = d.to(g.dtype).clone()
        self._sgd.step()
        for g in self.global_params:
            g.grad = None

    @torch.no_grad()
    def reset_global(self, params: list[torch.Tensor]) -> None:
        """Used by `outer=none`: each cluster's own params become its round-start params."""
        for g, p in zip(self.global_params, params, strict=True):
            g.copy_(p.detach().to("cpu"))

    @torch.no_grad()
    def copy_global_into(self, params: list[torch.Tensor]) -> None:
        for p, g in zip(params, self.global_params, strict=True):
            p.copy_(g.to(p.device))

    def state_dict(self) -> dict:
        """This optimizer's own tensors: read them at once, never keep or modify them (deepcopy to keep)."""
        return {"global_params": [g.detach() for g in self.global_params], "sgd": self._sgd.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for g, src in zip(self.global_params, state["global_params"], strict=True):
            g.copy_(src)
        self._sgd.load_state_dict(deepcopy(state["sgd"]))


class OuterSync:
    """ReplicaTrainer's outer phases (mixed into hsgd.train.trainer.ReplicaTrainer, whose params, ranks,
    counters and `_require` they use): `cluster_average` (inner `none`), `outer_reduce` (the shard
    holders, level "outer": the first phase of the two-phase commit) and `outer_commit` (level "inner":
    the holders broadcast, every replica applies the outer step). What a round syncs is
    hsgd/core/outer_plan.py's, cut into shards at the codec's block boundaries."""

    last_exchange: str | None = (
        None  # what the last outer reduce ran (hsgd.train.exchange): the round's metrics name it
    )

    def _init_outer(self, cfg: Any, outer_step: tuple[float, float]) -> None:
        """The outer state a replica starts with: the global params (its params now), the outer optimizer
        (`outer_step`: its lr and momentum), the fragments, the codec and its residual, no buffers."""
        hp = outer_hyperparameters(cfg.sync.outer, *outer_step, cfg.optim.outer.nesterov)
        self.outer_opt = OuterOptimizer(self.params, pin_memory=self.device_type == "cuda", **hp)
        self.fragments = int(cfg.sync.fragments)
        self.fragment_of = fragment_of_params(self.param_names, self.fragments)  # per parameter
        self.fragment_alpha = float(cfg.sync.fragment_alpha)
        compress = cfg.sync.outer_compress
        self.codec = make_codec(compress, float(cfg.sync.outer_topk)) if compress != "none" else None
        # error feedback: what compression did not send yet, this cluster's (fp32, one per parameter)
        self.outer_residual: list[torch.Tensor] | None = None
        # sync.fragment_delay: (round, corrected flat fp32 pseudo-gradient), see take_outer_snapshot
        self.fragment_delay = cfg.sync.fragment_delay
        self._outer_snapshot: tuple[int, torch.Tensor] | None = None
        # (outer_reduce's key, mean of that shard, flat fp32): never reused or committed under another key
        self._outer_buffer: tuple[tuple, torch.Tensor] | None = None
        # inner `none`: (round, epoch) of the last cluster_average, and (round, the params before it)
        self._averaged: tuple[int, int] | None = None
        self._pre_average: tuple[int, list[torch.Tensor]] | None = None

    @torch.no_grad()
    def cluster_average(self, round_index: int, epoch: int, inner: LevelGroup) -> None:
        """inner `none`: make every replica of the cluster hold the cluster mean. Idempotent per
        (round, epoch); a retry under a new epoch first restores the params it had before (an
        averaged replica is never averaged again)."""
        if not self._require(round_index, "cluster_average") or self._averaged == (round_index, epoch):
            return
        if self._pre_average is not None and self._pre_average[0] == round_index:
            for p, saved in zip(self.params, self._pre_average[1], strict=True):
                p.copy_(saved)
        else:
            self._pre_average = (round_index, [p.detach().clone() for p in self.params])
        sharding.agreed(
            lambda: inner.allreduce_mean([p.data for p in self.params], level="inner"),
            self.ranks,
            f"{self.rid}: cluster average",
        )
        self._averaged = (round_index, epoch)

    def fragment_params(self, round_index: int) -> list[int]:
        """Indices (into self.params) of the parameters round `round_index` syncs."""
        f = fragment_of_round(round_index, self.fragments)
        return [i for i, frag in enumerate(self.fragment_of) if frag == f]

    def take_outer_snapshot(self) -> None:
        """sync.fragment_delay: this round's corrected pseudo-gradient, as the params are now (the
        snapshot step, where a cluster's members agree); kept once per round, until the commit.
        Carried by a `full` heal, so a member healed past the snapshot step sends the same."""
        self._outer_snapshot = (self.round, self._round_pseudo_gradient(self.round))

    def _round_pseudo_gradient(self, round_index: int) -> torch.Tensor:
        """What this cluster sends for round `round_index`: the snapshot when one was taken (overlap),
        else the fragment's pseudo-gradient (global - local) of the params as they are, as one flat
        fp32 vector, plus this cluster's residual when a codec is on."""
        if self._outer_snapshot is not None and self._outer_snapshot[0] == round_index:
            return self._outer_snapshot[1]
        index = self.fragment_params(round_index)
        pg = self.outer_opt.pseudo_gradient([self.params[i] for i in index], index)
        flat = torch.cat([g.reshape(-1) for g in pg]) if pg else torch.zeros(0)
        if self.codec is not None and self.outer_residual is not None:
            flat = flat + torch.cat([self.outer_residual[i].reshape(-1) for i in index])
        return flat

    @torch.no_grad()
    def outer_reduce(
        self,
        round_index: int,
        epoch: int,
        outer: LevelGroup,
        shard: int = 0,
        shards: int = 1,
        weights: tuple[float, ...] = (),
        *,
        behind: bool = False,
    ) -> None:
        """The token-weighted mean over the clusters of shard `shard` of `shards` into the buffer keyed
        by (round, epoch, shard, shards, weights), idempotent per key. `weights`: each cluster's, in
        outer-rank order (hsgd.core.outer_plan.token_weights; () = the plain mean); a weight of 1.0
        is never multiplied, so equal clusters give the plain mean bit for bit. With a codec the
        encoded shards are exchanged unweighted (the error-feedback residual stays so), then decoded,
        weighted and summed in outer-rank order (sync.outer_exchange: by every holder, or chunk by chunk
        by the chunk's owner, hsgd.train.exchange), so every holder holds the same bits. Raises
        NonFiniteError before sending a non-finite pseudo-gradient. `behind`: called on a second thread
        while inner steps run (hsgd.train.overlap): sharded, its ranks agree over the replica's
        background group, never over the one the phase thread's FSDP2 collectives use."""
        if not self._require(round_index, "outer_reduce"):
            return
        key = (round_index, epoch, shard, shards, tuple(weights))
        if self._outer_buffer and self._outer_buffer[0] == key:
            return
        self._outer_buffer = None
        if self.cfg.sync.outer == "none":
            self._outer_buffer = (key, torch.zeros(0))
            return
        ranks = self.ranks.behind() if behind and self.ranks is not None else self.ranks
        flat = self._round_pseudo_gradient(round_index)
        finite = bool(torch.isfinite(flat).all())
        if ranks is not None:  # every rank of the replica raises, or none sends
            finite = not sharding.any_rank(not finite, ranks)
        if not finite:
            raise NonFiniteError(
                "pseudo_gradient", f"{self.rid}: non-finite pseudo-gradient in round {round_index}; not sent"
            )
        lo, hi = shard_bounds(flat.numel(), shards, ALIGN)[shard]
        piece = sharding.agreed(
            lambda: self._reduce_piece(flat[lo:hi].clone(), outer, weights), ranks, f"{self.rid}: outer reduce"
        )
        self._outer_buffer = (key, piece)

    def _reduce_piece(self, piece: torch.Tensor, outer: LevelGroup, weights: tuple[float, ...]) -> torch.Tensor:
        """outer_reduce's collective: the weighted mean of `piece` over the outer group, by the exchange
        (hsgd.train.exchange) sync.outer_exchange and the group's size pick; kept in `last_exchange`."""
        self.last_exchange = exchange = exchange_of(self.cfg.sync.outer_exchange, self.codec, outer.world_size)
        if exchange == "allreduce":
            own = weights[outer.rank] if weights else 1.0
            if own != 1.0:
                piece.mul_(own)
            outer.allreduce_mean([piece], level="outer")
        elif piece.numel():
            piece = (gather_mean if exchange == "gather" else reduce_scatter_mean)(self.codec, piece, outer, weights)
        return piece

    @torch.no_grad()
    def outer_commit(self, round_index: int, inner: LevelGroup, roots: tuple[int, ...]) -> None:
        """Receive the committed mean pseudo-gradient of this round's fragment (shard j from inner
        rank roots[j]) and apply it: the outer step on the fragment's global params, then params =
        alpha * local + (1 - alpha) * global. Every member updates the codec's residual alike (the
        same deterministic encoding of the same corrected vector), so any member can lead next."""
        if not self._require(round_index, Phase.OUTER_COMMIT):
            return  # already committed (idempotent re-issue)
        if self.cfg.sync.outer != "none":
            index = self.fragment_params(round_index)
            shapes = [self.outer_opt.global_params[i] for i in index]
            sizes = [g.numel() for g in shapes]
            bounds = shard_bounds(sum(sizes), len(roots), ALIGN)
            mean = torch.zeros(sum(sizes))
            for j, (root, (lo, hi)) in enumerate(
                zip(roots, bounds, strict=True)
            ):  # one broadcast per shard, from its holder
                if inner.rank == root:
                    buf = self._outer_buffer
                    assert buf is not None and buf[0][0] == round_index and buf[0][2:4] == (j, len(roots)), (
                        f"{self.rid}: commit of round {round_index} without a reduced buffer for shard {j}/{len(roots)}"
                    )
                    mean[lo:hi] = buf[1]
                if hi > lo:
                    sharding.agreed(
                        lambda lo=lo, hi=hi, root=root: inner.broadcast([mean[lo:hi]], root=root, level="inner"),
                        self.ranks,
                        f"{self.rid}: commit broadcast",
                    )
            if self.codec is not None:  # residual = corrected - what was sent, before the params change
                corrected = self._round_pseudo_gradient(round_index)
                if self.outer_residual is None:
                    self.outer_residual = [torch.zeros(g.shape) for g in self.outer_opt.global_params]
                _, residual = compress_with_feedback(self.codec, corrected, None)
                for i, r, g in zip(index, residual.split(sizes), shapes, strict=False):
                    self.outer_residual[i].copy_(r.view_as(g))
            self.outer_opt.step([d.view_as(g) for d, g in zip(mean.split(sizes), shapes, strict=True)], index)
            alpha = self.fragment_alpha  # 0: the global params (plain DiLoCo); else Streaming DiLoCo's mixing
            for i in index:
                p, g = self.params[i], self.outer_opt.global_params[i].to(self.params[i].device)
                if alpha == 0:
                    p.copy_(g)
                else:
                    p.mul_(alpha).add_(g, alpha=1 - alpha)
            self._nonfinite.zero_()  # the params are the (finite) committed global params again
        else:
            self.outer_opt.reset_global(self.params)
        self._outer_buffer = self._outer_snapshot = self._averaged = self._pre_average = None
        self.round += 1
        self.step = self.round * self.steps_per_round  # a balanced round ends short of it: the next starts here
        self.round_losses = []
