"""What one replica owns and the work it does when the supervisor tells it to.

A `ReplicaTrainer` holds a full model copy, its inner optimizer, the round-start global params
with the outer optimizer (see outer.py), and its counters: `round` (committed rounds) and `step`
(committed inner steps in total). Its data position IS its step: batches are a pure function of
(seed, global replica index, step), so healing needs no data-loader state, and there is no RNG
state to carry because the model has no dropout by default.

The phase methods each run ONE level's collectives, never both, so a replica is in at most one
collective at a time:
- `run_inner`      inner steps up to a step of the round; `ddp` all-reduces gradients every step,
                   `localsgd` averages parameters every `inner_every` steps (level "inner").
- `cluster_average` (inner `none` only) the cluster's mean, so its leader carries it (level "inner").
- `outer_reduce`   leaders only: mean pseudo-gradient over the clusters into a buffer (level "outer").
                   Nothing is applied: this is the first phase of the two-phase commit.
- `outer_commit`   after the supervisor's commit decision: the leader broadcasts the buffer in its
                   cluster (level "inner") and every replica applies the same outer step.
A failed collective raises `CollectiveError` and leaves the counters where the last committed
step left them; the step in flight is not counted and is redone after re-planning.
Phase calls are idempotent per (round, phase): a call for a round already committed is a no-op,
and a call for a round this replica has not reached raises `Behind` — it is never reported done.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hsgd.train.comm import LevelGroup
from hsgd.train.data import Corpus, batch_for_step, eval_batches, load_corpus
from hsgd.train.model import GPT, GPTConfig
from hsgd.train.outer import OuterOptimizer, outer_hyperparameters
from hsgd.core.topology import Topology

# hook(phase, round, step_in_round) is called at every step/phase boundary; fault injection uses it.
FaultHook = Callable[[str, int, int], None]


def _no_fault(phase: str, round_index: int, step_in_round: int) -> None:
    return None


class Behind(RuntimeError):
    """A phase call for a round this replica has not reached: it must be healed first."""


class YieldNow(Exception):
    """Raised by a hook at a step boundary: return from run_inner here (a replica joins the
    cluster mid-round); the steps committed so far stay committed."""


@dataclass
class InnerReport:
    round: int
    step: int  # committed inner steps in total
    steps_done: int  # steps this call committed
    loss_sum: float
    tokens: int
    seconds: float
    inner_bytes: int
    losses: list[float] = field(default_factory=list)
    yielded: bool = False  # stopped at a step boundary on request, before the round's last step


def param_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the tensors, in order: equal digests = bitwise-equal params."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_model(cfg: Any, vocab_size: int) -> GPT:
    m = cfg.model
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout))


def build_inner_optimizer(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    o = cfg.optim.inner
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    # foreach=False: the same kernels on every replica whatever the param count (bitwise determinism).
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.momentum, 0.95), weight_decay=o.weight_decay,
                             foreach=False)


class ReplicaTrainer:
    def __init__(self, cfg: Any, rid: str, topology: Topology, *, device: str = "cpu",
                 corpus: Corpus | None = None):
        self.cfg, self.rid, self.topology, self.device = cfg, rid, topology, device
        self.cluster = topology.cluster_of(rid)
        self.global_index = topology.global_index(rid)
        self.corpus = corpus or load_corpus(cfg.data.path, cfg.data.val_fraction,
                                             block_size=cfg.model.block_size)
        torch.manual_seed(cfg.seed)  # identical initial params on every replica
        self.model = build_model(cfg, self.corpus.vocab_size).to(device)
        self.params = [p for p in self.model.parameters()]
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)  # what a heal or outer sync moves
        self.inner_opt = build_inner_optimizer(cfg, self.params)
        hp = outer_hyperparameters(cfg.sync.outer, cfg.optim.outer.lr, cfg.optim.outer.momentum,
                                   cfg.optim.outer.nesterov)
        self.outer_opt = OuterOptimizer(self.params, pin_memory=device.startswith("cuda"), **hp)
        self.steps_per_round = cfg.sync.outer_every
        self.round = 0
        self.step = 0
        self.round_losses: list[float] = []
        # (round, epoch, mean pseudo-grad): a buffer of another epoch is never reused or committed
        self._outer_buffer: tuple[int, int, list[torch.Tensor]] | None = None
        # inner `none`: (round, epoch) of the last cluster average, and the params before it, so a
        # retried average starts from the same point (never averages an averaged replica again)
        self._averaged: tuple[int, int] | None = None
        self._pre_average: tuple[int, list[torch.Tensor]] | None = None
        self.min_step_s = float(getattr(cfg.train, "min_step_s", 0.0) or 0.0)
        self._eval = eval_batches(self.corpus.val, batch_size=cfg.data.batch_size,
                                  block_size=cfg.model.block_size, n_batches=cfg.train.eval_batches)

    def assume_identity(self, rid: str) -> None:
        """A hot spare takes over `rid`: its data stream (the global replica index) and name. The
        state itself arrives by a heal, as for any replica that (re)joins."""
        self.rid = rid
        self.cluster = self.topology.cluster_of(rid)
        self.global_index = self.topology.global_index(rid)

    def warm_up(self) -> float:
        """Pay a fresh process's one-time costs now (the first forward/backward and the first
        optimizer step's lazy imports), on throwaway copies: the replica's state is untouched.
        Returns the seconds it took."""
        import copy

        start = time.perf_counter()
        model = copy.deepcopy(self.model)
        params = list(model.parameters())
        opt = build_inner_optimizer(self.cfg, params)
        x, y = batch_for_step(self.corpus.train, seed=self.cfg.seed, replica_index=self.global_index, step=0,
                              batch_size=self.cfg.data.batch_size, block_size=self.cfg.model.block_size)
        _, loss = model(x.to(self.device), y.to(self.device))
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    # -- counters -------------------------------------------------------------------------------
    @property
    def step_in_round(self) -> int:
        return self.step - self.round * self.steps_per_round

    def progress(self) -> dict:
        return {"rid": self.rid, "round": self.round, "step": self.step, "param_bytes": self.param_bytes,
                "outer_buffer_round": None if self._outer_buffer is None else self._outer_buffer[0]}

    def _require(self, round_index: int, what: str) -> bool:
        """True if the call's work is still to do; False if the round is already committed here."""
        if round_index > self.round:
            raise Behind(f"{self.rid}: {what} for round {round_index}, but this replica holds round {self.round}")
        return round_index == self.round

    # -- inner phase ----------------------------------------------------------------------------
    def _one_step(self, inner: LevelGroup, hook: FaultHook) -> float:
        cfg = self.cfg
        started = time.perf_counter()
        x, y = batch_for_step(self.corpus.train, seed=cfg.seed, replica_index=self.global_index,
                              step=self.step, batch_size=cfg.data.batch_size,
                              block_size=cfg.model.block_size)
        x, y = x.to(self.device), y.to(self.device)
        _, loss = self.model(x, y)
        self.inner_opt.zero_grad(set_to_none=False)
        loss.backward()
        if cfg.sync.inner == "ddp":
            hook("inner_sync", self.round, self.step_in_round)
            inner.allreduce_mean([p.grad for p in self.params], level="inner")
        if cfg.optim.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.inner.grad_clip, foreach=False)
        self.inner_opt.step()
        if cfg.sync.inner == "localsgd" and (self.step_in_round + 1) % cfg.sync.inner_every == 0:
            hook("inner_sync", self.round, self.step_in_round)
            with torch.no_grad():
                inner.allreduce_mean([p.data for p in self.params], level="inner")
        if self.min_step_s > 0:  # simulated accelerator step time: sleep, so CPU replicas stay cheap
            time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - started)))
        return float(loss.detach())

    def run_inner(self, round_index: int, inner: LevelGroup, hook: FaultHook = _no_fault) -> InnerReport:
        """Run inner steps until the round's last step is committed. Raises CollectiveError, or
        Behind for a round not reached; a round already committed is a no-op."""
        start, bytes_before, done, losses, yielded = time.perf_counter(), inner.bytes_sent, 0, [], False
        if self._require(round_index, "run_inner"):
            while self.step_in_round < self.steps_per_round:
                try:
                    hook("inner", self.round, self.step_in_round)
                except YieldNow:
                    yielded = True
                    break
                loss = self._one_step(inner, hook)
                self.step += 1  # committed: the step's collectives all succeeded
                self.round_losses.append(loss)
                losses.append(loss)
                done += 1
        tokens = done * self.cfg.data.batch_size * self.cfg.model.block_size
        return InnerReport(round=self.round, step=self.step, steps_done=done, loss_sum=sum(losses),
                           tokens=tokens, seconds=time.perf_counter() - start,
                           inner_bytes=inner.bytes_sent - bytes_before, losses=losses, yielded=yielded)

    # -- outer phase ----------------------------------------------------------------------------
    @torch.no_grad()
    def cluster_average(self, round_index: int, epoch: int, inner: LevelGroup) -> None:
        """inner `none`: make every replica of the cluster hold the cluster mean. Idempotent per
        (round, epoch); a retry under a new epoch first restores the params it had before."""
        if not self._require(round_index, "cluster_average") or self._averaged == (round_index, epoch):
            return
        if self._pre_average is not None and self._pre_average[0] == round_index:
            for p, saved in zip(self.params, self._pre_average[1]):
                p.copy_(saved)
        else:
            self._pre_average = (round_index, [p.detach().clone() for p in self.params])
        inner.allreduce_mean([p.data for p in self.params], level="inner")
        self._averaged = (round_index, epoch)

    @torch.no_grad()
    def outer_reduce(self, round_index: int, epoch: int, outer: LevelGroup) -> None:
        """Leader only: mean pseudo-gradient across clusters into the buffer keyed by (round,
        epoch); nothing is applied. Idempotent per (round, epoch)."""
        if not self._require(round_index, "outer_reduce"):
            return
        if self._outer_buffer and self._outer_buffer[:2] == (round_index, epoch):
            return
        self._outer_buffer = None
        if self.cfg.sync.outer == "none":
            self._outer_buffer = (round_index, epoch, [])
            return
        pseudo_grad = self.outer_opt.pseudo_gradient(self.params)
        outer.allreduce_mean(pseudo_grad, level="outer")
        self._outer_buffer = (round_index, epoch, pseudo_grad)

    def discard_outer_buffer(self) -> None:
        self._outer_buffer = None

    @torch.no_grad()
    def outer_commit(self, round_index: int, inner: LevelGroup, root: int) -> None:
        """Receive the committed mean pseudo-gradient from the cluster's leader and apply it."""
        if not self._require(round_index, "outer_commit"):
            return  # already committed (idempotent re-issue)
        outer_sync = self.cfg.sync.outer != "none"
        if outer_sync:
            if inner.rank == root:
                assert self._outer_buffer is not None and self._outer_buffer[0] == round_index, \
                    f"{self.rid}: commit of round {round_index} without a reduced buffer"
                pseudo_grad = self._outer_buffer[2]
            else:
                pseudo_grad = [torch.zeros_like(g) for g in self.outer_opt.global_params]
            inner.broadcast(pseudo_grad, root=root, level="inner")
            self.outer_opt.step(pseudo_grad)
            self.outer_opt.copy_global_into(self.params)
        else:
            self.outer_opt.reset_global(self.params)
        self._outer_buffer = None
        self._averaged = self._pre_average = None
        self.round += 1
        self.round_losses = []

    # -- evaluation and digests -----------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss of the global params (after a commit: this replica's params) on held-out data."""
        self.model.eval()
        total = 0.0
        for x, y in self._eval:
            _, loss = self.model(x.to(self.device), y.to(self.device))
            total += float(loss)
        self.model.train()
        return total / len(self._eval)

    def param_digest(self) -> str:
        return param_digest(self.params)

    def global_digest(self) -> str:
        return param_digest(self.outer_opt.global_params)

    # -- state for heal and checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rid": self.rid, "round": self.round, "step": self.step,
                "params": [p.detach().to("cpu").clone() for p in self.params],
                "inner_opt": self.inner_opt.state_dict(),
                "outer": self.outer_opt.state_dict(),
                "round_losses": list(self.round_losses)}

    def global_state(self) -> dict:
        """What a `global` heal needs: the round-start global params and outer state. They change
        only in outer_commit, so this may be read while an inner phase runs."""
        return {"rid": self.rid, "round": self.round, "step": self.round * self.steps_per_round,
                "outer": self.outer_opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, scope: str = "full") -> None:
        """scope `full`: become the source (same cluster). scope `global`: take only the global
        params, outer state and round (the source is in another cluster); params restart from the
        global params at the round's first step, and the inner optimizer starts fresh — every
        member of a cluster healed this way gets the same (fresh) state, so the cluster stays
        consistent."""
        self.outer_opt.load_state_dict(state["outer"])
        if scope == "full":
            for p, src in zip(self.params, state["params"]):
                p.copy_(src.to(p.device))
            self.inner_opt.load_state_dict(state["inner_opt"])
            self.round_losses = list(state.get("round_losses", []))
            self.round, self.step = int(state["round"]), int(state["step"])
        else:
            self.outer_opt.copy_global_into(self.params)
            self.inner_opt = build_inner_optimizer(self.cfg, self.params)
            self.round_losses = []
            self.round = int(state["round"])
            self.step = self.round * self.steps_per_round  # our cluster's progress in this round is gone
        self._outer_buffer = None
        self._averaged = self._pre_average = None
