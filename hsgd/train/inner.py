"""The inner phase of one replica: its inner optimizer, learning-rate schedule and inner steps.

`InnerPhase` is mixed into hsgd.train.trainer.ReplicaTrainer (it reads the trainer's params, model,
data, groups and counters). `run_inner` runs inner steps until the round's last step is committed:
per step grad_accum micro-batches, the inner level's collective (`ddp`: the gradients, bucketed or
after backward; `localsgd`: the params every inner_every steps), clipping, the optimizer step.
Failures:
- A failed collective raises `hsgd.train.comm.CollectiveError`; a localsgd step whose average
  failed is rolled back (params, optimizer state, flags), so its retry never applies it twice.
- A non-finite loss or gradient norm sets a flag on the device, read once at the phase's end:
  `NonFiniteError`, the replica must be healed.
- A hook may raise `YieldNow` at a step boundary: the call returns, the steps so far committed.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hsgd.config.auto import schedule_of, warmup_steps_of
from hsgd.core.phases import Phase
from hsgd.core.round.balance import fragment_delay_of
from hsgd.train import sharding, task
from hsgd.train.comm import LevelGroup

# hook(phase, round, step_in_round) is called at every step/phase boundary; fault injection uses it.
FaultHook = Callable[[str, int, int], None]


class YieldNow(Exception):
    """Raised by a hook at a step boundary: return from run_inner here (a replica joins the
    cluster mid-round); the steps committed so far stay committed."""


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or pseudo-gradient was NaN or infinite. `what` names which:
    "loss" | "grad_norm" | "pseudo_gradient". Nothing non-finite was sent to another cluster."""

    def __init__(self, what: str, message: str):
        assert what in ("loss", "grad_norm", "pseudo_gradient"), what
        super().__init__(message)
        self.what = what

    def __reduce__(self):  # crosses Ray and process boundaries with `what`
        return type(self), (self.what, str(self))


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


def optimizer_implementation(cfg: Any, device: str = "cpu") -> str:
    """fused | foreach | single. `auto`: fused on CUDA, single-tensor on CPU. Each is deterministic
    for the same inputs, so replicas that apply the same gradients stay bitwise equal."""
    impl = cfg.optim.inner.implementation
    if impl == "auto":
        return "fused" if str(device).startswith("cuda") else "single"
    return impl


def build_inner_optimizer(cfg: Any, params: list[torch.nn.Parameter], device: str = "cpu") -> torch.optim.Optimizer:
    o = cfg.optim.inner
    impl = optimizer_implementation(cfg, device)
    kind = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **kind)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.momentum, 0.95), weight_decay=o.weight_decay, **kind)


def inner_lr(o: Any, step: float, total_steps: int) -> float:
    """The inner learning rate at global inner step `step` (0-based; fractional for a balanced cluster's
    steps, see ReplicaTrainer._schedule_step) of a run of `total_steps`: linear warmup over
    `warmup_steps` (null: hsgd.config.auto's 5 % of the run), then `constant`, or `cosine` (also null) decay to
    lr * min_lr_ratio at the last step."""
    warmup = warmup_steps_of(o, total_steps)
    if warmup > 0 and step < warmup:
        return o.lr * (step + 1) / warmup
    if schedule_of(o) == "constant":
        return o.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    low = o.lr * o.min_lr_ratio
    return low + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - low)


class InnerPhase:
    """ReplicaTrainer's inner phase (see the module docstring); the trainer holds the state it uses."""

    def _train_batch(self, micro: int) -> Any:
        """Micro-batch `micro` of the current step, on the device: a pure function of (seed, replica, step)."""
        batch = self.dataset.batch(
            "train", seed=self.cfg.seed, replica_index=self.global_index, step=self.step, micro=micro
        )
        return task.to_device(sharding.rows_of(batch, self.ranks), self.device)

    def _numerics(self):
        """Forward and loss: bf16 autocast when asked; the math attention kernel when deterministic."""
        ctx = contextlib.ExitStack()
        if self.cfg.train.precision == "bf16":
            ctx.enter_context(torch.autocast(device_type=self.device_type, dtype=torch.bfloat16))
        if self.deterministic:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx.enter_context(sdpa_kernel(SDPBackend.MATH))  # flash attention's backward is not deterministic
        return ctx

    def _forward_backward(self, inner: LevelGroup, hook: FaultHook) -> torch.Tensor:
        """Gradients of the step's grad_accum micro-batches (their mean loss), all-reduced over the
        cluster for inner `ddp`. Returns the mean loss, on the device (never read here)."""
        if self.ranks is None:
            self.inner_opt.zero_grad(set_to_none=False)
        else:  # FSDP2 accumulates into the sharded grads it finds: start from none
            self.model.zero_grad(set_to_none=True)
        total = None
        for micro in range(self.grad_accum):
            batch = self._train_batch(micro)
            if self.ranks is not None:  # reduce-scatter inside the replica once, after the last micro-batch
                self.model.set_requires_gradient_sync(micro == self.grad_accum - 1)
            if self.buckets is not None and micro == self.grad_accum - 1:  # (buckets: inner ddp only)
                hook(Phase.INNER_SYNC, self.round, self.step_in_round)
                self.buckets.arm(inner)  # the last backward launches full buckets as it goes
            with self._numerics():
                loss = self.loss_fn(self.step_model, batch)
            if self.grad_accum > 1:
                loss = loss / self.grad_accum
            if self._poisoned:
                self._poisoned = False
                loss = loss * float("nan")
            loss.backward()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        self._link_grads()
        if self.buckets is not None:
            self.buckets.finish()
        elif self.cfg.sync.inner == "ddp":
            hook(Phase.INNER_SYNC, self.round, self.step_in_round)
            sharding.agreed(
                lambda: inner.allreduce_mean([p.grad for p in self.params], level="inner"),
                self.ranks,
                f"{self.rid}: inner gradient all-reduce",
            )
        return total

    def _link_grads(self) -> None:
        """Sharded: hand this rank's local gradient shards (FSDP2's, reduce-scattered over the
        replica) to the local param tensors the optimizer steps. k=1: nothing to do."""
        if self.ranks is not None:
            for p, full in zip(self.params, self.sharded, strict=True):
                p.grad = None if full.grad is None else sharding.local(full.grad)

    def _grad_norm(self) -> torch.Tensor:
        """The replica's global gradient norm, clipping to optim.inner.grad_clip when it is > 0."""
        clip = self.cfg.optim.inner.grad_clip
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.ranks is not None:
            return sharding.clip_grad_norm_(grads, clip, self.ranks, foreach=self.foreach)
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=self.foreach)
        return torch.nn.utils.get_total_norm(grads, foreach=self.foreach)

    def _one_step(self, inner: LevelGroup, hook: FaultHook) -> torch.Tensor:
        cfg = self.cfg
        started = time.perf_counter()
        lr = inner_lr(cfg.optim.inner, self._schedule_step(), cfg.train.rounds * self.steps_per_round)
        for group in self.inner_opt.param_groups:
            group["lr"] = lr
        # localsgd: every inner_every steps, and at a balanced round's last step
        average = cfg.sync.inner == "localsgd" and (
            (self.step_in_round + 1) % cfg.sync.inner_every == 0 or self.step_in_round + 1 == self.round_steps
        )
        # a step that ends with a parameter average changes params and optimizer state before its
        # collective: keep what it started from, so a failed average leaves no step applied
        keep = average and inner.world_size > 1
        saved = [p.detach().clone() for p in self.params] if keep else None
        saved_opt = copy.deepcopy(self.inner_opt.state_dict()) if keep else None
        saved_nonfinite = self._nonfinite.clone() if keep else None
        try:
            loss = self._forward_backward(inner, hook)
            norm = self._grad_norm()
            self._nonfinite |= ~torch.isfinite(torch.stack([loss, norm.to(loss.device, torch.float32)]))
            self.inner_opt.step()
            if average:
                hook(Phase.INNER_SYNC, self.round, self.step_in_round)
                with torch.no_grad():
                    sharding.agreed(
                        lambda: inner.allreduce_mean([p.data for p in self.params], level="inner"),
                        self.ranks,
                        f"{self.rid}: inner parameter average",
                    )
        except BaseException:
            if self.buckets is not None:
                self.buckets.disarm()
            if keep:
                for p, before in zip(self.params, saved, strict=True):
                    p.data.copy_(before)
                self.inner_opt.load_state_dict(saved_opt)
                self._nonfinite.copy_(saved_nonfinite)
            raise
        if self.pacer is not None:
            self.pacer.after_step(started, self.global_index, self.step)
        return loss

    def run_inner(
        self,
        round_index: int,
        inner: LevelGroup,
        hook: FaultHook = lambda phase, r, s: None,
        at_snapshot: Callable[[], None] | None = None,
        steps: int | None = None,
    ) -> InnerReport:
        """Run inner steps until the round's last step is committed (or a hook raises YieldNow): `steps`
        of them (sync.balance's plan for this cluster), else sync.outer_every / fragments.
        Raises CollectiveError, NonFiniteError or Behind (see the module's failures). Losses stay on
        the device until the end: one read-back. At the round's snapshot step, before running it, it calls
        `take_outer_snapshot`, then `at_snapshot` (once per call: hsgd.train.overlap's reduce starts there)."""
        start, bytes_before, first, pending, yielded = time.perf_counter(), inner.bytes_sent, self.step, [], False
        losses: list[float] = []
        self.round_steps = steps or self.steps_per_round
        snapshot_point = self._snapshot_point(at_snapshot)
        if self._require(round_index, "run_inner"):
            try:
                while self.step_in_round < self.round_steps:
                    snapshot_point()
                    try:
                        hook("inner", self.round, self.step_in_round)
                    except YieldNow:
                        yielded = True
                        break
                    pending.append(self._one_step(inner, hook))
                    self.step += 1  # committed: the step's collectives all succeeded
                    if self.step_log is not None:
                        self.step_log.committed(self.step)
                if not yielded:
                    snapshot_point()  # entered at the round's end (a re-issued call): the reduce may still be due
                if self.ranks is not None:  # (not after a failure: the replica fails whole, its ranks apart)
                    losses, self._nonfinite = sharding.combine_phase_end(pending, self._nonfinite, self.ranks)
            finally:
                if pending and not losses:  # k=1, or a sharded phase that failed before its combine
                    losses = torch.stack(pending).tolist()
                self.round_losses.extend(losses)
            self._raise_if_nonfinite(first)
        return InnerReport(
            round=self.round,
            step=self.step,
            steps_done=len(pending),
            loss_sum=sum(losses),
            tokens=len(pending) * self.tokens_per_step,
            seconds=time.perf_counter() - start,
            inner_bytes=inner.bytes_sent - bytes_before,
            losses=losses,
            yielded=yielded,
        )

    def _snapshot_point(self, at_snapshot: Callable[[], None] | None) -> Callable[[], None]:
        """run_inner's check before each step: at this round's snapshot step (sync.fragment_delay), once
        per call, `take_outer_snapshot` then `at_snapshot`."""
        delay = fragment_delay_of(
            self.fragment_delay, self.round_steps, self.cfg.sync.inner_every if self.cfg.sync.inner == "localsgd" else 1
        )
        snapshot_seen = False

        def snapshot_point() -> None:
            nonlocal snapshot_seen
            due = delay and self.step_in_round >= self.round_steps - delay
            if due and not snapshot_seen:
                snapshot_seen = True
                self.take_outer_snapshot()
                if at_snapshot is not None:
                    at_snapshot()

        return snapshot_point

    def _raise_if_nonfinite(self, first: int) -> None:
        """NonFiniteError when a loss or gradient norm of the steps from `first` on was non-finite."""
        bad_loss, bad_norm = self._nonfinite.tolist()
        if bad_loss or bad_norm:
            what = "loss" if bad_loss else "grad_norm"
            raise NonFiniteError(
                what,
                f"{self.rid}: non-finite {what.replace('_', ' ')} in round {self.round} "
                f"(inner steps {first}..{self.step - 1}); its params must be healed",
            )
