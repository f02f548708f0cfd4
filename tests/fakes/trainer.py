"""A tiny one-replica trainer setup (config, dataset fixture, a group of one), for the tests of
hsgd.train.trainer and what reads its step log."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hsgd.config.schema import HsgdConfig
from hsgd.core.topology import Topology
from hsgd.train import task
from hsgd.train.comm import LevelGroup
from hsgd.train.trainer import ReplicaTrainer


def _cfg(*overrides: str, **sync):
    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 16, 2, 16
    cfg.data.batch_size, cfg.train.eval_batches = 2, 1
    cfg.sync.outer_every = 3
    for key, value in sync.items():
        cfg.sync[key] = value
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


@pytest.fixture(scope="module")
def dataset():
    return task.build_dataset(_cfg())


def _solo(level):
    group = LevelGroup(level)
    group.configure(None, f"test/{level}", rank=0, world_size=1, epoch=0)
    return group


def _trainer(dataset, rid="c0r0", *overrides: str, **sync):
    return ReplicaTrainer(_cfg(*overrides, **sync), rid, Topology(2, 2), dataset=dataset)
