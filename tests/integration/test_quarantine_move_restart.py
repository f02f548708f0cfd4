"""Issue 45 finding 4 on three Ray nodes (ray.cluster_utils: one Ray cluster of three raylets on this
machine): a replica SIGKILLed three times from outside is quarantined onto the other node of its
site's label (not the roomier node of another label), and its new actor, detached, outlives a
supervisor SIGKILLed after the move: the restarted supervisor finds it by name and it trains to the
end in the same process; the run's end stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsgd.config.capacity import LABEL_KEY
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, REPO, events, summary

SPR = 10
ROUNDS = 40


def _wait_for(run_dir: Path, predicate, what: str, timeout_s: float = 300.0) -> dict:
    """The newest event of run_dir's record that satisfies predicate (polled)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            found = [e for e in events(run_dir) if predicate(e)]
        except (OSError, json.JSONDecodeError):
            found = []
        if found:
            return found[-1]
        time.sleep(0.5)
    raise AssertionError(f"never saw {what} in {run_dir}/events.jsonl")


@pytest.fixture
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the suite's shared embedded Ray (conftest brings it back for the next test)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "labels": {LABEL_KEY: "a"}})
    second = cluster.add_node(num_cpus=3, labels={LABEL_KEY: "a"})
    roomy = cluster.add_node(num_cpus=8, labels={LABEL_KEY: "b"})
    cluster.wait_for_nodes()
    try:
        yield cluster, {cluster.head_node.node_id, second.node_id}, roomy.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.long
@pytest.mark.paced  # steps padded to 0.3 s: beside the busy long runs (tests/run_all.sh)
def test_a_moved_replica_is_on_its_label_and_outlives_a_supervisor_restart(three_nodes, tmp_path):
    cluster, a_nodes, b_node = three_nodes
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "topology.sites=[{replicas:2,label:a},{replicas:1,label:b}]",
        f"train.rounds={ROUNDS}",
        f"sync.outer_every={SPR}",
        "train.min_step_s=0.3",
        "checkpoint.every=0",
        "supervisor.rejoin=fast",
        "faults.quarantine_after=3",
        f"run.dir={run_dir}",
    ]
    env = dict(os.environ)  # (the suite's Ray turned token auth on: RAY_AUTH_MODE; the cluster inherited it)
    log = tmp_path / "driver.log"
    driver = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", *args],
        cwd=tmp_path,
        text=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**env, "PYTHONPATH": str(REPO), "RAY_ADDRESS": cluster.address, "WANDB_MODE": "disabled"},
    )
    try:
        killed: list[int] = []
        for n in range(3):  # the OS, not the injector: a flaky node
            up = _wait_for(run_dir, lambda e: e["event"] == "replica_up" and e["rid"] == "c0r1", f"c0r1 up #{n + 1}")
            while up["pid"] in killed:
                time.sleep(0.5)
                up = _wait_for(run_dir, lambda e: e["event"] == "replica_up" and e["rid"] == "c0r1", "c0r1 back")
            time.sleep(2.0)  # let it get to work
            os.kill(up["pid"], signal.SIGKILL)
            killed.append(up["pid"])
        moved = _wait_for(run_dir, lambda e: e["event"] == "replica_quarantined", "c0r1 quarantined")
        moved_up = _wait_for(
            run_dir,
            lambda e: e["event"] == "replica_up" and e["rid"] == "c0r1" and e["t"] > moved["t"],
            "the moved c0r1 up",
        )
        time.sleep(2.0)
        first = _wait_for(run_dir, lambda e: e["event"] == "supervisor_start", "the supervisor")
        os.kill(first["pid"], signal.SIGKILL)
        _wait_for(run_dir, lambda e: e["event"] == "supervisor_start" and e["starts"] == 2, "a restarted supervisor")
        driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
        print(log.read_text()[-3000:])  # shown when the test fails
    assert driver.returncode == 0
    s = summary(run_dir)
    assert s["status"] == "completed" and s["replicas_quarantined"] == 1, s
    assert moved["rid"] == "c0r1" and moved["node"] in a_nodes, moved
    assert moved["moved_to"] in a_nodes - {moved["node"]}, f"moved off site a's label (b: {b_node[:8]}): {moved}"
    evs = events(run_dir)
    restart = next(e for e in evs if e["event"] == "supervisor_start" and e["starts"] == 2)
    after = [e for e in evs if e["t"] > restart["t"]]
    assert any(e["event"] == "commit" and "c0r1" in e["replicas"] for e in after), "c0r1 trains after the restart"
    ups = {e["pid"] for e in evs if e["event"] == "replica_up" and e["rid"] == "c0r1" and e["t"] > moved["t"]}
    assert ups == {moved_up["pid"]}, f"the moved actor was lost with the supervisor and re-created: {ups}"
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR, victims={"c0r1"})
    import ray

    ray.init(address=cluster.address)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    with pytest.raises(ValueError):  # stopped at the run's end: no actor of that name is alive
        ray.get_actor(f"hsgd:{run_id}:c0r1-q1")
