"""Issue 46 Build 5: the manual's configuration and events references are generated from the schema's
field docstrings and from `EVENTS` / `EVENT_DOCS` (hsgd.config.reference). A committed page that
differs from what the generator writes, or a field or an event without a description, fails here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hsgd.config import reference
from hsgd.config.schema import HsgdConfig
from hsgd.record.events import EVENT_DOCS, EVENTS

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_pages_are_what_the_generator_writes():
    for path, text in reference.pages().items():
        committed = (REPO / path).read_text(encoding="utf-8")
        assert committed == text, f"{path} is out of date: run `python -m hsgd.config.reference` and commit it"


def test_every_schema_field_has_a_description():
    assert reference.undocumented(HsgdConfig) == [], "schema fields without a docstring under them"


def test_every_event_has_a_description():
    assert reference.undescribed_events() == [], "events without an EVENT_DOCS entry (or entries of no event)"


def test_the_checks_pass_on_the_repository():
    assert reference.problems(REPO) == []


@dataclass
class _Inner:
    described: int = 1
    """What it does."""
    forgotten: float = 0.5


@dataclass
class _Config:
    seed: int = 0
    """The seed."""
    inner: _Inner = field(default_factory=_Inner)
    """A group."""
    bare: str = "x"


def test_a_field_added_without_a_description_is_caught():
    assert reference.undocumented(_Config) == ["inner.forgotten", "bare"]


def test_an_event_added_without_a_description_is_caught():
    events = {**EVENTS, "new_event": ("round",)}
    assert reference.undescribed_events(events, EVENT_DOCS) == ["new_event"]
    assert reference.undescribed_events(EVENTS, {**EVENT_DOCS, "gone_event": "text"}) == ["gone_event"]


def test_a_stale_page_is_caught(tmp_path):
    for path, text in reference.pages().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    assert reference.problems(tmp_path) == []
    stale = tmp_path / reference.CONFIG_PAGE
    stale.write_text(stale.read_text(encoding="utf-8").replace("`topology.clusters`", "`topology.cluster`", 1))
    assert reference.problems(tmp_path) == [
        f"{reference.CONFIG_PAGE} differs from what `python -m hsgd.config.reference` writes: run it, commit the page"
    ]


def test_the_reference_shows_each_keys_default_and_what_is_valid():
    page = reference.configuration_page()
    assert "### `sync.inner`\n\nDefault `ddp` · valid: `ddp` | `localsgd` | `none`\n" in page
    assert "### `train.min_step_s`\n\nDefault `0.0` · valid: a finite number in [0, 86400]\n" in page
    assert "### `topology.sites[].replicas`\n\nDefault `required`" in page
