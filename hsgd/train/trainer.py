"""What one replica owns and the work it does when the supervisor tells it to.

A `ReplicaTrainer` holds a full model copy, its inner optimizer, the round-start global params
with the outer optimizer (outer.py) and its counters: `round` (committed rounds) and `step`
(committed inner steps in total). Its data position IS its step (task.py's Dataset contract), and
so is the inner learning rate (`inner_lr`): a healed or resumed replica needs no data-loader or
RNG state (no dropout by default).

Each phase method runs ONE level's collectives, never both, so a replica is in at most one
collective at a time: `run_inner` (inner steps), `cluster_average` (inner `none`), `outer_reduce`
(shard holders, level "outer": the first phase of the two-phase commit) and `outer_commit` (level
"inner": the holders broadcast, every replica applies the outer step). What a round syncs is
hsgd/core/outer_plan.py's, cut into shards at the codec's block boundaries.
Failures:
- A failed collective raises `hsgd.train.comm.CollectiveError` and leaves the state exactly where
  the last committed step left it (a localsgd step whose average failed is rolled back, so its
  retry never applies the optimizer step twice); the step in flight is redone after re-planning.
- A non-finite loss or gradient norm sets a flag on the device (no per-step host sync), read once
  at the phase's end, where `run_inner` raises `NonFiniteError`: the replica must be healed.
  `outer_reduce` raises it before sending a non-finite pseudo-gradient.
Phase calls are idempotent per (round, phase): a call for a round already committed is a no-op,
one for a round this replica has not reached raises `Behind`.

A replica larger than one device (`ranks`, hsgd.train.sharding, issue 34): the trainer runs on
each of the replica's k rank processes, every phase method called identically on each. The
model is sharded with FSDP2 and `self.params` (so the inner optimizer, the outer state, the codec
residuals, the snapshot, a heal's and a checkpoint's state) holds this rank's local shards; the
LevelGroups a rank is given join rank j of every replica, so sync works shard by shard unchanged.
Inner `ddp` is HSDP: FSDP2 reduce-scatters inside the replica, then the local gradient shards
are all-reduced over `inner`. Replica-level collectives (sharding.REPLICA_LEVEL) run inside the
phase methods — the global gradient norm, the phase-end losses and non-finite flags, a
pseudo-gradient's finiteness, the digests, the gathered final model — so every rank of a replica
raises together (an outer reduce behind the inner steps, `outer_reduce(behind=True)` on a second
thread, agrees over the replica's background group instead: hsgd.train.overlap). A `full` heal
loads rank j's `state_dict` from rank j of the source replica. A checkpoint holds `sharded_state()`
(DTensors of the shards: DCP reshards it to any k on load, `load_sharded_state`); a k=1 checkpoint
file loads into k ranks through `rank_slice`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hsgd.config.auto import outer_step_of, schedule_of, warmup_steps_of
from hsgd.config.layout import RunLayout, layout_of
from hsgd.config.rounds import is_streaming
from hsgd.core.outer_plan import fragment_of_params, fragment_of_round, shard_bounds
from hsgd.core.phases import Phase
from hsgd.core.round.balance import fragment_delay_of
from hsgd.core.topology import Topology
from hsgd.train import sharding, task
from hsgd.train.buckets import GradBuckets
from hsgd.train.checkpoint import write_atomic
from hsgd.train.codec import ALIGN, compress_with_feedback, make_codec
from hsgd.train.comm import LevelGroup
from hsgd.train.exchange import exchange_of, gather_mean, reduce_scatter_mean
from hsgd.train.outer import OuterOptimizer, outer_hyperparameters
from hsgd.train.sharding import ReplicaRanks
from hsgd.train.simulate import pacer_from_config
from hsgd.train.state_stream import join_state, split_state

# hook(phase, round, step_in_round) is called at every step/phase boundary; fault injection uses it.
FaultHook = Callable[[str, int, int], None]


class Behind(RuntimeError):
    """A phase call for a round this replica has not reached: it must be healed first."""


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


def param_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the tensors, in order: equal digests = bitwise-equal params."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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


class ReplicaTrainer:
    last_exchange: str | None = (
        None  # what the last outer reduce ran (hsgd.train.exchange): the round's metrics name it
    )

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
        hp = outer_hyperparameters(cfg.sync.outer, *outer_step_of(cfg, layout), cfg.optim.outer.nesterov)
        self.outer_opt = OuterOptimizer(self.params, pin_memory=self.device_type == "cuda", **hp)
        self.fragments = int(cfg.sync.fragments)
        self.fragment_of = fragment_of_params(self.param_names, self.fragments)  # per parameter
        self.fragment_alpha = float(cfg.sync.fragment_alpha)
        self.codec = (
            make_codec(cfg.sync.outer_compress, float(cfg.sync.outer_topk))
            if cfg.sync.outer_compress != "none"
            else None
        )
        # error feedback: what compression did not send yet, this cluster's (fp32, one per parameter)
        self.outer_residual: list[torch.Tensor] | None = None
        # sync.fragment_delay: (round, corrected flat fp32 pseudo-gradient), see take_outer_snapshot
        self.fragment_delay = cfg.sync.fragment_delay
        self._outer_snapshot: tuple[int, torch.Tensor] | None = None
        self.grad_accum = int(cfg.data.grad_accum)
        per_batch = getattr(self.dataset, "tokens_per_batch", None) or cfg.data.batch_size * cfg.model.block_size
        self.tokens_per_step = int(per_batch) * self.grad_accum
        self.steps_per_round = layout.steps_per_round
        # inner ddp: gradient buckets all-reduced from backward hooks as they fill (bucket_mb <= 0: after backward)
        bucket_mb = float(cfg.comm.bucket_mb)
        # (sharded: FSDP2's own per-block buckets reduce inside the replica; the shards after backward)
        self.buckets = (
            GradBuckets(self.params, bucket_mb)
            if cfg.sync.inner == "ddp" and bucket_mb > 0 and self.ranks is None
            else None
        )
        self.round, self.step = 0, 0
        self.round_steps = self.steps_per_round  # this round's inner steps (sync.balance plans fewer)
        self.round_losses: list[float] = []
        # (outer_reduce's key, mean of that shard, flat fp32): never reused or committed under another key
        self._outer_buffer: tuple[tuple, torch.Tensor] | None = None
        # inner `none`: (round, epoch) of the last cluster_average, and (round, the params before it)
        self._averaged: tuple[int, int] | None = None
        self._pre_average: tuple[int, list[torch.Tensor]] | None = None
        self.pacer = pacer_from_config(
            cfg, topology.cluster_of(rid)
        )  # simulated step time / stragglers: None unless configured
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
        """Where the inner lr schedule stands: a cluster that takes fewer steps in a round (sync.balance)
        covers the same stretch of it per round, so its step s is at round * spr + s * spr / its steps."""
        if self.round_steps == self.steps_per_round:
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

    # -- inner phase ----------------------------------------------------------------------------
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
        snapshot_seen = False
        self.round_steps = steps or self.steps_per_round
        delay = fragment_delay_of(
            self.fragment_delay, self.round_steps, self.cfg.sync.inner_every if self.cfg.sync.inner == "localsgd" else 1
        )

        def snapshot_point() -> None:
            nonlocal snapshot_seen
            due = delay and self.step_in_round >= self.round_steps - delay
            if due and not snapshot_seen:
                snapshot_seen = True
                self.take_outer_snapshot()
                if at_snapshot is not None:
                    at_snapshot()

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
            bad_loss, bad_norm = self._nonfinite.tolist()
            if bad_loss or bad_norm:
                what = "loss" if bad_loss else "grad_norm"
                raise NonFiniteError(
                    what,
                    f"{self.rid}: non-finite {what.replace('_', ' ')} in round {self.round} "
                    f"(inner steps {first}..{self.step - 1}); its params must be healed",
                )
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

    # -- outer phase ----------------------------------------------------------------------------
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

    # -- state for a sharded (DCP) checkpoint: resharded on load ----------------------------------
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

        def local(key: str) -> torch.Tensor:
            return sharding.local(state[key]).detach().to("cpu").clone()

        names = list(enumerate(self.param_names))
        inner = {}
        if state["inner_started"]:
            steps = self.cfg.optim.inner.name != "sgd"  # AdamW counts its steps per parameter; SGD does not
            inner = {
                i: {
                    **({"step": state[f"inner.step/{name}"].clone()} if steps else {}),
                    **{slot: local(f"inner.{slot}/{name}") for slot in self._inner_slots()},
                }
                for i, name in names
            }
        outer = self.outer_opt.state_dict()
        momentum = (
            {i: {"momentum_buffer": local(f"momentum/{name}")} for i, name in names}
            if state["momentum_started"]
            else {}
        )
        self.load_state_dict(
            {
                "round": int(state["round"]),
                "step": int(state["step"]),
                "round_losses": [],
                "params": [local(f"param/{name}") for _, name in names],
                "inner_opt": {"state": inner, "param_groups": self.inner_opt.state_dict()["param_groups"]},
                "outer": {
                    "global_params": [local(f"global/{name}") for _, name in names],
                    "sgd": {"state": momentum, "param_groups": outer["sgd"]["param_groups"]},
                },
                "outer_residual": [local(f"residual/{name}") for _, name in names]
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
