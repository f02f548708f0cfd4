"""`topology.gpus_per_replica: k` (issue 34, Build 1 and Acceptance 6): a replica of k rank processes
on one node. Its refusals are one line naming the field, exit 2 before any actor starts (mixed k across
sites, sync.outer_path=sharded, a data.batch_size that does not split over k, k not dividing a GPU
node's devices; a sync.fragment_delay with k > 1 is accepted); the default k = 1
config and its resources are unchanged; the per-rank memory rule and one bundle per replica."""

from __future__ import annotations

import pytest

from hsgd.config import ConfigError
from hsgd.config.capacity import (
    GATHERED_COPIES,
    STATE_COPIES,
    GiB,
    embedded_capacity_problem,
    layer_param_count,
    model_param_count,
    placement_problem,
    plan_backends,
    rank_state_bytes,
)
from hsgd.config.compose import compose_config, precheck
from hsgd.config.sites import ranks_per_replica
from tests.fakes.cli import train_isolated
from tests.fakes.configs import default_cfg

TWO_SITES = "topology.sites=[{replicas:2},{replicas:2}]"


def _assert_one_line_naming(err: ConfigError, field: str, *words: str):
    text = str(err)
    assert err.field == field and text.startswith(f"{field}: ") and "\n" not in text, text
    for word in words:
        assert word in text, f"the {field} refusal must say {word!r}: {text}"


# -- the default is today's run -------------------------------------------------------------------------
def test_the_default_config_has_one_rank_per_replica_and_passes():
    cfg = compose_config([])
    assert cfg.topology.gpus_per_replica == 1 and ranks_per_replica(cfg) == 1
    precheck([])  # no refusal of k = 1, the launcher's included


def test_with_k_1_resources_and_memory_are_what_they_were():
    from actors.placement import group_specs, rank_resources, replica_resources

    cfg = default_cfg()
    assert rank_resources(cfg, 0.0) == replica_resources(cfg, 0.0) == {"CPU": 1.0}
    assert group_specs(cfg, 0.0) == [
        {"bundles": [{"CPU": 1.0}] * 2, "name": f"hsgd-cluster-{c}", "strategy": "STRICT_PACK"} for c in range(2)
    ]
    assert group_specs(default_cfg(**{"topology.placement_strategy": "NONE"}), 0.0) == []
    assert group_specs(default_cfg(**{"topology.cluster_labels": ["a", "b"]}), 1.0) == [], "labels: a selector"
    assert rank_state_bytes(4, 128, 64, 1) == STATE_COPIES * 4 * model_param_count(4, 128, 64)


# -- refusals before Ray: one line, the field, what is valid -----------------------------------------------
@pytest.mark.parametrize(
    "overrides,field,words",
    [
        (
            [TWO_SITES.replace("{replicas:2}]", "{replicas:2,gpus_per_replica:2}]")],
            "topology.sites[1].gpus_per_replica",
            ("is 2 but cluster c0 has 1", "the same gpus_per_replica for every site"),
        ),
        (
            ["topology.sites=[{replicas:2,gpus_per_replica:4},{replicas:2,gpus_per_replica:2}]", "data.batch_size=8"],
            "topology.sites[1].gpus_per_replica",
            ("is 2 but cluster c0 has 4",),
        ),
        (
            [TWO_SITES.replace("{replicas:2}]", "{replicas:2,gpus_per_replica:0}]")],
            "topology.sites[1].gpus_per_replica",
            ("valid: null (topology.gpus_per_replica) or an int >= 1",),
        ),
        (
            ["topology.gpus_per_replica=2", "sync.outer_path=sharded"],
            "sync.outer_path",
            ("gpus_per_replica=2", "valid: leader"),
        ),
        (["topology.gpus_per_replica=3", "data.batch_size=8"], "data.batch_size", ("valid: a multiple of 3",)),
        (["topology.gpus_per_replica=0"], "topology.gpus_per_replica", ("valid: an int >= 1",)),
        # every site restating one k is one k: only what k > 1 does not do is left
        (
            [
                "topology.sites=[{replicas:2,gpus_per_replica:2},{replicas:1,gpus_per_replica:2}]",
                "sync.outer_path=sharded",
            ],
            "sync.outer_path",
            ("topology.gpus_per_replica=2",),
        ),
    ],
)
def test_a_bad_gpus_per_replica_is_one_line_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as info:
        precheck(overrides)
    _assert_one_line_naming(info.value, field, *words)


def test_a_replica_of_k_ranks_may_overlap_its_outer_reduce_with_inner_steps():
    # sync.fragment_delay with k > 1: the reduce's thread agrees over a group of its own (hsgd.train.overlap)
    cfg = compose_config(["topology.gpus_per_replica=2", "sync.fragments=2", "sync.fragment_delay=1"])
    assert ranks_per_replica(cfg) == 2 and cfg.sync.fragment_delay == 1
    precheck(["topology.gpus_per_replica=2", "sync.fragments=2", "sync.fragment_delay=1"])
    precheck(
        [
            "topology.sites=[{replicas:2,gpus_per_replica:2},{replicas:1,gpus_per_replica:2}]",
            "sync.fragments=2",
            "sync.fragment_delay=2",
        ]
    )
    # what holds for every k still holds for k > 1: the delay stays below a round's steps
    with pytest.raises(ConfigError) as info:
        precheck(["topology.gpus_per_replica=2", "sync.outer_every=4", "sync.fragments=2", "sync.fragment_delay=2"])
    _assert_one_line_naming(info.value, "sync.fragment_delay", "not below a round's 2 steps")


def test_a_replica_of_k_ranks_may_write_checkpoints_and_resume():
    # sharded (DCP) checkpoints: written by every rank, loaded into any k (issue 34, Acceptance 3)
    precheck(["topology.gpus_per_replica=2", "checkpoint.every=2"])
    precheck(["topology.gpus_per_replica=2", "checkpoint.every=2", "train.resume=true"])


def test_a_site_may_restate_the_runs_k():
    cfg = compose_config(
        ["topology.gpus_per_replica=2", "topology.sites=[{replicas:2,gpus_per_replica:2},{replicas:1}]"]
    )
    assert ranks_per_replica(cfg) == 2


@pytest.mark.parametrize(
    "overrides,field",
    [
        (
            [TWO_SITES.replace("{replicas:2}]", "{replicas:2,gpus_per_replica:2}]")],
            "topology.sites[1].gpus_per_replica",
        ),
        (["topology.gpus_per_replica=2", "sync.outer_path=sharded"], "sync.outer_path"),
        (["topology.gpus_per_replica=3", "data.batch_size=8"], "data.batch_size"),
    ],
)
def test_the_command_line_refuses_with_exit_2_in_one_line_before_ray(tmp_path, overrides, field):
    result = train_isolated(tmp_path, *overrides)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"hsgd: config error: {field}: "), result.stderr[-2000:]
    assert not (tmp_path / "ray").exists(), "Ray started"
    assert not (tmp_path / "out").exists(), "a run folder was written before the refusal"


# -- the device count, from the nodes' resources (faked as ray.nodes() reports them) ------------------------
def _gpu_node(gpus, cpus=64):
    return {
        "Alive": True,
        "NodeID": f"n{gpus}",
        "Resources": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})},
        "Labels": {},
    }


def _k(k, **changes):
    return default_cfg(**{"topology.gpus_per_replica": k, **changes})


def test_k_that_does_not_divide_a_gpu_nodes_devices_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        plan_backends(_k(3), [_gpu_node(8), _gpu_node(8)])
    _assert_one_line_naming(info.value, "topology.gpus_per_replica", "per node: [8]", "valid: 1, 2, 4, 8")
    with pytest.raises(ConfigError) as info:  # one node of 4 among 8s: the common divisors only
        plan_backends(_k(8), [_gpu_node(8), _gpu_node(4)])
    _assert_one_line_naming(info.value, "topology.gpus_per_replica", "4 is not a multiple of 8", "valid: 1, 2, 4")


def test_k_that_divides_every_gpu_node_asks_a_gpu_per_rank():
    plan = plan_backends(_k(2), [_gpu_node(0), _gpu_node(4), _gpu_node(4)])  # a CPU head node does not count
    assert plan.gpus_per_rank == 1.0 and plan.notice is None, "2 x 2 replicas of 2 ranks on two 4-GPU nodes"
    assert plan_backends(_k(3), [_gpu_node(0)]).gpus_per_rank == 0.0, "no GPU at all: k processes over gloo"


def test_too_few_gpus_for_k_ranks_counts_every_rank():
    with pytest.raises(ConfigError) as info:  # 4 replicas x 2 ranks = 8 GPUs, each cluster's 4 on one node
        plan_backends(_k(2, **{"comm.backend": "nccl"}), [_gpu_node(2), _gpu_node(2)])
    _assert_one_line_naming(info.value, "comm.backend", "nccl needs one GPU per rank", "of 2 ranks", "need 8 GPUs")


def test_the_launchers_cluster_check_refuses_before_any_actor_starts(monkeypatch):
    """actors.placement.check_cluster (what run_training calls first; a ConfigError there is exit 2):
    the device count with the nodes' resources; a k that divides them passes."""
    import actors.placement as placement

    monkeypatch.setattr(placement.ray, "nodes", lambda: [_gpu_node(8), _gpu_node(8)])
    with pytest.raises(ConfigError) as info:
        placement.check_cluster(_k(3, **{"data.batch_size": 9}), data_timeout_s=1.0)
    _assert_one_line_naming(info.value, "topology.gpus_per_replica", "valid: 1, 2, 4, 8")
    plan, silent = placement.check_cluster(_k(2), data_timeout_s=1.0)
    assert plan.gpus_per_rank == 1 and silent == []


# -- capacity: the per-rank memory rule and placement of whole replicas -----------------------------------
def test_a_rank_holds_its_shard_of_the_state_plus_one_gathered_layer():
    n_layer, n_embd, block = 6, 384, 128  # model=small
    params, layer = model_param_count(n_layer, n_embd, block), layer_param_count(n_embd, block)
    assert layer == 12 * n_embd * n_embd + 4 * n_embd, "small's largest unit is a block, not the embeddings"
    for k in (2, 3, 4):
        shard = -(-params // k)
        assert rank_state_bytes(n_layer, n_embd, block, k) == STATE_COPIES * 4 * shard + GATHERED_COPIES * 4 * layer
    assert rank_state_bytes(n_layer, n_embd, block, 2) <= 0.6 * rank_state_bytes(n_layer, n_embd, block, 1), (
        "issue 34 Acceptance 5: a rank's state at model=small with k=2 is at most 0.6x of k=1"
    )
    assert layer_param_count(32, 1024, vocab_size=50304) == 50304 * 32 + 1024 * 32 + 64, "embeddings largest"


def test_the_embedded_capacity_counts_every_rank_process():
    args = dict(replicas=4, cpus_per_replica=1.0, cores=2, memory_bytes=24 * GiB, per_replica_bytes=400 * 2**20)
    assert embedded_capacity_problem(**args, num_cpus=4) is None
    text = embedded_capacity_problem(**args, num_cpus=4, ranks=2)
    assert text and "4 replicas x 2 ranks" in text and "need 8 CPUs" in text and "\n" not in text
    assert embedded_capacity_problem(**{**args, "replicas": 10}, num_cpus=None, ranks=1) is None
    assert "per core" in embedded_capacity_problem(**{**args, "replicas": 10}, num_cpus=None, ranks=2)


def test_a_replicas_ranks_are_placed_whole_on_one_node():
    rank = {"CPU": 1.0, "GPU": 1.0}
    four_gpu_nodes = [_gpu_node(4, cpus=4), _gpu_node(4, cpus=4)]
    assert placement_problem(_k(2), rank, four_gpu_nodes) is None, "each cluster's 2 x 2 ranks on one 4-GPU node"
    field, text = placement_problem(_k(2), rank, [_gpu_node(2, cpus=2)] * 4)
    assert field == "topology.placement_strategy" and "{CPU: 2, GPU: 2}" in text, text
    # PACK: 4 replicas of 2 ranks on four 3-CPU nodes: 12 CPUs hold 8 ranks, but only one whole replica per node
    assert (
        placement_problem(
            _k(2, **{"topology.placement_strategy": "PACK"}), {"CPU": 1.0}, [{"Resources": {"CPU": 3.0}}] * 4
        )
        is None
    )
    field, _ = placement_problem(
        _k(2, **{"topology.placement_strategy": "PACK"}), {"CPU": 1.0}, [{"Resources": {"CPU": 3.0}}] * 3
    )
    assert field == "topology.replicas_per_cluster", "9 CPUs hold 8 ranks only if replicas split across nodes"


def test_one_bundle_of_k_ranks_per_replica_whatever_the_strategy():
    from actors.placement import group_specs, rank_resources, replica_resources

    cfg = _k(2, **{"topology.spares_per_cluster": 1})
    assert rank_resources(cfg, 1.0) == {"CPU": 1.0, "GPU": 1.0}
    assert replica_resources(cfg, 1.0) == {"CPU": 2.0, "GPU": 2.0}
    specs = group_specs(cfg, 1.0)
    assert [len(s["bundles"]) for s in specs] == [3, 3] and specs[0]["bundles"][0] == {"CPU": 2.0, "GPU": 2.0}
    assert {s["strategy"] for s in specs} == {"STRICT_PACK"}
    none = group_specs(_k(2, **{"topology.placement_strategy": "NONE"}), 0.0)
    assert [s["strategy"] for s in none] == ["PACK", "PACK"], "k ranks need their bundle even without a strategy"
    labelled = group_specs(_k(2, **{"topology.cluster_labels": ["rack-a", "rack-b"]}), 1.0)
    assert labelled[1]["bundle_label_selector"] == [{"hsgd-cluster": "rack-b"}] * 2
