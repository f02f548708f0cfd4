"""The outer sweep's shortcut (benchmarks/outer_sweep.py): one trainer per cluster on its replicas' batches
side by side trains what a real `ddp` cluster over gloo trains, and the in-process outer group averages as
the trainers' own outer_reduce expects. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
from omegaconf import OmegaConf

from benchmarks.outer_sweep import ClusterBatches, ThreadGroup, check_supported, simulate
from tests.fakes.gloo_world import run_ranks

STEPS = 12
BASE = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=2",
    f"sync.outer_every={STEPS}",
    "sync.inner=ddp",
    "comm.bucket_mb=0",
    "seed=3",
]


def _cfg(extra=()):
    from hsgd.config.schema import HsgdConfig

    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(BASE + list(extra)))


def _real_worker(rank: int, port: int, results) -> None:
    out = {"rank": rank}
    try:
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        group = LevelGroup("inner", "gloo", timeout_s=20, configure_timeout_s=30)
        group.configure(f"127.0.0.1:{port}", "sweep/epoch1/inner/c0", rank=rank, world_size=2, epoch=1)
        t = ReplicaTrainer(_cfg(), f"c0r{rank}", Topology(1, 2))
        t.run_inner(0, group)
        out["params"] = [p.detach().numpy().copy() for p in t.params]  # numpy: no shared-memory handles
        group.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


def test_one_trainer_on_the_concatenated_batches_trains_what_a_ddp_pair_trains():
    from hsgd.core.topology import Topology
    from hsgd.train import task
    from hsgd.train.comm import LevelGroup
    from hsgd.train.trainer import ReplicaTrainer

    real = run_ranks(_real_worker, 2, timeout_s=180, store_timeout_s=30, join_s=5)
    cfg, topology = _cfg(), Topology(1, 2)
    dataset = task.build_dataset(cfg)
    members = [topology.global_index(r) for r in topology.cluster_members(0)]
    shortcut = ReplicaTrainer(cfg, "c0r0", topology, dataset=ClusterBatches(dataset, members))
    shortcut.run_inner(0, LevelGroup("inner"))
    initial = ReplicaTrainer(cfg, "c0r0", topology).params
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(shortcut.params, initial, strict=True))
    real_params = map(torch.from_numpy, real[0]["params"])
    diff = max(float((p.detach() - q).abs().max()) for p, q in zip(shortcut.params, real_params, strict=True))
    assert moved > 1e-2, "the trainers did not train"
    assert diff <= 1e-5 * max(1.0, moved), f"the shortcut is {diff} away from the real pair (moved {moved})"


def test_the_thread_group_means_in_rank_order_and_gathers_everything():
    group = ThreadGroup(3)
    ranks = [ThreadGroup.Rank(group, k) for k in range(3)]
    tensors = [[torch.full((5,), float(k + 1)), torch.full((2, 2), 10.0 * (k + 1))] for k in range(3)]
    gathered: dict[int, list] = {}

    def work(k: int) -> None:
        ranks[k].allreduce_mean(tensors[k], level="outer")
        gathered[k] = ranks[k].all_gather(torch.tensor([k], dtype=torch.int8), level="outer")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    for k in range(3):
        assert torch.equal(tensors[k][0], torch.full((5,), 2.0)) and torch.equal(
            tensors[k][1], torch.full((2, 2), 20.0)
        )
        assert [int(p) for p in gathered[k]] == [0, 1, 2]
    assert ranks[0].bytes_sent == 9 * 4 + 2  # the fp32 payload once, the int8 one to each of 2 peers


def test_a_run_the_sweep_cannot_simulate_is_refused_with_the_key():
    with pytest.raises(ValueError, match=r"sync.inner=localsgd is not simulated; valid: ddp"):
        check_supported(_cfg(["sync.inner=localsgd"]))


def test_a_hierarchical_run_with_a_codec_trains_and_counts_its_outer_bytes():
    res = simulate(
        BASE[:5]
        + [
            "topology.clusters=2",
            "topology.replicas_per_cluster=1",
            "sync.outer_every=4",
            "train.rounds=3",
            "train.eval_batches=2",
            "sync.outer_compress=int4",
        ],
        eval_every=1,
    )
    assert len(res["eval_losses"]) == 4 and res["final_eval_loss"] < res["initial_eval_loss"]
    assert res["outer_bytes"] > 0 and res["inner_steps"] == 12
