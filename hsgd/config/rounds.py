"""How long a round is, from the config (a round is the span between two outer syncs)."""

from __future__ import annotations

from hsgd.config.schema import HsgdConfig


def steps_per_round(cfg: HsgdConfig) -> int:
    """Inner steps per round: `sync.outer_every / sync.fragments` (each round syncs one fragment,
    so every fragment is synced every `outer_every` steps; without fragments, outer_every)."""
    return int(cfg.sync.outer_every) // max(1, int(cfg.sync.fragments))


def is_streaming(cfg: HsgdConfig) -> bool:
    """Fragments or a mixing weight: the clusters' working params differ between syncs by design,
    and agree within each cluster only (ARCHITECTURE.md, invariant 1)."""
    return cfg.sync.fragments > 1 or cfg.sync.fragment_alpha > 0
