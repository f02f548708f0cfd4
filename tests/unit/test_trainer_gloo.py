"""Two replicas of one `ddp` cluster in two processes over a real gloo group: they stay bitwise
equal with every inner-optimizer implementation and in bf16, and the overlapped bucketed
all-reduce matches the all-reduce after backward. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.fakes.gloo_world import run_ranks

VARIANTS = {  # name -> config overrides; every variant trains 2 replicas of cluster c0 over gloo
    "single": ["optim.inner.implementation=single"],
    "foreach": ["optim.inner.implementation=foreach"],
    "fused": ["optim.inner.implementation=fused"],
    "bf16": ["train.precision=bf16"],
    "grad_accum": ["data.grad_accum=2", "comm.bucket_mb=0.002"],
    "overlapped": ["comm.bucket_mb=0.002"],  # ~2 KB buckets: many buckets launched during backward
    "after_backward": ["comm.bucket_mb=0"],  # one all-reduce after the whole backward
}
STEPS = 24


def _worker(rank: int, port: int, results) -> None:
    out = {"rank": rank}
    try:
        from omegaconf import OmegaConf

        from hsgd.config.schema import HsgdConfig
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        group = LevelGroup("inner", "gloo", timeout_s=20, configure_timeout_s=30)
        group.configure(f"127.0.0.1:{port}", "test/epoch1/inner/c0", rank=rank, world_size=2, epoch=1)
        base = [
            "model.n_layer=1",
            "model.n_embd=32",
            "model.n_head=2",
            "model.block_size=16",
            "data.batch_size=2",
            f"sync.outer_every={STEPS}",
            "sync.inner=ddp",
        ]
        params = {}
        for name, overrides in VARIANTS.items():
            cfg = OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(base + overrides))
            t = ReplicaTrainer(cfg, f"c0r{rank}", Topology(1, 2))
            report = t.run_inner(0, group)
            out[name] = {"digest": t.param_digest(), "first": sum(report.losses[:4]), "last": sum(report.losses[-4:])}
            params[name] = [p.detach().clone() for p in t.params]
        out["overlap_max_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(params["overlapped"], params["after_backward"], strict=True)
        )
        group.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def two_replicas():
    return run_ranks(_worker, 2, timeout_s=240, store_timeout_s=30, join_s=5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_replicas_of_a_ddp_cluster_stay_bitwise_equal(two_replicas, variant):
    a, b = two_replicas[0][variant], two_replicas[1][variant]
    assert a["digest"] == b["digest"], f"{variant}: c0r0 and c0r1 hold different params after {STEPS} ddp steps"


@pytest.mark.parametrize("variant", ["bf16", "grad_accum", "overlapped"])
def test_the_loss_decreases(two_replicas, variant):
    r = two_replicas[0][variant]
    assert r["last"] < r["first"], f"{variant}: loss of the last 4 steps {r['last']} vs first 4 {r['first']}"


def test_the_overlapped_bucketed_allreduce_matches_the_one_after_backward(two_replicas):
    assert two_replicas[0]["overlap_max_diff"] <= 1e-6, two_replicas[0]["overlap_max_diff"]
