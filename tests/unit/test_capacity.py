"""An embedded run that cannot fit is one config error, before Ray or any actor starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsgd.config.capacity import GiB, embedded_capacity_problem
from tests.fakes.configs import default_cfg

REPO = Path(__file__).resolve().parents[2]


def _problem(**kw):
    args = dict(
        replicas=4, cpus_per_replica=1.0, cores=2, memory_bytes=24 * GiB, per_replica_bytes=400 * 2**20, num_cpus=None
    )
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
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            "topology.clusters=64",
            "topology.replicas_per_cluster=64",
            f"run.dir={tmp_path / 'run'}",
            "logging.wandb.mode=disabled",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(
        "hsgd: config error: topology.replicas_per_cluster: 4096 replicas need"
    ), out.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before the error"


# -- a real Ray cluster: placement (actors/placement.py feeds the live ray.nodes()) --
def _node(cpus, label=None):
    return {"Resources": {"CPU": float(cpus)}, "Labels": {"hsgd-cluster": label} if label else {}}


def _cfg(spares_per_cluster=0, cluster_labels=(), strategy="STRICT_PACK", **comm):
    return default_cfg(
        **{
            "topology.spares_per_cluster": spares_per_cluster,
            "topology.cluster_labels": list(cluster_labels),
            "topology.placement_strategy": strategy,
            **{f"comm.{key}": value for key, value in comm.items()},
        }
    )


def _placement(need=None, nodes=None, **kw):
    from hsgd.config.capacity import placement_problem

    return placement_problem(_cfg(**kw), need or {"CPU": 1.0}, nodes or [_node(6), _node(4)])


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
    assert _placement(need={"CPU": 2.0}, spares_per_cluster=1, nodes=[_node(6), _node(6)]) is None
    pack = dict(need={"CPU": 2.0}, nodes=[_node(8), _node(4)])
    assert _placement(**pack) is None
    assert _placement(**pack, spares_per_cluster=1)[0] == "topology.placement_strategy"  # 3 x 2 CPUs on one node
    labelled = dict(need={"CPU": 2.0}, cluster_labels=["a", "b"], nodes=[_node(4, "a"), _node(4, "b"), _node(4)])
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


# -- backends per level and GPUs per replica (hsgd.config.capacity.plan_backends) --------------------------
def _gpu_node(gpus, cpus=16):
    return {"Resources": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}, "Labels": {}}


def _plan(*nodes, backend="auto", inner=None, outer=None, **kw):
    from hsgd.config.capacity import plan_backends

    return plan_backends(_cfg(backend=backend, inner_backend=inner, outer_backend=outer, **kw), list(nodes))


def test_comm_backend_is_the_shorthand_and_per_level_keys_override_it():
    gpus = (_gpu_node(2), _gpu_node(2))  # every replica gets its own GPU: the plan keeps what was asked

    def asked(backend, inner, outer):
        plan = _plan(*gpus, backend=backend, inner=inner, outer=outer)
        return plan.inner, plan.outer

    assert asked("auto", None, None) == ("auto", "gloo")
    assert asked("nccl", None, None) == ("nccl", "nccl")
    assert asked("gloo", "nccl", None)[0] == "nccl"
    assert asked("nccl", None, "gloo")[1] == "gloo"
    assert asked("nccl", None, "auto")[1] == "gloo", "outer auto is gloo"


def test_auto_on_a_one_gpu_workstation_runs_the_default_job_with_gloo_and_a_notice():
    """The default 2 x 2 job on one GPU: today '4 replicas need 4 GPU but the Ray cluster has 1'."""
    plan = _plan(_gpu_node(1))
    assert (plan.inner, plan.outer, plan.gpus_per_rank) == ("gloo", "gloo", 0.0)
    assert plan.notice and "\n" not in plan.notice and "4 replicas" in plan.notice and "1 GPU" in plan.notice
    assert "topology.replicas_per_cluster<=" not in plan.notice, "1 GPU cannot hold 2 clusters of one either"


def test_auto_asks_a_gpu_per_replica_only_where_every_replica_gets_its_own():
    plan = _plan(_gpu_node(2), _gpu_node(2))  # STRICT_PACK: each cluster's 2 replicas on a 2-GPU node
    assert (plan.inner, plan.outer, plan.gpus_per_rank, plan.notice) == ("auto", "gloo", 1.0, None)
    # 4 GPUs in total but not 2 on one node: STRICT_PACK cannot give each replica of a cluster its own
    spread = _plan(_gpu_node(1), _gpu_node(1), _gpu_node(1), _gpu_node(1))
    assert spread.gpus_per_rank == 0.0 and spread.inner == "gloo" and "STRICT_PACK" in spread.notice
    assert _plan(_gpu_node(1), _gpu_node(1), _gpu_node(1), _gpu_node(1), strategy="PACK").gpus_per_rank == 1.0
    # hot spares need their GPU too
    assert _plan(_gpu_node(2), _gpu_node(2), spares_per_cluster=1).gpus_per_rank == 0.0


def test_a_cpu_cluster_trains_with_gloo_silently():
    plan = _plan(_gpu_node(0))
    assert (plan.inner, plan.outer, plan.gpus_per_rank, plan.notice) == ("gloo", "gloo", 0.0, None)


def test_nccl_is_decided_from_the_clusters_gpus_not_the_drivers_cuda():
    """A CPU-only driver (head node) with GPU workers: nccl is accepted (it used to be refused as
    'nccl needs CUDA'); the plan has no idea of the driver's CUDA at all."""
    plan = _plan(_gpu_node(0), _gpu_node(2), _gpu_node(2), backend="nccl")
    assert (plan.inner, plan.outer, plan.gpus_per_rank) == ("nccl", "nccl", 1.0)
    mixed = _plan(_gpu_node(2), _gpu_node(2), backend="nccl", outer="gloo")
    assert (mixed.inner, mixed.outer, mixed.gpus_per_rank) == ("nccl", "gloo", 1.0)
    outer_only = _plan(_gpu_node(2), _gpu_node(2), backend="gloo", outer="nccl")
    assert (outer_only.inner, outer_only.outer, outer_only.gpus_per_rank) == ("gloo", "nccl", 1.0)
    assert _plan(_gpu_node(2), _gpu_node(2), backend="gloo").gpus_per_rank == 0.0


def test_more_nccl_replicas_than_gpus_on_a_node_is_refused_naming_counts_and_what_is_valid():
    """Issue 20 Build 6: never a 'Duplicate GPU detected' crash after the replicas started."""
    from hsgd.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _plan(_gpu_node(1), _gpu_node(1), backend="nccl")  # 2 clusters x 2 on nodes of 1 GPU
    text = str(info.value)
    assert info.value.field == "comm.backend" and "\n" not in text
    assert "4 replicas" in text and "per node: [1, 1]" in text and "2 GPUs" in text
    assert "topology.replicas_per_cluster<=1" in text and "comm.backend=gloo" in text
    with pytest.raises(ConfigError) as info:
        _plan(_gpu_node(0), backend="gloo", inner="nccl")
    assert info.value.field == "comm.inner_backend" and "0 GPUs" in str(info.value)
    assert "replicas_per_cluster<=" not in str(info.value), "no GPU at all: only the backend can change"
    with pytest.raises(ConfigError) as info:
        _plan(_gpu_node(1), outer="nccl")
    assert info.value.field == "comm.outer_backend" and "comm.outer_backend=gloo" in str(info.value)


def test_short_of_cpus_is_left_to_the_placement_check():
    plan = _plan(_gpu_node(4, cpus=1), _gpu_node(4, cpus=1), backend="nccl")
    assert plan.gpus_per_rank == 1.0
    assert _placement(need={"CPU": 1.0, "GPU": 1.0}, nodes=[_gpu_node(4, cpus=1), _gpu_node(4, cpus=1)]) is not None


@pytest.mark.parametrize(
    "asked,level,gpu,expected",
    [
        ("auto", "inner", True, "nccl"),
        ("auto", "inner", False, "gloo"),
        ("auto", "outer", True, "gloo"),
        ("gloo", "inner", True, "gloo"),
        ("nccl", "outer", True, "nccl"),
        ("nccl", "inner", True, "nccl"),
    ],
)
def test_the_replica_resolves_auto_by_its_own_gpu(asked, level, gpu, expected):
    from hsgd.config.capacity import resolve_level_backend

    assert resolve_level_backend(asked, level=level, gpu=gpu) == expected


def test_nccl_in_a_replica_without_a_gpu_is_a_config_error():
    from hsgd.config import ConfigError
    from hsgd.config.capacity import resolve_level_backend

    with pytest.raises(ConfigError) as info:
        resolve_level_backend("nccl", level="inner", gpu=False)
    assert info.value.field == "comm.inner_backend" and "valid here: gloo|auto" in str(info.value)


# -- data.path on every node that may run replicas (hsgd.config.capacity.data_path_problem) --------------
def test_data_path_missing_on_another_node_names_the_node():
    from hsgd.config.capacity import data_path_problem

    assert data_path_problem("data/x.txt", {"head 10.0.0.1": True}) is None
    text = data_path_problem("data/x.txt", {"head 10.0.0.1": True, "gpu-7 10.0.0.7": False})
    assert "'data/x.txt'" in text and "gpu-7 10.0.0.7" in text and "head" not in text and "\n" not in text
    assert "1 of 2 nodes" in text


def test_a_node_that_does_not_answer_is_not_called_missing():
    from hsgd.config.capacity import data_path_problem

    assert data_path_problem("/d", {"a": True, "b": None}) is None
    many = data_path_problem("/d", {f"n{i}": False for i in range(7)})
    assert "and 3 more" in many and "7 of 7" in many
