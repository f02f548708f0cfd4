"""Finalized checkpoints of chosen replicas, and replicas that load them, for the tests of what a
restore or a resume chooses and loads (actors/checkpointing.py, actors/startup.py) without Ray. The
roster a restore asks: tests/fakes/roster.py's FakeRoster, given these replicas as its `handles`."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hsgd.train import checkpoint as ckpt
from hsgd.train.trainer import param_digest


def params_of(round_index: int) -> list[torch.Tensor]:
    """The params a replica holds at `round_index`: distinct per round, so digests tell rounds apart."""
    return [torch.full((3,), float(round_index)), torch.arange(4, dtype=torch.float32) * (round_index + 1)]


def write_checkpoint(root, round_index: int, rids, *, owner: str = "run-a", fingerprint=None) -> str:
    """round_<round_index> holding a file of each of `rids` only (as when the others were down at the
    save), its manifest recording each one's params digest as the supervisor's save does."""
    tmp = ckpt.new_temp_dir(root, round_index, owner=owner)
    state = {"round": round_index, "step": round_index * 3, "params": params_of(round_index)}
    files = {rid: ckpt.save_replica_state(tmp, rid, {"rid": rid, **state}) for rid in rids}
    manifest = {
        "round": round_index,
        "step": round_index * 3,
        "files": files,
        "fingerprint": fingerprint,
        ckpt.PARAM_DIGESTS: {rid: param_digest(state["params"]) for rid in rids},
    }
    return ckpt.finalize(tmp, manifest, {rid: round_index for rid in rids})


class LoadingReplica:
    """A replica's `load_checkpoint` and `digests` calls (their `.remote` answers at once): it loads
    its own file; `fails` (paths) raise as an unreadable file does; `ignores` (paths) answer as if
    loaded but keep the params it had (a load that silently did nothing)."""

    def __init__(self, rid: str, calls: list, *, fails=(), ignores=()):
        self.rid, self.calls, self.fails, self.ignores = rid, calls, set(fails), set(ignores)
        self.params = params_of(0)  # a fresh model
        self.round = self.step = 0
        self.load_checkpoint = SimpleNamespace(remote=self._load)
        self.digests = SimpleNamespace(remote=self._digests)

    def _load(self, path, sha, faults=None, fmt=ckpt.FILE_FORMAT):
        self.calls.append(("load", self.rid, path))
        if path in self.fails:
            raise ckpt.CheckpointError(f"replica {self.rid} cannot load {path}: unreadable")
        state = ckpt.load_replica_state(path, self.rid, sha)
        if path not in self.ignores:
            self.params = [t.clone() for t in state["params"]]
        self.round, self.step = state["round"], state["step"]
        return {"rid": self.rid, "outcome": "done", "round": self.round, "step": self.step}

    def _digests(self):
        return {"param": param_digest(self.params), "global": "", "round": self.round, "step": self.step}
