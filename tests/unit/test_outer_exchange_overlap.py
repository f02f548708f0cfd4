"""The `reduce_scatter` outer exchange behind the inner steps (sync.fragment_delay, hsgd.train.overlap) on
real gloo groups, 3 sites of one replica, int8, two fragments (issue 47, Build 2): every round's reduce
runs in the background thread as the auto exchange picks it for 3 sites, every holder's reduced buffer
and global params are bitwise the same after each commit, and the reduce's bytes both ways are handed
back by settle. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.fakes.configs import tiny_cfg
from tests.fakes.gloo_world import run_ranks

SITES, ROUNDS = 3, 3
OVERRIDES = [
    "sync.outer_compress=int8",
    "sync.outer_every=8",
    "sync.fragments=2",
    "sync.fragment_alpha=0.5",
    "sync.fragment_delay=2",
]


def _worker(rank, port, results) -> None:
    out = {"rank": rank, "rounds": []}
    try:
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup, allow_level_overlap
        from hsgd.train.overlap import BackgroundReduce
        from hsgd.train.trainer import ReplicaTrainer, param_digest

        torch.set_num_threads(1)
        allow_level_overlap(True)
        topo = Topology(SITES, 1)
        inner = LevelGroup("inner")
        inner.configure(None, f"t/inner/c{rank}", rank=0, world_size=1, epoch=1)
        outer = LevelGroup("outer", "gloo", timeout_s=30, configure_timeout_s=60)
        outer.configure(f"127.0.0.1:{port}", "t/outer", rank=rank, world_size=SITES, epoch=1)
        trainer = ReplicaTrainer(tiny_cfg(OVERRIDES), f"c{rank}r0", topo)
        background = BackgroundReduce(trainer, outer)
        for r in range(ROUNDS):
            trainer.run_inner(r, inner, at_snapshot=lambda r=r: background.start((r, 1, 0, 1)))
            spent = background.settle((r, 1, 0, 1), timeout_s=120)
            trainer.outer_reduce(r, 1, outer, 0, 1)  # the buffer is there: returns at once
            row = {
                "spent": spent,
                "exchange": trainer.last_exchange,
                "buffer": param_digest([trainer._outer_buffer[1]]),
            }
            trainer.outer_commit(r, inner, (0,))
            out["rounds"].append({**row, "global": trainer.global_digest()})
        outer.abort()
    except BaseException:  # noqa: BLE001 — reported to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def outs():
    return run_ranks(_worker, SITES, timeout_s=300, store_timeout_s=60, join_s=5)


def test_the_reduce_scatter_behind_the_inner_steps_gives_every_site_the_same_bits(outs):
    for r in range(ROUNDS):
        rows = {rank: out["rounds"][r] for rank, out in outs.items()}
        assert {row["exchange"] for row in rows.values()} == {"reduce_scatter"}, rows
        for key in ("buffer", "global"):
            got = {rank: row[key] for rank, row in rows.items()}
            assert len(set(got.values())) == 1, f"round {r}: the sites' {key} digests differ: {got}"
        for rank, row in rows.items():
            spent = row["spent"]
            assert spent is not None, f"site {rank} round {r}: its reduce did not run behind the steps"
            assert spent["outer_bytes"] > 0 and spent["outer_link_bytes"] > spent["outer_bytes"], spent
