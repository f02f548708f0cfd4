"""Small real checkpoints (hsgd.train.checkpoint) for the tests that read them back."""

from __future__ import annotations

from pathlib import Path

import torch

from hsgd.train import checkpoint as ckpt


def replica_state(seed: int = 0) -> dict:
    """A replica's state as a checkpoint holds it: two random tensors from `seed`, round 5, step 100."""
    g = torch.Generator().manual_seed(seed)
    return {
        "rid": "c0r0",
        "round": 5,
        "step": 100,
        "params": [torch.randn(3, 4, generator=g), torch.randn(7, generator=g)],
        "inner_opt": {"state": {}, "param_groups": [{"lr": 0.003, "params": [0, 1]}]},
        "round_losses": [1.5, 1.25],
    }


def write_checkpoint(root, round_index, rids=("c0r0", "c1r0"), owner="run-a", fingerprint=None) -> Path:
    """A finalized checkpoint of `rids` (replica i holds replica_state(i)) under `root`; its folder."""
    tmp = ckpt.new_temp_dir(root, round_index, owner=owner)
    files = {rid: ckpt.save_replica_state(tmp, rid, replica_state(i)) for i, rid in enumerate(rids)}
    manifest = {"round": round_index, "step": round_index * 20, "files": files}
    if fingerprint is not None:
        manifest["fingerprint"] = fingerprint
    return Path(ckpt.finalize(tmp, manifest, {rid: round_index for rid in rids}))
