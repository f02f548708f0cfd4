"""An embedded run that cannot fit is one config error, before Ray or any actor starts."""
import os
import subprocess
import sys
from pathlib import Path

from hsgd.config.capacity import GiB, embedded_capacity_problem

REPO = Path(__file__).resolve().parents[2]


def _problem(**kw):
    args = dict(replicas=4, cpus_per_replica=1.0, cores=2, memory_bytes=24 * GiB, per_replica_bytes=400 * 2**20,
                num_cpus=None)
    return embedded_capacity_problem(**{**args, **kw})


def test_the_default_and_small_test_topologies_fit_on_two_cores():
    assert _problem() is None
    assert _problem(replicas=8) is None  # 3 x 2 plus spares: replicas mostly wait on each other


def test_thousands_of_replicas_are_refused_with_a_hint():
    text = _problem(replicas=4096)
    assert text and "4096 replicas need" in text and "GiB" in text and "ray.address" in text


def test_too_many_replicas_per_core_are_refused_even_when_memory_fits():
    text = _problem(replicas=40, per_replica_bytes=2**20)
    assert text and "per core" in text and "ray.num_cpus" in text


def test_an_explicit_ray_num_cpus_is_honoured_exactly():
    assert _problem(replicas=40, per_replica_bytes=2**20, num_cpus=40) is None
    assert "ray.num_cpus=3" in _problem(replicas=4, num_cpus=3)


def test_cli_refuses_a_64x64_topology_in_one_line_with_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "jobs.train", "topology.clusters=64", "topology.replicas_per_cluster=64",
                          f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("hsgd: config error: topology: 4096 replicas need"), out.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before the error"
