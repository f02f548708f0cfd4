"""GPU paths behind the same interfaces as the CPU ones (skipped without CUDA): a replica's inner
steps, the outer step with pinned host copies of the global params, heals and checkpoints of
CUDA state, and the NCCL level group's buffers. No Ray needed: run anywhere torch sees a GPU with
`python -m pytest -q tests/gpu -s`."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cfg():
    from hsgd.config.schema import HsgdConfig

    cfg = HsgdConfig()  # the typed schema itself: no Hydra/OmegaConf needed on a bare GPU box
    cfg.sync.outer_every = 10
    cfg.data.batch_size = 16
    return cfg


@pytest.fixture(scope="module")
def corpus():
    from hsgd.train import task

    return task.build_dataset(_cfg())


def _trainer(corpus, rid="c0r0"):
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import ReplicaTrainer

    return ReplicaTrainer(_cfg(), rid, Topology(2, 2), device="cuda", dataset=corpus)


def _solo(level):
    from hsgd.train.comm import LevelGroup

    group = LevelGroup(level, backend="nccl")
    group.configure(None, f"gpu-smoke/{level}", 0, 1, 0)
    return group


def test_a_round_on_the_gpu_commits_and_every_copy_agrees(corpus):
    t = _trainer(corpus)
    assert next(t.model.parameters()).is_cuda and t.outer_opt.global_params[0].is_pinned()
    inner, outer = _solo("inner"), _solo("outer")
    t.run_inner(0, inner)  # warm-up round (kernels, allocator)
    t.outer_reduce(0, 1, outer)
    t.outer_commit(0, inner, roots=(0,))
    torch.cuda.synchronize()
    start = time.perf_counter()
    report = t.run_inner(1, inner)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    t.outer_reduce(1, 2, outer)
    t.outer_commit(1, inner, roots=(0,))
    assert (t.round, t.step) == (2, 20)
    assert t.param_digest() == t.global_digest(), "after a commit the params are the global params"
    print(
        f"\n[gpu smoke] {torch.cuda.get_device_name()}: {report.tokens / seconds:,.0f} tokens/s, "
        f"{seconds / report.steps_done * 1e3:.1f} ms per inner step (tiny model, batch 16 x 64), "
        f"eval loss {t.eval_loss():.4f}"
    )


def test_heals_of_cuda_state_give_bitwise_copies(corpus):
    source, full, glob = _trainer(corpus, "c0r0"), _trainer(corpus, "c0r1"), _trainer(corpus, "c1r0")
    inner, outer = _solo("inner"), _solo("outer")
    source.run_inner(0, inner)
    source.outer_reduce(0, 1, outer)
    source.outer_commit(0, inner, roots=(0,))
    source.run_inner(1, inner)
    full.load_state_dict(source.state_dict(), scope="full")
    assert full.param_digest() == source.param_digest() and (full.round, full.step) == (1, 20)
    glob.load_state_dict(source.global_state(), scope="global")
    assert glob.param_digest() == source.global_digest() and (glob.round, glob.step) == (1, 10)


def test_checkpoint_of_cuda_state_round_trips(corpus, tmp_path):
    from hsgd.train import checkpoint

    t = _trainer(corpus)
    t.run_inner(0, _solo("inner"))
    sha = checkpoint.save_replica_state(tmp_path, "c0r0", t.state_dict())
    back = _trainer(corpus)
    back.load_state_dict(checkpoint.load_replica_state(tmp_path, "c0r0", sha), scope="full")
    assert back.param_digest() == t.param_digest()


def test_nccl_level_group_flattens_into_one_gpu_buffer():
    from hsgd.train.comm import LevelGroup

    group = LevelGroup("outer", backend="nccl")
    flat = group._flat([torch.ones(3), torch.zeros(2, 2)])  # outer pseudo-gradients live on the host
    assert flat.is_cuda and flat.numel() == 7
