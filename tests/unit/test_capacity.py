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
    assert lines == [lines[0]] and lines[0].startswith("hsgd: config error: topology.replicas_per_cluster: 4096 replicas need"), out.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before the error"


# -- a real Ray cluster: placement (actors/placement.py feeds ray.cluster_resources() and ray.nodes()) --
def _node(cpus, label=None):
    return {"Resources": {"CPU": float(cpus)}, "Labels": {"hsgd-cluster": label} if label else {}}


def _placement(**kw):
    from hsgd.config.capacity import placement_problem

    args = dict(clusters=2, replicas_per_cluster=2, spares_per_cluster=0, need={"CPU": 1.0},
                total={"CPU": 10.0}, nodes=[_node(6), _node(4)], strategy="STRICT_PACK", cluster_labels=[],
                label_key="hsgd-cluster")
    return placement_problem(**{**args, **kw})


def test_a_placement_that_fits_is_fine():
    assert _placement() is None
    assert _placement(need={"CPU": 2.0}) is None  # one cluster per node


def test_strict_pack_that_never_fits_names_the_strategy():
    # 10 CPUs hold 4 x 2.5 in total, but only the 6-CPU node holds a whole cluster on one node
    field, text = _placement(need={"CPU": 2.5})
    assert field == "topology.placement_strategy" and "STRICT_PACK" in text and "\n" not in text


def test_hot_spares_count_in_the_placement_check():
    """Each cluster's placement group holds its replicas AND its spares: a check without them passes
    and the run then waits supervisor.quorum_wait_s for a placement that can never happen."""
    field, text = _placement(need={"CPU": 2.0}, spares_per_cluster=1)
    assert field == "topology.replicas_per_cluster" and "6 replicas (hot spares included)" in text
    assert _placement(need={"CPU": 2.0}, spares_per_cluster=1, total={"CPU": 12.0}, nodes=[_node(6), _node(6)]) is None
    pack = dict(need={"CPU": 2.0}, total={"CPU": 12.0}, nodes=[_node(8), _node(4)])
    assert _placement(**pack) is None
    assert _placement(**pack, spares_per_cluster=1)[0] == "topology.placement_strategy"  # 3 x 2 CPUs on one node
    labelled = dict(need={"CPU": 2.0}, cluster_labels=["a", "b"], total={"CPU": 12.0},
                    nodes=[_node(4, "a"), _node(4, "b"), _node(4)])
    assert _placement(**labelled) is None
    assert _placement(**labelled, spares_per_cluster=1)[0] == "topology.cluster_labels[0]"


def test_a_missing_label_names_its_cluster():
    field, text = _placement(cluster_labels=["a", "zzz"], nodes=[_node(6, "a"), _node(4)])
    assert field == "topology.cluster_labels[1]" and "ray start --labels hsgd-cluster=zzz" in text


def test_a_container_memory_limit_below_the_machine_counts(tmp_path):
    from hsgd.config.capacity import usable_memory_bytes

    assert usable_memory_bytes(64 * GiB, tmp_path) == 64 * GiB  # no cgroup files: the machine's
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2, no limit
    assert usable_memory_bytes(64 * GiB, tmp_path) == 64 * GiB
    (tmp_path / "memory.max").write_text(f"{8 * GiB}\n")
    assert usable_memory_bytes(64 * GiB, tmp_path) == 8 * GiB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1, no limit
    assert usable_memory_bytes(64 * GiB, v1) == 64 * GiB
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    assert usable_memory_bytes(64 * GiB, v1) == 4 * GiB
