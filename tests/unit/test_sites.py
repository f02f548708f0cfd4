"""Sites of different sizes (issue 32): the topology and its global replica index table, the
per-site quorum floors, the config checks of `topology.sites` (before Ray starts, one line), and
capacity per site."""

from __future__ import annotations

import pytest

from hsgd.config import ConfigError
from hsgd.config.capacity import placement_problem
from hsgd.config.compose import precheck
from hsgd.core.membership import live_plan, quorum_problem
from hsgd.core.topology import Topology, assign_indices, topology_of
from tests.fakes.cli import train_isolated as _train

SITES = "topology.sites=[{replicas:3},{replicas:2},{replicas:1}]"


def test_sites_of_3_2_1_give_six_replicas_numbered_site_by_site():
    topo = Topology.of_sites((3, 2, 1))
    assert topo.replica_ids() == ["c0r0", "c0r1", "c0r2", "c1r0", "c1r1", "c2r0"]
    assert [topo.global_index(r) for r in topo.replica_ids()] == [0, 1, 2, 3, 4, 5]
    assert (topo.clusters, topo.num_replicas, topo.size(1), topo.cluster_members(2)) == (3, 6, 2, ["c2r0"])
    with pytest.raises(ValueError, match="not a replica of this topology"):
        topo.global_index("c2r1")


def test_the_uniform_form_keeps_cluster_times_size_plus_index():
    topo = Topology(3, 4)
    assert all(topo.global_index(f"c{c}r{i}") == c * 4 + i for c in range(3) for i in range(4))
    assert topo.uniform and topo.sizes == (4, 4, 4)


def test_the_index_table_keeps_every_id_when_a_resume_changes_the_sites():
    first = Topology.of_sites((3, 2, 1))
    grown = Topology.of_sites((3, 3, 1), index_table=dict(first.index_table))
    assert grown.global_index("c2r0") == 5, "arithmetic on sizes would move c2r0 to 6: another replica's stream"
    assert grown.global_index("c1r2") == 6, "a new id gets the next free index"
    shrunk = Topology.of_sites((1, 2, 1), index_table=dict(grown.index_table))
    assert [shrunk.global_index(r) for r in shrunk.replica_ids()] == [0, 3, 4, 5]
    back = Topology.of_sites((3, 3, 1), index_table=dict(shrunk.index_table))
    assert back.global_index("c0r2") == 2 and back.global_index("c1r2") == 6, "a returning id keeps its old index"
    assert assign_indices(["c0r0", "c9r9"], {"c0r0": 4}) == {"c0r0": 4, "c9r9": 5}


def test_each_site_may_set_its_own_quorum_floor():
    topo = Topology.of_sites((3, 2, 1), min_replicas=(2, None, None))
    assert topo.floors(1) == [2, 1, 1]
    plan = live_plan(topo, {"c0r0", "c1r0", "c2r0"}, {}, epoch=1, min_replicas_per_cluster=1)
    assert sorted(plan.members) == [1, 2] and "c0r0" not in plan.live, "c0 with one live replica is below its own 2"
    assert quorum_problem([1, 1, 1], topo.floors(1), min_clusters=3) is not None
    assert quorum_problem([2, 1, 1], topo.floors(1), min_clusters=3) is None


def test_the_config_builds_the_sites_topology(tmp_path):
    from hsgd.config.compose import compose_config

    cfg = compose_config([SITES.replace("{replicas:1}", "{replicas:1,label:rack-b,name:eu-1,min_replicas:1}")])
    topo = topology_of(cfg)
    assert topo.sizes == (3, 2, 1) and topo.label(2) == "rack-b" and topo.label(0) is None
    assert topo.describe()["sites"][2] == {"replicas": 1, "label": "rack-b", "name": "eu-1", "min_replicas": 1}


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["topology.sites=[{replicas:3},{replicas:0}]"], "topology.sites[1].replicas"),
        (["topology.sites=[{replicas:3},{label:rack-a}]"], "topology.sites[1].replicas"),
        ([SITES, "topology.clusters=3"], "topology.sites"),
        ([SITES, "topology.replicas_per_cluster=4"], "topology.sites"),
        (["topology.sites=[{replicas:2,min_replicas:3}]"], "topology.sites[0].min_replicas"),
        ([SITES, "supervisor.min_replicas_per_cluster=2"], "supervisor.min_replicas_per_cluster"),
        ([SITES, "supervisor.min_clusters=4"], "supervisor.min_clusters"),
        ([SITES, "faults.schedule=[{kind:kill,target:c2r1,round:0}]"], "faults.schedule[0].target"),
    ],
)
def test_bad_sites_are_one_line_config_errors(overrides, field):
    with pytest.raises(ConfigError) as info:
        precheck(overrides)
    assert info.value.field == field and "\n" not in str(info.value), str(info.value)


def test_good_sites_pass_the_checks():
    precheck([SITES, "supervisor.min_clusters=3", "faults.schedule=[{kind:kill,target:c0r2,round:0}]"])


@pytest.mark.parametrize(
    "override,field",
    [
        ("topology.sites=[{replicas:3},{replicas:0}]", "topology.sites[1].replicas"),
    ],
)
def test_the_command_line_refuses_bad_sites_with_exit_2_before_ray(tmp_path, override, field):
    result = _train(tmp_path, override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[0].startswith(f"hsgd: config error: {field}: ")
    assert not (tmp_path / "ray").exists(), "Ray started"


def test_sites_beside_a_uniform_key_exit_2_before_ray(tmp_path):
    result = _train(tmp_path, SITES, "topology.clusters=3")
    assert result.returncode == 2 and "hsgd: config error: topology.sites: " in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "ray").exists(), "Ray started"


def _node(cpus, label=None):
    return {"Resources": {"CPU": float(cpus)}, "Labels": {"hsgd-cluster": label} if label else {}}


def _place(sizes, nodes, labels=(), strategy="STRICT_PACK"):
    from hsgd.config.schema import HsgdConfig, SiteConfig

    cfg = HsgdConfig()
    cfg.topology.placement_strategy = strategy
    labels = list(labels) or [None] * len(sizes)
    cfg.topology.sites = [SiteConfig(replicas=n, label=label) for n, label in zip(sizes, labels, strict=True)]
    return placement_problem(cfg, {"CPU": 1.0}, nodes)


def test_capacity_counts_each_site_at_its_own_size():
    assert _place((3, 2, 1), [_node(3), _node(3)]) is None, "3 on one node, 2 + 1 on the other"
    problem = _place((3, 2, 1), [_node(2), _node(2), _node(2)])
    assert problem and problem[0] == "topology.placement_strategy", "no node holds the 3-replica site whole"
    assert _place((3, 2, 1), [_node(2), _node(2), _node(2)], strategy="PACK") is None
    assert _place((3, 2, 1), [_node(5)], strategy="PACK")[0] == "topology.sites"


def test_more_replicas_than_a_labels_nodes_hold_names_the_site():
    nodes = [_node(2, "rack-a"), _node(4, "rack-b")]
    assert _place((2, 3), nodes, labels=("rack-a", "rack-b")) is None
    field, reason = _place((3, 2), nodes, labels=("rack-a", "rack-b"))
    assert field == "topology.sites[0].label" and "hold at most 2" in reason
    field, reason = _place((2, 3, 2), nodes + [_node(4)], labels=("rack-a", "rack-b", "rack-b"))
    assert field == "topology.sites[1].label" and "sharing the label" in reason
