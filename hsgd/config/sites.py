"""`topology.sites`' checks that its field metadata cannot say (each site, the uniform keys, the quorum),
and the run's one `gpus_per_replica` (a site may restate it, never differ: rank j of every replica
holds shard j, so the outer sync pairs shards across clusters only when every cluster cuts alike)."""

from __future__ import annotations

from typing import Any

from hsgd.config.schema import ConfigError, HsgdConfig, TopologyConfig

# Pacing bounds (issue 45): a simulated step is never padded past a day, however it straggles, and a
# straggler sleeps at most MAX_STRAGGLE_FACTOR times its step; far below where a sleep overflows
# (threading.TIMEOUT_MAX, ~9.2e9 s), so a typo is refused before Ray starts, not a site that never trains.
MAX_STEP_S = 86_400.0
MAX_STRAGGLE_FACTOR = 1_000.0
# a site's pacing key -> (low, high, the valid values in words)
SITE_PACING = {
    "min_step_s": (0.0, MAX_STEP_S, f"a finite number >= 0 and <= {MAX_STEP_S:g} (one day)"),
    "straggle_p": (0.0, 1.0, "a number in [0, 1]"),
    "straggle_factor": (0.0, MAX_STRAGGLE_FACTOR, f"a finite number >= 0 and <= {MAX_STRAGGLE_FACTOR:g}"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sites(cfg: HsgdConfig) -> None:
    """Raises ConfigError (one line) for a bad `topology.sites`; nothing when it is empty."""
    t = cfg.topology
    sites = list(t.sites or [])
    if not sites:
        return
    default = TopologyConfig()
    for key in ("clusters", "replicas_per_cluster", "cluster_labels"):
        value = getattr(t, key)
        if (list(value) if key == "cluster_labels" else value) != getattr(default, key):
            raise ConfigError(
                "topology.sites",
                f"is set together with topology.{key}={value!r}; valid: the sites "
                f"alone (each with its replicas and label), or the uniform keys alone",
            )
    for c, site in enumerate(sites):
        where = f"topology.sites[{c}]"
        replicas = _site_value(site, "replicas")
        if not _is_int(replicas) or replicas < 1:
            raise ConfigError(f"{where}.replicas", f"got {replicas!r}; valid: an int >= 1 (the site's replicas)")
        floor = _site_value(site, "min_replicas")
        if floor is not None and (not _is_int(floor) or not 1 <= floor <= replicas):
            raise ConfigError(
                f"{where}.min_replicas",
                f"got {floor!r}; valid: null or an int in [1, {replicas}] (the site's replicas)",
            )
        for key, (low, high, valid) in SITE_PACING.items():
            value = _site_value(site, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high
            ):  # nan fails every comparison: refused too
                raise ConfigError(f"{where}.{key}", f"got {value!r}; valid: null (train.{key}) or {valid}")
        run_floor = cfg.supervisor.min_replicas_per_cluster
        if floor is None and run_floor > replicas:
            raise ConfigError(
                "supervisor.min_replicas_per_cluster",
                f"got {run_floor}, more than {where} has ({replicas}); valid: <= {replicas}, or "
                f"{where}.min_replicas set",
            )


def check_padded_steps(cfg: HsgdConfig) -> None:
    """Raises ConfigError (one line) when a cluster that straggles would pad a step past MAX_STEP_S:
    a straggler sleeps `straggle_factor` times its step so far, at least `min_step_s`. Names the factor
    that applies (the site's, else `train.straggle_factor`)."""
    for c in range(max(1, len(list(getattr(cfg.topology, "sites", None) or [])))):
        min_step_s, straggle_p, straggle_factor = site_pacing(cfg, c)
        padded = min_step_s * (1.0 + straggle_factor)
        if straggle_p > 0 and padded > MAX_STEP_S:
            step_key, _, factor_key = (_pacing_key(cfg, c, key) for key in SITE_PACING)
            raise ConfigError(
                factor_key,
                f"{straggle_factor:g} with {step_key}={min_step_s:g} pads a straggling step to {padded:.4g} s, "
                f"past one day; valid: min_step_s x (1 + straggle_factor) <= {MAX_STEP_S:g}, here straggle_factor "
                f"<= {MAX_STEP_S / min_step_s - 1:.4g}",
            )


def _pacing_key(cfg: HsgdConfig, cluster: int, key: str) -> str:
    """The field cluster `cluster`'s pacing `key` comes from: its site's where set, else train's."""
    sites = list(getattr(cfg.topology, "sites", None) or [])
    if cluster < len(sites) and _site_value(sites[cluster], key) is not None:
        return f"topology.sites[{cluster}].{key}"
    return f"train.{key}"


def site_ranks(cfg: HsgdConfig) -> list[tuple[str, int]]:
    """(field, k) per cluster that sets its ranks per replica: each site's own `gpus_per_replica` where
    given, else `topology.gpus_per_replica` (one entry for the uniform keys)."""
    t = cfg.topology
    run_k = t.gpus_per_replica
    sites = list(t.sites or [])
    if not sites:
        return [("topology.gpus_per_replica", run_k)]
    return [
        (f"topology.sites[{c}].gpus_per_replica", own)
        if (own := _site_value(site, "gpus_per_replica")) is not None
        else ("topology.gpus_per_replica", run_k)
        for c, site in enumerate(sites)
    ]


def check_site_ranks(cfg: HsgdConfig) -> None:
    """Raises ConfigError (one line) for a site's `gpus_per_replica` that is not an int >= 1, or for
    clusters with different ranks per replica (issue 34: every cluster shards a replica alike)."""
    chosen = site_ranks(cfg)
    for field, k in chosen:
        if not _is_int(k) or k < 1:
            raise ConfigError(field, f"got {k!r}; valid: null (topology.gpus_per_replica) or an int >= 1")
    first_field, first_k = chosen[0]
    for field, k in chosen[1:]:
        if k != first_k:
            raise ConfigError(
                field,
                f"is {k} but cluster c0 has {first_k} ({first_field}); valid: the same "
                f"gpus_per_replica for every site (rank j of each replica holds shard j)",
            )


def ranks_per_replica(cfg: HsgdConfig) -> int:
    """The run's k: rank processes per replica (after check_site_ranks, one value for all clusters)."""
    return int(site_ranks(cfg)[0][1])


def site_pacing(cfg: HsgdConfig, cluster: int) -> tuple[float, float, float]:
    """Cluster `cluster`'s simulated step time and stragglers: (min_step_s, straggle_p, straggle_factor),
    its site's own where set, else the run-wide `train.*` values."""
    sites = list(getattr(cfg.topology, "sites", None) or [])
    site = sites[cluster] if cluster < len(sites) else {}
    return tuple(
        float(_site_value(site, key) if _site_value(site, key) is not None else getattr(cfg.train, key))
        for key in ("min_step_s", "straggle_p", "straggle_factor")
    )


def expected_step_s(cfg: HsgdConfig, cluster: int) -> float | None:
    """The step time cluster `cluster` is configured to take (its min_step_s, stretched by its stragglers'
    expected extra), or None when no min_step_s is set for it: sync.balance then learns it."""
    min_step_s, straggle_p, straggle_factor = site_pacing(cfg, cluster)
    return min_step_s * (1.0 + straggle_p * straggle_factor) if min_step_s > 0 else None


def _site_value(site: Any, key: str) -> Any:
    """A site's field; a missing one (OmegaConf's '???') reads as None."""
    try:
        value = site[key] if isinstance(site, dict) else getattr(site, key)
    except Exception:  # noqa: BLE001 — omegaconf.MissingMandatoryValue
        return None
    return None if value == "???" else value
