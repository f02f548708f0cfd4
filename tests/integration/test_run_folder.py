"""A run owns its folder, and checkpoints can be trusted (issue 19, Build 2 and 3): the lock, foreign
folders, checkpoint.dir URLs and the reachability check, the config fingerprint, fallback."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsgd.config import ConfigError
from hsgd.record.runlock import LOCK_NAME, read_lock
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, REPO, events, metrics, train, train_cli

TINY = ["sync.outer_every=3", "checkpoint.every=1", "checkpoint.keep=3"]


def _snapshot(folder: Path) -> dict[str, tuple[float, str]]:
    """Every file under folder: (mtime, sha256)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _one_line_config_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}, want 2\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, f"want one line, got:\n{proc.stderr[-3000:]}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.mark.long  # two runs, one after the other
def test_a_second_run_on_a_live_runs_folder_exits_2_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    # the live run goes on until both refused CLIs are done, then is stopped (Ctrl-C: status stopped); one
    # that ended by itself meanwhile would rewrite its own run.json
    args = [
        f"run.dir={run_dir}",
        *FAST,
        "sync.outer_every=3",
        "train.rounds=100000",
        "checkpoint.every=0",
        "train.min_step_s=0.05",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    first = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not any(e["event"] == "commit" for e in events(run_dir)):
            assert first.poll() is None, f"the first run ended early:\n{first.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the first run never committed a round"
            time.sleep(0.5)
        lock = read_lock(run_dir)
        assert lock and lock["pid"] == first.pid, f"the live run holds no lock of its own: {lock}"
        kept = {
            name: v
            for name, v in _snapshot(run_dir).items()
            if name in ("config.yaml", "run.json") or name.startswith(".hydra/")
        }
        assert ".hydra/overrides.yaml" in kept and "config.yaml" in kept, kept
        for extra in ([], ["train.resume=true"]):
            second = train_cli([*args, *extra], cwd=tmp_path, timeout=300)
            _one_line_config_error(second, "run.dir", "in use by run", lock["run_id"])
        now = _snapshot(run_dir)
        assert first.poll() is None, "the live run ended before the check"
        assert {name: now.get(name) for name in kept} == kept, "a refused run changed the live run's files"
        assert read_lock(run_dir)["run_id"] == lock["run_id"]
        first.send_signal(signal.SIGINT)  # Ctrl-C once: it stops after the round in flight
        out, _ = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
    assert [e["event"] for e in events(run_dir)].count("supervisor_start") == 1, "another supervisor ran here"
    assert not (run_dir / LOCK_NAME).exists(), "the lock must be removed at the run's end"


def test_a_foreign_folder_as_run_dir_exits_2_with_its_files_untouched(tmp_path):
    foreign = tmp_path / "theirs"
    (foreign / "data").mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine\n")
    (foreign / "data" / "x.bin").write_bytes(b"\x00\x01")
    before = _snapshot(foreign)
    entries = sorted(p.name for p in foreign.iterdir())
    proc = train_cli([f"run.dir={foreign}", *FAST, "train.rounds=1"], cwd=tmp_path, timeout=300)
    _one_line_config_error(proc, "run.dir", "not an hsgd run folder")
    assert _snapshot(foreign) == before and sorted(p.name for p in foreign.iterdir()) == entries, (
        "a refused run wrote into a foreign folder"
    )
    with pytest.raises(ConfigError, match="not an hsgd run folder"):  # the library call refuses as well
        train(foreign, ["train.rounds=1"])
    assert _snapshot(foreign) == before


def test_a_folder_holding_only_a_foreign_config_yaml_exits_2_with_the_file_untouched(tmp_path):
    """A common file name is not an hsgd run: only run.json with an hsgd run id, or hsgd.lock, is."""
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("model: theirs\nlr: 0.1\n")
    before = _snapshot(foreign)
    proc = train_cli([f"run.dir={foreign}", *FAST, "train.rounds=1"], cwd=tmp_path, timeout=300)
    _one_line_config_error(proc, "run.dir", "not an hsgd run folder", "config.yaml")
    assert _snapshot(foreign) == before and sorted(p.name for p in foreign.iterdir()) == ["config.yaml"], (
        "a refused run wrote into a foreign folder"
    )
    with pytest.raises(ConfigError, match="not an hsgd run folder"):  # the library call refuses as well
        train(foreign, ["train.rounds=1"])
    assert _snapshot(foreign) == before


@pytest.mark.long  # two runs, one after the other
def test_a_stale_lock_is_taken_over_by_resume_and_a_corrupt_latest_checkpoint_falls_back(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_dir, [*TINY, "train.rounds=3"])
    assert first["status"] == "completed"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["round_000001", "round_000002", "round_000003"], ckpts
    # the first run "died": its lock is still there, its process gone; and its latest checkpoint is truncated
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (run_dir / LOCK_NAME).write_text(
        json.dumps(
            {
                "run_id": "crashed-run",
                "host": socket.gethostname(),
                "pid": dead.pid,
                "started_at": time.time(),
                "refreshed_at": time.time(),
            }
        )
    )
    victim = run_dir / "checkpoints" / "round_000003" / "c1r0.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(ConfigError, match="stale lock of run crashed-run"):
        train(run_dir, [*TINY, "train.rounds=4"])  # without train.resume: refused
    resumed = train(run_dir, [*TINY, "train.rounds=4", "train.resume=true"])
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 4, resumed.get("reason")
    evs = events(run_dir)
    takeovers = [e for e in evs if e["event"] == "lock_taken_over"]
    assert len(takeovers) == 1 and takeovers[0]["previous_run_id"] == "crashed-run", takeovers
    fallbacks = [e for e in evs if e["event"] == "checkpoint_fallback"]
    assert (
        len(fallbacks) == 1 and fallbacks[0]["path"].endswith("round_000003") and "sha256" in fallbacks[0]["reason"]
    ), fallbacks
    # resumed from round_000002: round 2 was trained again (its commit after the fallback), each round recorded once
    after = [e["round"] for e in evs[evs.index(fallbacks[0]) :] if e["event"] == "commit"]
    assert after == [2, 3], f"want rounds 2 and 3 trained after resuming from round_000002: {after}"
    assert [m["round"] for m in metrics(run_dir)] == [0, 1, 2, 3]
    assert not (run_dir / LOCK_NAME).exists()
    check_run(run_dir, rounds=4, steps_per_round=3, damaged={"round_000003"})


def test_a_resume_with_another_model_shape_or_outer_every_exits_2_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, [*TINY, "train.rounds=1"])["status"] == "completed"
    before = _snapshot(run_dir)
    proc = train_cli(
        [f"run.dir={run_dir}", *FAST, *TINY, "train.rounds=2", "train.resume=true", "model.n_embd=64"],
        cwd=tmp_path,
        timeout=300,
    )
    line = _one_line_config_error(proc, "train.resume", "model.n_embd 32 -> 64")
    assert "sync.outer_every" not in line, line
    with pytest.raises(ConfigError, match=r"sync\.outer_every 3 -> 4") as err:
        train(run_dir, [*TINY, "train.rounds=2", "train.resume=true", "sync.outer_every=4"])
    assert "\n" not in str(err.value)
    now = _snapshot(run_dir)
    assert {k: v for k, v in now.items() if not k.startswith(".hydra/") and not k.endswith(".log")} == {
        k: v for k, v in before.items() if not k.startswith(".hydra/") and not k.endswith(".log")
    }, "a refused resume changed the run's files"


def test_a_run_checkpoints_to_and_resumes_from_a_file_url_with_another_topology(tmp_path):
    run_dir, shared = tmp_path / "run", tmp_path / "shared" / "ckpts"
    url = f"file://{shared}"
    first = train(run_dir, [*TINY, "train.rounds=2", f"checkpoint.dir={url}"])
    assert first["status"] == "completed"
    assert sorted(p.name for p in shared.iterdir()) == ["round_000001", "round_000002"], list(shared.iterdir())
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    manifest = json.loads((shared / "round_000002" / "manifest.json").read_text())
    assert manifest["fingerprint"]["model.n_embd"] == 32 and manifest["fingerprint"]["sync.outer_every"] == 3
    # a site lost between runs: one cluster of one replica fewer; the topology may change at resume
    resumed = train(
        run_dir,
        [*TINY, "train.rounds=3", f"checkpoint.dir={url}", "train.resume=true", "topology.replicas_per_cluster=1"],
    )
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 3, resumed.get("reason")
    assert set(resumed["replica_param_digests"]) == {"c0r0", "c1r0"}
    assert (shared / "round_000003" / "manifest.json").is_file()
    # a fresh run never writes into a checkpoint.dir that holds checkpoints
    with pytest.raises(ConfigError, match="checkpoint.dir: .* already holds checkpoints"):
        train(tmp_path / "other", [*TINY, "train.rounds=1", f"checkpoint.dir={url}"])


def test_a_checkpoint_dir_a_replica_cannot_reach_exits_2_naming_the_node(tmp_path):
    """memory:// lives in one process: the driver's nonce is there, no replica can read it."""
    with pytest.raises(ConfigError, match=r"checkpoint.dir: replica c\d+r\d+ on node .* cannot read") as err:
        train(tmp_path / "run", [*TINY, "train.rounds=1", "checkpoint.dir=memory://hsgd-unreachable/ckpts"])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / LOCK_NAME).exists(), "the lock must be removed when the run is refused"
