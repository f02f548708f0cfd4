"""The embedded cluster is always a fresh one: `ray.init()` without an address picks up the cluster a
`ray start` on the same machine recorded in its temp dir (ray_current_cluster), and then refuses our
num_cpus ("When connecting to an existing cluster, num_cpus and num_gpus must not be provided") —
the CI failure of stop 50, where another test's `ray start` cluster was up beside a CLI run."""

from __future__ import annotations

import ray
from ray._private import services

from actors.launch import connect_ray
from hsgd.config.compose import compose_config


def _embedded_init_kwargs(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    assert connect_ray(compose_config(["topology.clusters=2"])) is True
    return seen


def test_the_embedded_start_names_address_local(monkeypatch):
    kwargs = _embedded_init_kwargs(monkeypatch)
    assert kwargs["address"] == "local" and kwargs["num_cpus"] >= 2


def test_address_local_starts_fresh_where_no_address_would_join_a_recorded_cluster(tmp_path, monkeypatch):
    """Ray's own resolution, against a temp dir where a `ray start` left its address."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:6399")
    assert services.canonicalize_bootstrap_address(None, str(tmp_path)).endswith(":6399")  # the bug
    assert services.canonicalize_bootstrap_address("local", str(tmp_path)) is None  # start a new one


def test_an_address_given_still_attaches(monkeypatch):
    seen: dict = {}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6399")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    connect_ray(compose_config([]))
    assert seen["address"] == "127.0.0.1:6399" and "num_cpus" not in seen
