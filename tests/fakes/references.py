"""Pure-torch references for the numerical-parity tests in test_numerics.py (no Ray, no hsgd sync code).

Each reference rebuilds what hsgd is supposed to compute from the algorithm's definition, using only
the pieces of hsgd that are not under test: the model and inner-optimizer factories
(`hsgd.train.task.build_model`, `hsgd.train.inner.build_inner_optimizer`), the corpus and the
step-indexed batches (`hsgd.train.data`, through `batch_for_step` below). Everything that hsgd's sync
layers do (gradient all-reduce, parameter averaging, pseudo-gradients, the outer optimizer) is
written here independently.

Replica `c<c>r<i>` has global index `c * replicas_per_cluster + i`; its batch at global inner step
`s` (0-based) is `batch_for_step(..., replica_index=global_index, step=s)`.

All references run torch with ONE intra-op thread, as hsgd's Replica actors do
(`torch.set_num_threads(1)`): CPU matmul results may depend on the thread count.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from hsgd.train.data import _batch_at, _offsets, load_corpus
from hsgd.train.inner import build_inner_optimizer
from hsgd.train.task import build_model

# ----------------------------------------------------------------------------- shared pieces


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def corpus_for(cfg: Any):
    return load_corpus(cfg.data.path, cfg.data.val_fraction, block_size=cfg.model.block_size)


def fresh_model(cfg: Any, vocab_size: int) -> torch.nn.Module:
    """The initial model every hsgd replica builds: torch.manual_seed(seed), then build_model."""
    torch.manual_seed(cfg.seed)
    return build_model(cfg, vocab_size)


def batch_for_step(
    tokens: torch.Tensor, *, seed: int, replica_index: int, step: int, batch_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch replica `replica_index` trains on at `step` (a dataset's micro-batch 0): x, y of
    shape (B, T) int64, y = x shifted by one. Depends only on the arguments."""
    return _batch_at(
        tokens,
        _offsets(
            len(tokens),
            seed=seed,
            replica_index=replica_index,
            step=step,
            micro=0,
            batch_size=batch_size,
            block_size=block_size,
        ),
        block_size,
    )


def batch(cfg: Any, train: torch.Tensor, replica_index: int, step: int):
    return batch_for_step(
        train,
        seed=cfg.seed,
        replica_index=replica_index,
        step=step,
        batch_size=cfg.data.batch_size,
        block_size=cfg.model.block_size,
    )


def clip(cfg: Any, params) -> None:
    if cfg.optim.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.inner.grad_clip, foreach=False)


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


# ----------------------------------------------------------------------------- 1. torch DDP (gloo)


def _ddp_worker(rank: int, world: int, cfg_dict: dict, total_steps: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train = corpus_for(cfg).train
        model = fresh_model(cfg, corpus_for(cfg).vocab_size)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        params = list(model.parameters())
        opt = build_inner_optimizer(cfg, params)
        for step in range(total_steps):
            x, y = batch(cfg, train, rank, step)  # rank r == global index of c0r<r>
            _, loss = ddp(x, y)
            opt.zero_grad(set_to_none=False)
            loss.backward()  # DDP averages the gradients over the world here
            clip(cfg, params)
            opt.step()
        if rank == 0:
            torch.save(snapshot(params), out_file)
    finally:
        dist.destroy_process_group()


def torch_ddp_reference(cfg: Any, world: int, total_steps: int, workdir: str) -> list[torch.Tensor]:
    """Final params of rank 0 of a plain torch.distributed DDP run: `world` processes (gloo, FileStore),
    rank r trains on replica r's batches, `total_steps` steps. DDP all-reduces the gradient every step."""
    init_file = os.path.join(workdir, "ddp_store")
    out_file = os.path.join(workdir, "ddp_rank0.pt")
    mp.spawn(
        _ddp_worker,
        args=(world, OmegaConf.to_container(cfg, resolve=True), total_steps, init_file, out_file),
        nprocs=world,
        join=True,
    )
    return torch.load(out_file, weights_only=True)


# ----------------------------------------------------------------------------- 2. local SGD + averaging


def localsgd_average_reference(cfg: Any, total_steps: int) -> list[list[torch.Tensor]]:
    """Hierarchical local SGD in one process. Every replica has its own model and inner optimizer
    (state never averaged or reset). After the n-th optimizer step (n = 1, 2, ...):
      n % inner_every == 0: every cluster's replicas take the mean of the cluster's params;
      n % outer_every == 0: every replica takes the mean of the cluster means.
    Returns the final params of every replica, in global-index order."""
    C, R = cfg.topology.clusters, cfg.topology.replicas_per_cluster
    with one_thread():
        corpus = corpus_for(cfg)
        models = [fresh_model(cfg, corpus.vocab_size) for _ in range(C * R)]
        params = [list(m.parameters()) for m in models]
        opts = [build_inner_optimizer(cfg, ps) for ps in params]
        for step in range(total_steps):
            for g, (model, ps, opt) in enumerate(zip(models, params, opts, strict=True)):
                x, y = batch(cfg, corpus.train, g, step)
                _, loss = model(x, y)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                clip(cfg, ps)
                opt.step()
            n = step + 1
            with torch.no_grad():
                cluster_means = []
                for c in range(C):
                    members = params[c * R : (c + 1) * R]
                    means = [torch.stack([ps[k] for ps in members]).sum(0) / R for k in range(len(members[0]))]
                    cluster_means.append(means)
                    if n % cfg.sync.inner_every == 0:
                        for ps in members:
                            for p, m in zip(ps, means, strict=True):
                                p.copy_(m)
                if n % cfg.sync.outer_every == 0:
                    means = [
                        torch.stack([cm[k] for cm in cluster_means]).sum(0) / C for k in range(len(cluster_means[0]))
                    ]
                    for ps in params:
                        for p, m in zip(ps, means, strict=True):
                            p.copy_(m)
        return [snapshot(ps) for ps in params]


def _hma_worker(rank: int, world: int, cfg_dict: dict, total_steps: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        corpus = corpus_for(cfg)
        model = fresh_model(cfg, corpus.vocab_size)
        params = list(model.parameters())
        opt = build_inner_optimizer(cfg, params)
        # Period inner_every over groups of replicas_per_cluster consecutive ranks (= the clusters:
        # rank = global index = c * R + i), period outer_every over everyone. The averager counts
        # its calls from 0 and averages when its counter divides a period; hsgd averages after the
        # n-th step with n = 1, 2, ...: one warm-up call (a no-op) shifts the counter to match.
        averager = HierarchicalModelAverager(
            period_group_size_dict=OrderedDict(
                [(cfg.sync.inner_every, cfg.topology.replicas_per_cluster), (cfg.sync.outer_every, world)]
            ),
            warmup_steps=1,
        )
        averager.average_parameters(params)  # warm-up: no averaging, counter 0 -> 1
        for step in range(total_steps):
            x, y = batch(cfg, corpus.train, rank, step)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            clip(cfg, params)
            opt.step()
            averager.average_parameters(params)
        torch.save(snapshot(params), os.path.join(out_dir, f"hma_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def hierarchical_model_averager_reference(cfg: Any, total_steps: int, workdir: str) -> list[list[torch.Tensor]]:
    """The same schedule with PyTorch's HierarchicalModelAverager: one process per replica (gloo)."""
    world = cfg.topology.clusters * cfg.topology.replicas_per_cluster
    init_file = os.path.join(workdir, "hma_store")
    mp.spawn(
        _hma_worker,
        args=(world, OmegaConf.to_container(cfg, resolve=True), total_steps, init_file, workdir),
        nprocs=world,
        join=True,
    )
    return [torch.load(os.path.join(workdir, f"hma_rank{r}.pt"), weights_only=True) for r in range(world)]


# ----------------------------------------------------------------------------- 3. DiLoCo Algorithm 1


def diloco_reference(cfg: Any, rounds: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]:
    """DiLoCo (arXiv 2311.08105, Algorithm 1) with synchronous data parallelism inside each cluster.

    Inside a cluster, DDP keeps every replica identical, so one model per cluster stands for all of
    them: its gradient at each step is the mean of the gradients its replicas compute on their own
    batches (summed, then divided by the cluster size, as an all-reduce-sum-then-divide does).
    Per round (outer_every inner steps):
        delta   = mean over clusters of (global params at round start - cluster params)
        global  = OuterSGD(global, delta)   (torch.optim.SGD, lr/momentum/nesterov from optim.outer)
        cluster params = global; the inner optimizer state is kept (never reset).
    Returns (global params, [params of every cluster's model], outer momentum buffers) after `rounds`
    rounds."""
    C, R, H = cfg.topology.clusters, cfg.topology.replicas_per_cluster, cfg.sync.outer_every
    o = cfg.optim.outer
    with one_thread():
        corpus = corpus_for(cfg)
        models = [fresh_model(cfg, corpus.vocab_size) for _ in range(C)]
        params = [list(m.parameters()) for m in models]
        opts = [build_inner_optimizer(cfg, ps) for ps in params]
        global_params = [p.detach().clone().requires_grad_(True) for p in params[0]]
        outer_opt = torch.optim.SGD(global_params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
        step = 0
        for _ in range(rounds):
            for _ in range(H):
                for c, (model, ps, opt) in enumerate(zip(models, params, opts, strict=True)):
                    grads = []
                    for i in range(R):
                        x, y = batch(cfg, corpus.train, c * R + i, step)
                        _, loss = model(x, y)
                        opt.zero_grad(set_to_none=False)
                        loss.backward()
                        grads.append([p.grad.detach().clone() for p in ps])
                    with torch.no_grad():
                        for k, p in enumerate(ps):
                            p.grad.copy_(torch.stack([g[k] for g in grads]).sum(0) / R)
                    clip(cfg, ps)
                    opt.step()
                step += 1
            with torch.no_grad():
                deltas = [[g.detach() - p.detach() for g, p in zip(global_params, ps, strict=True)] for ps in params]
                for k, g in enumerate(global_params):
                    g.grad = torch.stack([d[k] for d in deltas]).sum(0) / C
            outer_opt.step()
            outer_opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for ps in params:
                    for p, g in zip(ps, global_params, strict=True):
                        p.copy_(g)
        momentum = [outer_opt.state[g]["momentum_buffer"].clone() for g in global_params]
        return snapshot(global_params), [snapshot(ps) for ps in params], momentum
