"""hsgd on a real Ray cluster: `ray job submit`, node labels and placement groups, Hydra multirun.

The module starts its own two-node Ray cluster on this machine with `ray start` (its own temp dir
under /tmp, its own ports, token authentication on with a token of its own): a head with 6 CPUs
and the label hsgd-cluster=a, and a second node with 4 CPUs and hsgd-cluster=b. Every process of
that cluster carries HSGD_TEST_CLUSTER=<this module's tag> in its environment; teardown ends
exactly those processes (`ray stop` would end every Ray on the machine). The multirun tests come
first and use the embedded Ray of `python -m jobs.train`, one per job.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import FAST, REPO, summary, train_cli

SHORT = [*FAST, "train.rounds=2", "sync.outer_every=4"]
RAY = str(Path(sys.executable).parent / "ray")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# -- Hydra multirun (embedded Ray, before the module's cluster starts) --------------------------
def test_relative_run_dirs_resolve_against_the_persistent_root(monkeypatch, tmp_path):
    from hsgd.config import output_path

    for var in ("HSGD_OUTPUT_ROOT", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(var, raising=False)
    assert output_path("outputs/x") == "outputs/x"  # a laptop run: relative to the launch dir
    assert output_path("/abs/x") == "/abs/x"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray sets in a job's entrypoint
    assert output_path("outputs/x") == os.path.expanduser("~/hsgd/outputs/x")
    assert output_path("/abs/x") == "/abs/x"
    monkeypatch.setenv("HSGD_OUTPUT_ROOT", str(tmp_path))
    assert output_path("outputs/x") == str(tmp_path / "outputs" / "x")


@pytest.mark.long
def test_multirun_runs_each_job_and_writes_the_sweep_table(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_cli(
        ["-m", "sync.outer_every=4,6", *FAST, "train.rounds=2", "checkpoint.every=0", f"run.sweep_dir={sweep}"],
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one after the other, each with its own embedded Ray (shut down before the next starts)
    assert (proc.stdout + proc.stderr).count("Started a local Ray instance") == 2, proc.stderr[-3000:]
    for job, outer_every in (("0", 4), ("1", 6)):
        s = summary(sweep / job)
        assert s["status"] == "completed" and s["inner_steps_committed"] == 2 * outer_every, s
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert [r["overrides"] for r in rows] == ["sync.outer_every=4", "sync.outer_every=6"], rows
    for row in rows:
        assert row["status"] == "completed" and float(row["final_eval_loss"]) > 0
        assert int(row["outer_bytes"]) > 0 and float(row["wall_s"]) > 0 and float(row["job_s"]) > 0
    table = (sweep / "sweep.md").read_text().splitlines()
    assert len(table) == 4 and "final_eval_loss" in table[0], table
    assert not (tmp_path / "outputs").exists()


def test_multirun_with_a_bad_value_stops_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_cli(["-m", "sync.inner=ddp,bogus", f"run.sweep_dir={sweep}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "hsgd: config error: sync.inner" in proc.stderr
    assert not sweep.exists()


# -- a real cluster: ray start, ray job submit, placement ----------------------------------------
class LocalRayCluster:
    """`ray start` nodes on this machine, torn down by the environment tag they all carry."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self.root = Path(tempfile.mkdtemp(prefix="hsgd-ray-", dir="/tmp"))  # short: Ray's socket paths
        self.token = token = self.root / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HSGD_"))}
        self.env = {
            **env,
            "HSGD_TEST_CLUSTER": self.tag,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "WANDB_MODE": "disabled",
            # the job's entrypoint `python` is this venv's
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        }
        self.gcs = self.dashboard = None
        self.nodes = 0

    def _start(self, args: list[str]) -> str:
        self.nodes += 1
        temp = self.root / f"n{self.nodes}"
        proc = subprocess.run(
            [
                RAY,
                "start",
                f"--temp-dir={temp}",
                "--min-worker-port=0",
                "--max-worker-port=0",
                "--object-store-memory=100000000",
                "--disable-usage-stats",
                *args,
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"ray start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    def start_head(self, num_cpus: int, label: str) -> None:
        gcs, dash, agent, agent_grpc, client, env_agent = _free_ports(6)
        out = self._start(
            [
                "--head",
                f"--port={gcs}",
                f"--dashboard-port={dash}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-agent-listen-port={agent}",
                f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--ray-client-server-port={client}",
                f"--runtime-env-agent-port={env_agent}",
                f"--num-cpus={num_cpus}",
                f"--labels=hsgd-cluster={label}",
            ]
        )
        # the address other nodes and drivers join with (`ray start` writes it into its temp dir)
        current = self.root / "n1" / "ray_current_cluster"
        found = re.search(r"--address='([^']+)'", out)
        self.gcs = current.read_text().strip() if current.is_file() else found.group(1) if found else f"127.0.0.1:{gcs}"
        self.dashboard = f"http://127.0.0.1:{dash}"

    def add_node(self, num_cpus: int, label: str) -> None:
        agent, agent_grpc, env_agent, metrics = _free_ports(4)
        self._start(
            [
                f"--address={self.gcs}",
                f"--dashboard-agent-listen-port={agent}",
                f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--runtime-env-agent-port={env_agent}",
                f"--metrics-export-port={metrics}",
                f"--num-cpus={num_cpus}",
                f"--labels=hsgd-cluster={label}",
            ]
        )

    def ray_cli(self, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RAY, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )

    def job_info(self, job_id: str, token: bool = True) -> dict:
        """GET /api/jobs/<id> from the job API, with the cluster's token (or without: refused)."""
        import urllib.request

        headers = {"Authorization": f"Bearer {self.token.read_text().strip()}"} if token else {}
        request = urllib.request.Request(f"{self.dashboard}/api/jobs/{job_id}", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def node_labels(self) -> dict:
        """node id -> its hsgd-cluster label, from Ray's state API (through the dashboard)."""
        proc = self.ray_cli(["list", "nodes", "--format=json", f"--address={self.dashboard}"], timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return {n["node_id"]: n.get("labels", {}).get("hsgd-cluster") for n in json.loads(proc.stdout)}

    def _pids(self) -> list[int]:
        marker = f"HSGD_TEST_CLUSTER={self.tag}\0".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if marker in Path(f"/proc/{entry}/environ").read_bytes():
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def stop(self) -> None:
        # the workers, agents and dashboard leave within ~0.7 s of SIGTERM; gcs_server, the autoscaler
        # monitor and the head's raylet were still there 15 s after it (measured): a longer wait only
        # delays their SIGKILL
        for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 3.0)):
            for pid in self._pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.time() + wait_s
            while self._pids() and time.time() < deadline:
                time.sleep(0.2)
        left = self._pids()
        shutil.rmtree(self.root, ignore_errors=True)
        assert not left, f"Ray processes of the test cluster survived teardown: {left}"


# Every test on the two-node cluster is `long`: the cluster's start (~15 s) and each job's own Ray
# driver make the five ~2.5 minutes on 2 cores, which the default suite's 20 cannot hold.
on_the_cluster = pytest.mark.long


@pytest.fixture(scope="module")
def cluster():
    c = LocalRayCluster()
    try:
        c.start_head(num_cpus=6, label="a")
        c.add_node(num_cpus=4, label="b")
        yield c
    finally:
        c.stop()


def _submit(cluster: LocalRayCluster, args: list[str], env_vars: dict | None = None) -> str:
    """`ray job submit --working-dir <repo> -- python -m jobs.train <args>`; returns the job's id."""
    job_id = f"hsgd-test-{uuid.uuid4().hex[:8]}"
    runtime_env = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
    proc = cluster.ray_cli(
        [
            "job",
            "submit",
            f"--address={cluster.dashboard}",
            f"--submission-id={job_id}",
            f"--working-dir={REPO}",
            *runtime_env,
            "--",
            "python",
            "-m",
            "jobs.train",
            *args,
        ]
    )
    assert proc.returncode == 0, f"job {job_id} did not succeed:\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}"
    info = cluster.job_info(job_id)
    assert info["status"] == "SUCCEEDED", info
    return job_id


@on_the_cluster
def test_submitted_job_writes_its_run_dir_and_token_auth_is_on(cluster, tmp_path):
    import urllib.error

    run_dir = tmp_path / "submitted"
    job_id = _submit(cluster, [*SHORT, f"run.dir={run_dir}"])
    with pytest.raises(urllib.error.HTTPError) as refused:  # token auth is on: no token, no answer
        cluster.job_info(job_id, token=False)
    assert refused.value.code in (401, 403)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["rounds_committed"] == 2, s
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()
    # the job ran from the uploaded copy, which .rayignore keeps free of outputs, caches and .git
    copies = [
        p for p in cluster.root.glob("n1/session_2*/runtime_resources/working_dir_files/_ray_pkg_*") if p.is_dir()
    ]
    assert copies, "no uploaded working dir found on the head"
    for copy in copies:
        assert (copy / "jobs" / "train.py").is_file()
        for ignored in (".git", "outputs", "multirun", "wandb", ".pytest_cache"):
            assert not (copy / ignored).exists(), f"{ignored} was uploaded with the working dir"
        assert not list(copy.rglob("__pycache__")), "__pycache__ was uploaded with the working dir"


@on_the_cluster
def test_submitted_job_with_a_fault_lands_under_the_output_root(cluster, tmp_path):
    """No run.dir given: the default `outputs/<timestamp>-<name>` resolves against the persistent
    root ($HSGD_OUTPUT_ROOT), not against the job's temporary working dir; a replica killed in
    round 1 is restarted and the run completes."""
    root = tmp_path / "persistent"
    _submit(
        cluster,
        [
            *FAST,
            "train.rounds=3",
            "sync.outer_every=4",
            "run.name=drill",
            "faults.schedule=[{kind:kill,target:c0r1,round:1,phase:inner,step:1}]",
        ],
        env_vars={"HSGD_OUTPUT_ROOT": str(root)},
    )
    runs = list((root / "outputs").glob("*-drill-*"))  # <timestamp>-<name>-<random suffix>
    assert len(runs) == 1, list(root.rglob("*"))
    s = summary(runs[0])
    assert s["status"] == "completed" and s["rounds_committed"] == 3, s
    fired = [json.loads(line) for line in (runs[0] / "faults_fired.jsonl").read_text().splitlines() if line.strip()]
    assert any(f.get("kind") == "kill" and f.get("rid") == "c0r1" for f in fired), fired
    check_run(runs[0], rounds=3, steps_per_round=4)


def _run_attached(cluster: LocalRayCluster, run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """jobs.train as a driver attached to the test cluster through RAY_ADDRESS."""
    env = {k: v for k, v in cluster.env.items() if k != "PATH"}
    return train_cli(
        [*SHORT, "checkpoint.every=0", f"run.dir={run_dir}", *overrides],
        cwd=run_dir.parent,
        env={**env, "RAY_ADDRESS": cluster.gcs},
        timeout=300,
    )


def _clusters_by_node(run_dir: Path) -> dict[str, set]:
    """cluster -> the node ids its replicas reported from inside the actors (run.json)."""
    nodes = json.loads((run_dir / "run.json").read_text())["replica_nodes"]
    assert all(nodes.values()), nodes
    out: dict[str, set] = {}
    for rid, node in nodes.items():
        out.setdefault(rid.split("r")[0], set()).add(node)
    return out


@on_the_cluster
def test_cluster_labels_put_each_cluster_on_its_labelled_node(cluster, tmp_path):
    run_dir = tmp_path / "labels"
    proc = _run_attached(cluster, run_dir, ["topology.cluster_labels=[b,a]"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed"
    by_cluster = _clusters_by_node(run_dir)
    assert all(len(nodes) == 1 for nodes in by_cluster.values()), by_cluster
    labels = cluster.node_labels()
    assert [labels[next(iter(by_cluster[c]))] for c in ("c0", "c1")] == ["b", "a"], (by_cluster, labels)


@on_the_cluster
def test_strict_pack_keeps_each_cluster_on_one_node(cluster, tmp_path):
    # 2 CPUs per replica: a cluster needs 4 CPUs on one node; the head (6) and the second node (4)
    # hold one cluster each, so STRICT_PACK must split the clusters and keep each one whole
    run_dir = tmp_path / "pack"
    proc = _run_attached(cluster, run_dir, ["topology.cpus_per_replica=2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_cluster = _clusters_by_node(run_dir)
    assert all(len(nodes) == 1 for nodes in by_cluster.values()), by_cluster
    assert by_cluster["c0"] != by_cluster["c1"], by_cluster


@on_the_cluster
@pytest.mark.parametrize(
    "overrides,field",
    [
        # 10 CPUs hold 4 x 2.5 in total, but only the head holds a whole cluster (2 x 2.5) on one node
        (["topology.cpus_per_replica=2.5"], "topology.placement_strategy"),
        (["topology.cluster_labels=[a,zzz]"], "topology.cluster_labels[1]"),
        # issue 32: node b (4 CPUs) cannot hold a 5-replica site labelled b
        (["topology.sites=[{replicas:2,label:a},{replicas:5,label:b}]"], "topology.sites[1].label"),
    ],
    ids=["strict-pack-never-fits", "unknown-label", "site-larger-than-its-label"],
)
def test_placement_that_can_never_fit_is_one_clear_line(cluster, tmp_path, overrides, field):
    run_dir = tmp_path / "never"
    proc = _run_attached(cluster, run_dir, overrides)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hsgd: config error:")]
    assert len(errors) == 1 and f"config error: {field}" in errors[0], proc.stderr[-3000:]
    assert not (run_dir / "events.jsonl").exists()


# -- quarantine (issue 32) -------------------------------------------------------------------------
def _alive_actor(cluster: LocalRayCluster, name: str) -> dict | None:
    """The ALIVE actor of that name (its pid, node_id), from Ray's state API."""
    proc = cluster.ray_cli(
        [
            "list",
            "actors",
            "--format=json",
            "--detail",
            f"--address={cluster.dashboard}",
            "--filter",
            f"name={name}",
            "--filter",
            "state=ALIVE",
        ],
        timeout=60,
    )
    rows = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip().startswith("[") else []
    return rows[0] if rows else None


@on_the_cluster
def test_a_replica_sigkilled_three_times_is_recreated_on_the_other_node(cluster, tmp_path):
    run_dir = tmp_path / "quarantine"
    env = {k: v for k, v in cluster.env.items() if k != "PATH"}
    args = [
        *FAST,
        "train.rounds=20",
        "sync.outer_every=10",
        "train.min_step_s=0.3",
        "checkpoint.every=0",
        "supervisor.rejoin=fast",
        "faults.quarantine_after=3",
        f"run.dir={run_dir}",
    ]
    driver = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", *args],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), **env, "RAY_ADDRESS": cluster.gcs},
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "run.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        name = f"hsgd:{json.loads((run_dir / 'run.json').read_text())['run_id']}:c0r1"
        killed: list[int] = []
        for n in range(3):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                actor = _alive_actor(cluster, name)
                if actor and actor.get("pid") and actor["pid"] not in killed:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"c0r1 never came back for SIGKILL #{n + 1}")
            time.sleep(2.0)  # let it get to work
            os.kill(actor["pid"], signal.SIGKILL)  # the OS, not the injector: a flaky node
            killed.append(actor["pid"])
        out, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-3000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["replicas_quarantined"] == 1, s
    started_on = json.loads((run_dir / "run.json").read_text())["replica_nodes"]["c0r1"]
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    moved = [e for e in evs if e["event"] == "replica_quarantined"]
    assert len(moved) == 1 and moved[0]["node"] == started_on, (moved, started_on)
    assert moved[0]["moved_to"] not in (None, started_on), f"re-created away from the node it died on: {moved}"
    back = [e for e in evs if e["event"] == "commit" and e["t"] > moved[0]["t"] and "c0r1" in e["replicas"]]
    assert back, "the re-created replica trains again"
    assert "quarantined after 3 deaths" in out, out[-2000:]
    check_run(run_dir, rounds=20, steps_per_round=10, victims={"c0r1"})
