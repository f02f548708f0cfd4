"""tests/run_all.sh's long part counts on pytest-xdist's `--dist loadgroup`: every busy long run in the
group `one_at_a_time` (tests/integration/conftest.py) on one worker, one after another. Under pytest 9
the group was silently dropped (xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads), and
the busy runs went side by side on every worker: slower and flaky. This runs a tiny suite the same
way and checks where each test ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONFTEST = "from tests.groups import pytest_collection_modifyitems  # the rule tests/integration uses\n"
TESTS = """
import os, pytest

@pytest.mark.long
@pytest.mark.parametrize("i", range(4))
def test_busy(i):
    print("WORKER busy", os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.long
@pytest.mark.paced
@pytest.mark.parametrize("i", range(4))
def test_paced(i):
    print("WORKER paced", os.environ["PYTEST_XDIST_WORKER"])
"""


def test_the_busy_group_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    long: x\n    paced: y\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-rA"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("WORKER ")]
    busy = {worker for kind, worker in seen if kind == "busy"}
    assert len(seen) == 8 and len(busy) == 1, f"the group one_at_a_time ran on {sorted(busy)}: {seen}"
