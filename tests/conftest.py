"""Shared test settings: wandb off, quiet progress, the repo importable by Ray workers."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))




def pytest_collection_modifyitems(config, items):
    if os.environ.get("HSGD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow soak test: set HSGD_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
