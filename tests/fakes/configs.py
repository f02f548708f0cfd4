"""A small composed config for tests that build real trainers (hsgd.config.schema)."""
from __future__ import annotations

BASE = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "data.batch_size=2",
        "sync.inner=ddp", "optim.inner.lr=0.01", "train.rounds=10"]


def tiny_cfg(overrides):
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(BASE + list(overrides)))
