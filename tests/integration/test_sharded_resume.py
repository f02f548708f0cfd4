"""A resume may change the ranks per replica (issue 34, Acceptance 3), through jobs.train (embedded local
Ray, CPU, gloo, each rank its own process): a 2 x 2 run of k=2 writes sharded (DCP) checkpoints every 2
rounds for 4 rounds (each replica's `<rid>/` folder written by its 2 ranks); its round-4 `.metadata` is
altered on disk, so the resume with k=1 refuses that checkpoint before DCP reads it (naming the file)
and falls back to round 2; it trains to round 6 and ends within 1e-4 relative eval loss of the
uninterrupted 6-round k=1 run at the same seed. The other way round: a k=1 run's file checkpoint
resumed with k=2 (each rank cuts its shards out of the whole tensors), its later checkpoints written
as DCP, ending within 1e-4 too. And a total loss of a k=2 run (every replica killed mid-round) restores
from its sharded checkpoint and ends within 1e-4 of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsgd.train import checkpoint
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events

# a minute and more of runs (four jobs.train runs, 8 rank processes each): with the long runs, out of the
# default suite's 20-minute budget
pytestmark = pytest.mark.long

# 2 clusters x 2 replicas, rounds of 10 inner steps; a schedule that does not depend on train.rounds
# (constant lr, no warmup, the outer step given), so a 4-round run resumed to 6 is the 6-round run
TWO_BY_TWO = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=2",
    "sync.outer_every=10",
    "seed=7",
    "optim.inner.schedule=constant",
    "optim.inner.warmup_steps=0",
    "optim.outer.lr=1.0",
    "optim.outer.momentum=0.3",
]


def _train(run_dir: Path, overrides: list[str]) -> dict:
    """jobs.train in this process (test_gpus_per_replica.py's way: no outer variants, refused with k > 1)."""
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    cfg = compose_config(FAST + TWO_BY_TWO + overrides)
    validate(cfg)
    return run_training(cfg, str(run_dir))


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("whole")
    return _train(run_dir, ["train.rounds=6", "checkpoint.every=0", "topology.gpus_per_replica=1"])


def _checkpoints(run_dir: Path) -> dict[str, dict]:
    return {Path(d).name: checkpoint.read_manifest(d) for d in checkpoint.finalized(str(run_dir / "checkpoints"))}


@pytest.mark.timeout(900)
def test_a_two_rank_checkpoint_resumes_with_one_rank_and_an_altered_metadata_is_refused(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    first = _train(run_dir, ["train.rounds=4", "checkpoint.every=2", "topology.gpus_per_replica=2"])
    assert first["status"] == "completed" and first["rounds_committed"] == 4, first
    written = _checkpoints(run_dir)
    assert sorted(written) == ["round_000002", "round_000004"], written
    for name, manifest in written.items():  # one DCP folder per replica, each written by its 2 ranks
        assert (manifest["format"], manifest["ranks"]) == ("dcp", 2) and sorted(manifest["files"]) == [
            "c0r0",
            "c0r1",
            "c1r0",
            "c1r1",
        ], (name, manifest)
        for rid in manifest["files"]:
            replica = checkpoint.verify_sharded_replica(
                str(run_dir / "checkpoints" / name), rid, manifest["files"][rid]
            )
            assert replica["ranks"] == 2 and "__1_0.distcp" in replica["files"], (name, rid, replica)

    metadata = run_dir / "checkpoints" / "round_000004" / "c0r1" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0x01
    metadata.write_bytes(bytes(data))

    resumed = _train(
        run_dir, ["train.rounds=6", "checkpoint.every=2", "topology.gpus_per_replica=1", "train.resume=true"]
    )
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 6, resumed
    fallbacks = [e for e in events(run_dir) if e["event"] == "checkpoint_fallback"]
    assert fallbacks and fallbacks[0]["path"].endswith("round_000004"), fallbacks
    assert "c0r1 refused before loading: .metadata is altered" in fallbacks[0]["reason"], fallbacks[0]
    data[len(data) // 2] ^= 0x01  # put back: the shared checker finds every checkpoint as it was written
    metadata.write_bytes(bytes(data))
    check_run(run_dir, rounds=6, steps_per_round=10, victims=set())
    assert _relative(resumed["final_eval_loss"], uninterrupted["final_eval_loss"]) <= 1e-4, (
        resumed["final_eval_loss"],
        uninterrupted["final_eval_loss"],
    )
    # k=1 writes the file format from then on (round 4 exists already: never overwritten)
    assert checkpoint.format_of(_checkpoints(run_dir)["round_000006"]) == checkpoint.FILE_FORMAT


@pytest.mark.timeout(900)
def test_a_one_rank_checkpoint_resumes_with_two_ranks(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    first = _train(run_dir, ["train.rounds=4", "checkpoint.every=2", "topology.gpus_per_replica=1"])
    assert first["status"] == "completed" and checkpoint.format_of(_checkpoints(run_dir)["round_000004"]) == "file"
    resumed = _train(
        run_dir, ["train.rounds=6", "checkpoint.every=2", "topology.gpus_per_replica=2", "train.resume=true"]
    )
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 6, resumed
    assert not [e for e in events(run_dir) if e["event"] == "checkpoint_fallback"]
    check_run(run_dir, rounds=6, steps_per_round=10, victims=set())
    assert _relative(resumed["final_eval_loss"], uninterrupted["final_eval_loss"]) <= 1e-4, (
        resumed["final_eval_loss"],
        uninterrupted["final_eval_loss"],
    )
    last = _checkpoints(run_dir)["round_000006"]  # written by the k=2 replicas: one DCP folder each
    assert (last["format"], last["ranks"]) == ("dcp", 2), last
    checkpoint.verify(str(run_dir / "checkpoints" / "round_000006"))


@pytest.mark.timeout(900)
def test_every_replica_of_two_ranks_lost_restores_from_their_sharded_checkpoint(tmp_path, uninterrupted):
    # a total loss: every replica killed mid-inner of round 2; all come back (2 ranks each) and load round 2's
    kill_all = (
        "faults.schedule=["
        + ",".join(f"{{kind:kill,target:cluster:c{c},round:2,phase:inner,step:3}}" for c in range(2))
        + "]"
    )
    run_dir = tmp_path / "run"
    summary = _train(
        run_dir, ["train.rounds=6", "checkpoint.every=1", "checkpoint.keep=10", "topology.gpus_per_replica=2", kill_all]
    )
    assert summary["status"] == "completed" and summary["rounds_committed"] == 6, summary
    restores = [e for e in events(run_dir) if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["path"].endswith("round_000002"), restores
    assert checkpoint.format_of(_checkpoints(run_dir)["round_000002"]) == checkpoint.DCP_FORMAT
    check_run(run_dir, rounds=6, steps_per_round=10, victims={"c0r0", "c0r1", "c1r0", "c1r1"})
    assert _relative(summary["final_eval_loss"], uninterrupted["final_eval_loss"]) <= 1e-4, (
        summary["final_eval_loss"],
        uninterrupted["final_eval_loss"],
    )
