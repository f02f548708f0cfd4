"""Issue 46 Build 5, acceptance 4: README.md is a front page (at most 250 lines, none over 200
characters) that keeps the two set-up commands, and every page of the manual it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
VENV = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
SETUP = (f"{VENV} -e . && python -m jobs.train", f'{VENV} -e ".[test,bench]" && bash tests/run_all.sh')


def test_the_front_page_is_short():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    long = [i for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"


def test_the_set_up_commands_stay_as_they_are():
    for command in SETUP:
        assert f"\n{command}\n" in README, f"README.md lost the set-up command: {command}"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -q torch==2.13.0 -e ".[test,bench]"' in ci and "bash tests/run_all.sh" in ci


def test_every_manual_page_the_front_page_links_exists():
    links = re.findall(r"\]\((docs/[^)#]+)", README)
    assert len(links) > 10, "the front page indexes the manual"
    missing = sorted({link for link in links if not (REPO / link).is_file()})
    assert not missing, f"README.md links to pages that do not exist: {missing}"
