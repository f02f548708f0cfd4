"""A replica sharded with FSDP2 over 2 GPUs (issue 34; hsgd.train.sharding) against the same replica
on one GPU (skipped with fewer than 2 CUDA devices). No Ray: run with `python -m pytest -q tests/gpu -s`.

Two spawns through tests/fakes/gloo_world.run_ranks: k=2 (2 rank processes, rank j on cuda:j, one
replica group "cpu:gloo,cuda:nccl": NCCL carries FSDP2's all-gathers and reduce-scatters, gloo the
trainer's replica-level CPU scalars and its digest objects) and k=1 (one process on cuda:0). Both
train the same tiny model on the same seed and tokens with bf16 compute (FSDP2's bf16 params with
fp32 reduce on k=2, autocast on k=1): ROUNDS DiLoCo rounds over solo inner/outer groups. Checked:
the k=2 replica's eval loss and per-step losses are within BF16_RTOL of k=1's, the loss moved by
many times that tolerance (so the tolerance can tell), both ranks report the same losses and the
same combined digest (hsgd.train.sharding.combined_digest), and after each commit the replica's
params are its global params. Each rank process fails with its traceback, never hangs
(run_ranks' deadline; the replica group's timeout)."""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (one per rank of the sharded replica)",
)

ROUNDS, STEPS = 2, 4
# bf16 keeps 8 bits of mantissa (relative spacing 2^-8 = 0.4 %): two replicas that round and sum
# in a different order (sharded bf16 params vs autocast of fp32 params, reduce-scatter vs one
# backward) drift apart by a few of those over a few steps. 2 % relative is about five bf16 steps
# of the loss; a wrong shard, a gradient summed instead of averaged or a step lost is far more.
BF16_RTOL = 2e-2
OVERRIDES = [
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=2",
    "model.block_size=32",
    "data.batch_size=8",
    "topology.clusters=1",
    "topology.replicas_per_cluster=1",
    f"sync.outer_every={STEPS}",
    "sync.outer=diloco",
    f"train.rounds={ROUNDS}",
    "train.eval_batches=2",
    "train.precision=bf16",
    "optim.inner.lr=3e-3",
    "optim.inner.warmup_steps=0",
]


def _run(k: int, rank: int, port: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train.comm import LevelGroup
    from hsgd.train.sharding import ReplicaRanks
    from hsgd.train.trainer import ReplicaTrainer

    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)
    ranks = None
    if k > 1:  # the replica's own group of its k processes (level "replica")
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            store=dist.PrefixStore("gpu-fsdp", store),
            rank=rank,
            world_size=k,
            timeout=timedelta(seconds=60),
            device_id=torch.device(device),
        )
        ranks = ReplicaRanks(rank, k, dist.group.WORLD)
    cfg = OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(OVERRIDES))
    t = ReplicaTrainer(cfg, "c0r0", Topology(1, 1), device=device, ranks=ranks)
    assert t.params[0].is_cuda and t.params[0].device.index == rank
    inner, outer = LevelGroup("inner", backend="nccl"), LevelGroup("outer", backend="nccl")
    inner.configure(None, "gpu-fsdp/inner", 0, 1, 0)  # one replica: no peers at either level
    outer.configure(None, "gpu-fsdp/outer", 0, 1, 0)
    out = {"rank": rank, "initial": t.eval_loss(), "losses": [], "committed": []}
    for r in range(ROUNDS):
        out["losses"] += t.run_inner(r, inner).losses
        t.outer_reduce(r, 1, outer)
        t.outer_commit(r, inner, roots=(0,))
        out["committed"].append(t.param_digest() == t.global_digest())
    out.update(final=t.eval_loss(), digest=t.param_digest(), step=t.step, local_numel=sum(p.numel() for p in t.params))
    if k > 1:
        dist.destroy_process_group()
    return out


def _worker(k: int, rank: int, port: int, results) -> None:
    try:
        out = _run(k, rank, port)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out = {"rank": rank, "exception": traceback.format_exc()}
    results.put(out)


@pytest.fixture(scope="module")
def runs():
    from tests.fakes.gloo_world import run_ranks

    sharded = run_ranks(functools.partial(_worker, 2), 2, timeout_s=240, store_timeout_s=60, join_s=10)
    whole = run_ranks(functools.partial(_worker, 1), 1, timeout_s=180, store_timeout_s=60, join_s=10)
    return {2: sharded, 1: whole[0]}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_both_ranks_of_the_sharded_replica_agree_and_each_holds_half(runs):
    r0, r1 = runs[2][0], runs[2][1]
    assert r0["digest"] == r1["digest"], "the combined digest differs between the replica's ranks"
    assert (r0["losses"], r0["final"]) == (r1["losses"], r1["final"]), "the replica's ranks report different losses"
    assert r0["step"] == runs[1]["step"] == ROUNDS * STEPS
    assert r0["local_numel"] + r1["local_numel"] == runs[1]["local_numel"]
    assert max(r0["local_numel"], r1["local_numel"]) < runs[1]["local_numel"] * 0.6
    assert all(r0["committed"]) and all(runs[1]["committed"]), "after a commit the params are not the global params"


def test_the_sharded_replica_trains_as_the_whole_one_within_bf16_tolerance(runs):
    sharded, whole = runs[2][0], runs[1]
    gap = _relative(sharded["final"], whole["final"])
    print(
        f"\n[gpu fsdp] {torch.cuda.get_device_name(0)} x2: eval loss {whole['initial']:.4f} -> "
        f"k=1 {whole['final']:.5f}, k=2 {sharded['final']:.5f} (relative {gap:.2e}, tolerance {BF16_RTOL})"
    )
    assert whole["initial"] - whole["final"] > 5 * BF16_RTOL * whole["final"], "too little training to tell"
    assert _relative(sharded["initial"], whole["initial"]) <= BF16_RTOL
    assert gap <= BF16_RTOL, (sharded["final"], whole["final"])
    worst = max(_relative(s, w) for s, w in zip(sharded["losses"], whole["losses"], strict=False))
    assert len(sharded["losses"]) == ROUNDS * STEPS and worst <= BF16_RTOL, worst
