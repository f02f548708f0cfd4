"""The failure-drill notebook runs top to bottom, headless, and its final check holds."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.integration.runs import REPO


@pytest.mark.long
def test_failure_drill_notebook_runs_headless():
    path = REPO / "notebooks" / "failure_drill.ipynb"
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook with outputs cleared"
    )
    client = NotebookClient(
        nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
    )
    client.execute()  # raises CellExecutionError if any cell fails, the final assertion included
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "all four replicas agree" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 3, "timeline, loss and membership pictures are shown inline"
