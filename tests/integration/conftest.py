"""One embedded Ray for all in-process runs of the integration tests: `run_training` reuses a Ray
that is already up (and leaves it up), which saves several seconds of start-up per run. Runs
that must be separate processes (the CLI, `ray job submit`, the notebook) start their own. A test
that ends the process's Ray session (Ray Train's trainer does, in the peer suites) leaves the next
test a fresh shared one, not one embedded Ray started and stopped per run."""

from __future__ import annotations

import os

import pytest

from tests import groups
from tests.integration.runs import REPO


def _init_shared_ray() -> None:
    import ray

    ray.init(
        address="local",  # never a `ray start` cluster another test left on this machine
        num_cpus=max(os.cpu_count() or 1, 8),
        namespace="hsgd-tests",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    )


@pytest.fixture(scope="session", autouse=True)
def shared_ray():
    import ray

    started = False
    if not ray.is_initialized():
        _init_shared_ray()
        started = True
    yield
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def shared_ray_up_again(shared_ray):
    import ray

    if not ray.is_initialized():
        _init_shared_ray()
    yield


pytest_collection_modifyitems = groups.pytest_collection_modifyitems  # the busy long runs: one worker


@pytest.fixture
def background_drills():
    """start(overrides, run_dir) -> a run started in the background (actors/drill.py); each one a
    test left running is stopped at teardown."""
    from actors.drill import Drill

    drills = []

    def start(overrides, run_dir):
        drill = Drill(overrides, run_dir=str(run_dir)).start()
        drills.append(drill)
        return drill

    yield start
    for drill in drills:
        if drill.summary is None and drill._alive():
            drill.stop()
