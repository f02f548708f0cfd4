"""Where tests/run_all.sh's long part runs each test (pytest-xdist, `--dist loadgroup`): the long runs
that keep the cores busy go to one worker, one after another (group `one_at_a_time`); the realistic
and other `paced` runs (padded steps, cores mostly idle) take the other workers, beside them. Without
xdist the group means nothing. tests/unit/test_xdist_groups.py checks that xdist honours it."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if (
            item.get_closest_marker("long")
            and not item.get_closest_marker("paced")
            and not item.get_closest_marker("realistic")
        ):
            item.add_marker(pytest.mark.xdist_group("one_at_a_time"))
