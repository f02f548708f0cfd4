"""The driver's Ray (`connect_ray`): a cluster to attach to, or an embedded one started on this
machine, robust to a busy machine: Ray gives its raylet a fixed 30 s to register, and a start that
misses it is cleaned up and started again."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from omegaconf import DictConfig

from hsgd.config.compose import attaches_to_cluster, check_embedded_capacity
from hsgd.config.layout import RunLayout, ranks_of

EMBEDDED_STARTS = 3  # Ray gives its raylet 30 s to register (hard-coded): a busy machine can miss that
RAY_START_TIMED_OUT = "timed out during startup"  # Ray's words (a bare Exception) when that wait runs out


def start_embedded_ray(**options) -> None:
    """ray.init(**options) of a fresh local cluster, started again (EMBEDDED_STARTS in all) when Ray's
    own start-up wait runs out; the processes each such start spawned are killed (Ray leaves them
    running). Any other error is raised at once; the last start's time-out once it is cleaned up."""
    import psutil  # Ray's own dependency
    import ray

    for attempt in range(1, EMBEDDED_STARTS + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            ray.init(**options)
            return
        except Exception as err:
            if RAY_START_TIMED_OUT not in str(err):
                raise
            spawned = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
            for child in spawned:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            psutil.wait_procs(spawned, timeout=10)
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == EMBEDDED_STARTS:
                raise
            print(
                f"[hsgd] the embedded Ray did not start within Ray's own 30 s (a busy machine?); "
                f"starting it again ({attempt + 1}/{EMBEDDED_STARTS})",
                flush=True,
            )


def connect_ray(cfg: DictConfig, layout: RunLayout | None = None) -> bool:
    """Attach to a Ray cluster (RAY_ADDRESS / a job context / ray.address) or start an embedded one.
    True if this call connected; Ray already initialised (a test, a notebook) stays as it is."""
    import ray

    if ray.is_initialized():
        return False
    if attaches_to_cluster(cfg):
        ray.init(
            address=cfg.ray.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="hsgd", log_to_driver=True
        )
        return True
    n = check_embedded_capacity(cfg, layout)
    cpus = n * ranks_of(cfg, layout) * cfg.topology.cpus_per_replica  # cpus_per_replica is per rank process
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(cpus + 0.999) + 1)
    repo = str(Path(__file__).resolve().parent.parent)
    start_embedded_ray(
        address="local",  # a fresh embedded cluster, never one another process left on this machine
        num_cpus=num_cpus,
        namespace="hsgd",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    )
    return True
