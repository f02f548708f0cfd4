"""One embedded Ray for all in-process runs of the integration tests: `run_training` reuses a Ray
that is already up (and leaves it up), which saves several seconds of start-up per run. Runs
that must be separate processes (the CLI, `ray job submit`, the notebook) start their own."""
from __future__ import annotations

import os

import pytest

from tests.integration.runs import REPO


@pytest.fixture(scope="session", autouse=True)
def shared_ray():
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=max(os.cpu_count() or 1, 8), namespace="hsgd-tests", include_dashboard=False,
                 log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
        started = True
    yield
    if started and ray.is_initialized():
        ray.shutdown()
