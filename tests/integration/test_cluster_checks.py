"""What only the Ray cluster knows is checked right after connecting and before any replica
starts (issue 19 Build 4, issue 20 Builds 5/6): a data.path missing where the replicas run, nccl
with fewer GPUs than replicas, and `auto` on a cluster with too few GPUs (gloo, one notice).

One subprocess with its own Ray, started the way `ray job submit --working-dir` runs a job: the
workers' working directory is an uploaded copy that lacks the driver's data folder. GPUs are Ray
resources only (this machine has no CUDA), which is all the driver's decision may look at."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.runs import FAST, REPO

SCRIPT = r"""
import json, os, sys
import ray
ray.init(address="local", num_cpus=8, num_gpus=GPUS, include_dashboard=False, log_to_driver=False,
         runtime_env={"working_dir": "wd", "env_vars": {"PYTHONPATH": REPO}})
from actors.launch import compose_config, run_training
from hsgd.config import ConfigError, validate
out = {}
def attempt(name, overrides):
    cfg = compose_config(FAST + overrides)
    validate(cfg)  # passes on the driver: the data folder is in its working directory
    run_dir = os.path.abspath(name)
    try:
        s = run_training(cfg, run_dir)
        out[name] = {"status": s["status"]}
    except ConfigError as err:
        out[name] = {"error": str(err), "field": err.field}
    out[name]["stacks"] = os.path.exists(os.path.join(run_dir, "stacks"))  # made by every replica at start
for name, overrides in CASES:
    attempt(name, overrides)
print("RESULT " + json.dumps(out))
"""


def _run(tmp_path, gpus, cases):
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "README").write_text("the job's uploaded working dir, without data/\n")
    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "hsgd" / "corpus" / "shakespeare.txt.xz", tmp_path / "data" / "corpus.txt.xz")
    script = (
        SCRIPT.replace("GPUS", str(gpus))
        .replace("REPO", repr(str(REPO)))
        .replace("FAST + overrides", f"{FAST!r} + overrides")
        .replace("CASES", repr(cases))
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, (out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT ") :]), out.stdout


@pytest.mark.long  # its own Ray cluster with a working_dir upload and three driver runs
def test_cluster_only_checks_refuse_before_any_replica_starts(tmp_path):
    results, stdout = _run(
        tmp_path,
        2,
        [
            ("missing_data", ["data.path=data/corpus.txt.xz", "train.rounds=1"]),
            ("nccl_too_few_gpus", ["comm.backend=nccl", "train.rounds=1"]),
            ("auto_one_run", ["train.rounds=1", "sync.outer_every=2", "checkpoint.every=0"]),
        ],
    )
    missing = results["missing_data"]
    assert missing["field"] == "data.path" and "'data/corpus.txt.xz' does not exist on node" in missing["error"]
    assert "1 of 1 nodes" in missing["error"] and "\n" not in missing["error"]
    assert not missing["stacks"], "no replica may start"
    nccl = results["nccl_too_few_gpus"]
    assert nccl["field"] == "comm.backend" and "4 replicas (2 clusters x 2) need 4 GPUs" in nccl["error"]
    assert "the Ray cluster has 2 GPUs" in nccl["error"] and "comm.backend=gloo" in nccl["error"]
    assert not nccl["stacks"], "refused before any replica starts: never a 'Duplicate GPU' crash"
    # the default job on a cluster with too few GPUs (a workstation): gloo on CPU with one notice
    assert results["auto_one_run"]["status"] == "completed", results
    assert "[hsgd] comm.backend=auto: gloo on CPU, not nccl: 4 replicas" in stdout
