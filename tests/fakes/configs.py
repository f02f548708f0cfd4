"""A small composed config for tests that build real trainers (hsgd.config.schema)."""

from __future__ import annotations

BASE = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=2",
    "sync.inner=ddp",
    "optim.inner.lr=0.01",
    "train.rounds=10",
]


def tiny_cfg(overrides):
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(BASE + list(overrides)))


def default_cfg(**changes):
    """A fresh default HsgdConfig with dotted-path overrides, e.g. default_cfg(**{"sync.inner": "x"})."""
    from hsgd.config import HsgdConfig, field_value

    cfg = HsgdConfig()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        setattr(field_value(cfg, ".".join(parents)) if parents else cfg, leaf, value)
    return cfg
