"""actors.checkpointing.restore: verifies before it touches any replica, falls back past a corrupt
latest checkpoint, and cannot loop until restarts run out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from actors import checkpointing
from actors.checkpointing import RestoreFailed
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from hsgd.train import checkpoint as ckpt
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster

RIDS = ("c0r0", "c1r0")  # Topology(2, 1)'s


def _write(root, r, fingerprint=None):
    tmp = ckpt.new_temp_dir(root, r, owner="run-a")
    files = {
        rid: ckpt.save_replica_state(
            tmp, rid, {"rid": rid, "round": r, "step": r * 3, "params": [torch.full((2,), float(r))]}
        )
        for rid in RIDS
    }
    return ckpt.finalize(
        tmp, {"round": r, "step": r * 3, "files": files, "fingerprint": fingerprint}, {rid: r for rid in RIDS}
    )


class _Handle:
    def __init__(self, rid, calls, fail):
        self.rid, self.calls, self.fail = rid, calls, fail
        self.load_checkpoint = SimpleNamespace(remote=self._load)

    def _load(self, path, sha, fmt=ckpt.FILE_FORMAT):
        assert fmt == ckpt.FILE_FORMAT, f"{self.rid}: a file checkpoint loaded as {fmt}"
        self.calls.append(("load", self.rid, path))
        if self.fail:
            raise RuntimeError(f"{self.rid} cannot read {path}")
        state = ckpt.load_replica_state(path, self.rid, sha)
        return {"round": state["round"], "step": state["step"]}


def _sup(tmp_path, calls, fail=(), fingerprint=None):
    cfg = OmegaConf.create(
        {
            "checkpoint": {"dir": str(tmp_path / "ckpts"), "every": 1},
            "supervisor": {"rejoin_wait_s": 0.0, "phase_timeout_s": 30.0},
        }
    )
    return SimpleNamespace(
        cfg=cfg,
        run_dir=str(tmp_path),
        state=RunState(committed_round=0, fingerprint=fingerprint),
        roster=FakeRoster(Topology(2, 1), handles={rid: _Handle(rid, calls, rid in fail) for rid in RIDS}, calls=calls),
        log=EventLog(calls=calls),
        warn=lambda m: None,
        save_state=lambda: None,
        layout=SimpleNamespace(ranks_per_replica=1),  # the run's (hsgd.config.layout.RunLayout): what these read
    )


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(checkpointing.ray, "get", lambda value, timeout=None: value)


def test_a_corrupt_latest_checkpoint_is_skipped_before_any_replica_is_touched(tmp_path):
    calls = []
    older = _write(tmp_path / "ckpts", 2)
    newest = _write(tmp_path / "ckpts", 4)
    with open(f"{newest}/c0r0.pt", "r+b") as f:
        f.truncate(50)
    sup = _sup(tmp_path, calls)
    assert checkpointing.restore(sup, "total loss") == 2
    names = [c[1] if c[0] == "event" else c[0] for c in calls]
    assert names[0] == "checkpoint_fallback" and calls[0][2]["path"] == newest, calls
    assert names.index("checkpoint_fallback") < names.index("rejoin") < names.index("load"), (
        f"restore touched a replica before it verified the checkpoint: {names}"
    )
    assert [c[2] for c in calls if c[0] == "load"] == [older, older]
    assert sup.roster.live == {"c0r0": (2, 6), "c1r0": (2, 6)}
    assert names[-1] == "restore"


def test_a_checkpoint_of_another_config_is_skipped(tmp_path):
    calls = []
    mine = {"model.n_embd": 32}
    older = _write(tmp_path / "ckpts", 1, fingerprint=mine)
    _write(tmp_path / "ckpts", 2, fingerprint={"model.n_embd": 64})
    assert checkpointing.restore(_sup(tmp_path, calls, fingerprint=mine), "total loss") == 1
    fallback = [c[2] for c in calls if c[0] == "event" and c[1] == "checkpoint_fallback"]
    assert len(fallback) == 1 and "model.n_embd 64 -> 32" in fallback[0]["reason"], fallback
    assert {c[2] for c in calls if c[0] == "load"} == {older}


def test_no_usable_checkpoint_fails_without_touching_anyone(tmp_path):
    calls = []
    only = _write(tmp_path / "ckpts", 1)
    with open(f"{only}/c1r0.pt", "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(RestoreFailed, match="no durable checkpoint to restore .* 1 failed verification"):
        checkpointing.restore(_sup(tmp_path, calls), "total loss")
    assert not [c for c in calls if c[0] in ("rejoin", "load", "down")], calls


def test_nobody_able_to_load_fails_the_restore_instead_of_looping(tmp_path):
    calls = []
    _write(tmp_path / "ckpts", 1)
    with pytest.raises(RestoreFailed, match="no replica could load"):
        checkpointing.restore(_sup(tmp_path, calls, fail=RIDS), "total loss")


def test_restoring_the_same_checkpoint_again_and_again_without_progress_gives_up(tmp_path):
    _write(tmp_path / "ckpts", 3)
    sup = _sup(tmp_path, [])
    for _ in range(checkpointing.RESTORES_WITHOUT_PROGRESS):
        assert checkpointing.restore(sup, "total loss") == 3
        sup.state.committed_round = 3  # what the supervisor records after a restore
        sup.roster.live = {rid: (0, 0) for rid in RIDS}  # lost again before committing anything
    with pytest.raises(RestoreFailed, match="without committing a round since"):
        checkpointing.restore(sup, "total loss")
    # a round committed since the last restore starts the count afresh
    sup.state.committed_round, sup.state.last_restore = 4, {"round": 3, "count": 3}
    assert checkpointing.restore(sup, "total loss") == 3
