"""Shared test settings: wandb off, quiet progress, the repo importable by Ray workers."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
