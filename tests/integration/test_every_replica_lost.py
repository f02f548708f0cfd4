"""Every replica lost at once (issue 9, cases b and c): with a checkpoint the supervisor restores from
the latest one, as a resume of that checkpoint by hand would; without one the run fails cleanly,
recording nothing it did not commit. Rounds of 1 s (20 steps x 0.05 s) on 3 clusters of 2 replicas:
`long`, not `realistic` (tests/integration/test_realistic.py holds the runs with rounds of 30 s)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, train

pytestmark = pytest.mark.long

EVERYONE = {f"c{c}r{i}" for c in range(3) for i in range(2)}
LOSE_EVERYONE = [
    "topology.clusters=3",
    "topology.replicas_per_cluster=2",
    "sync.outer_every=20",
    "train.min_step_s=0.05",
    "train.rounds=4",
    "train.eval_batches=1",
]
KILL_EVERY_CLUSTER = (
    "faults.schedule=["
    + ",".join(f"{{kind:kill,target:cluster:c{c},round:2,phase:inner,step:3}}" for c in range(3))
    + "]"
)


def _files(d: Path) -> dict[str, tuple[float, str]]:
    import hashlib

    return {f.name: (f.stat().st_mtime, hashlib.sha256(f.read_bytes()).hexdigest()) for f in sorted(d.iterdir())}


def test_every_replica_lost_restores_from_checkpoint(tmp_path):
    import torch

    from hsgd.train.trainer import param_digest

    run_dir = tmp_path / "run"
    s = train(run_dir, LOSE_EVERYONE + ["checkpoint.every=1", "checkpoint.keep=10", KILL_EVERY_CLUSTER])
    check_run(run_dir, rounds=4, steps_per_round=20, victims=EVERYONE)
    evs = events(run_dir)
    restores = [e for e in evs if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["round"] == 2 and restores[0]["path"].endswith("round_000002"), (
        f"one restore from the latest checkpoint, round_000002: {restores}"
    )
    restore = restores[0]
    # every round after the checkpoint was recorded once, after the restore: none faked before it
    late = {m["round"]: m["t"] for m in metrics(run_dir) if m["round"] >= 2}
    assert all(t > restore["t"] for t in late.values()), f"rounds recorded before the restore: {late}"
    # the restored checkpoint and its predecessor were written before the loss and never again
    ckpts = run_dir / "checkpoints"
    for name in ("round_000001", "round_000002"):
        manifest = json.loads((ckpts / name / "manifest.json").read_text())
        assert manifest["t"] < restore["t"], f"{name}'s manifest was rewritten after the restore"
        for fname, (mtime, sha) in _files(ckpts / name).items():
            assert mtime < restore["t"], f"{name}/{fname} was rewritten after the restore"
            if fname.endswith(".pt"):
                assert sha == manifest["files"][fname[:-3]], f"{name}/{fname} does not match its manifest"
    # round_000002 holds what round 1 committed (not fresh weights): its params hash to round 1's digest
    # (c0r0's own digest: under streaming the clusters' working params differ by design)
    committed_1 = next(m for m in metrics(run_dir) if m["round"] == 1)["replica_digests"]["c0r0"]
    state = torch.load(ckpts / "round_000002" / "c0r0.pt", weights_only=True)
    assert state["round"] == 2 and param_digest(state["params"]) == committed_1, (
        "round_000002 does not hold the parameters committed in round 1"
    )
    # the same as resuming that checkpoint by hand
    by_hand = tmp_path / "by_hand"
    shutil.copytree(ckpts / "round_000002", by_hand / "checkpoints" / "round_000002")
    resumed = train(by_hand, LOSE_EVERYONE + ["checkpoint.every=1", "checkpoint.keep=10", "train.resume=true"])
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 4, resumed.get("reason")
    assert resumed["global_param_digest"] == s["global_param_digest"], (
        "restore after a total loss must equal resuming the same checkpoint by hand with train.resume=true"
    )


def test_every_replica_lost_without_checkpoint_fails_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, LOSE_EVERYONE + ["checkpoint.every=0", KILL_EVERY_CLUSTER])
    check_run(run_dir, rounds=2, steps_per_round=20, victims=EVERYONE, expect_status="failed")
    assert "no durable checkpoint" in s["reason"] and "total loss" in s["reason"], s["reason"]
    evs = events(run_dir)
    assert [e["reason"] for e in evs if e["event"] == "run_failed"] == [s["reason"]]
    assert [m["round"] for m in metrics(run_dir)] == [0, 1], "nothing may be recorded as committed that was not"
    assert [e["round"] for e in evs if e["event"] == "commit"] == [0, 1], "no commit after the total loss"
    ckpts = run_dir / "checkpoints"
    assert not ckpts.exists() or not list(ckpts.iterdir()), f"checkpoints written: {list(ckpts.iterdir())}"
