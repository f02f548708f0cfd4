"""Simulated hardware for benchmarks and tests on CPU: a slow link, and paced, straggling steps.

Off unless configured: a comm group gets a `LinkModel` only when `links.<level>.gbps` > 0, the
trainer a `StepPacer` only when its site's (else `train.`) `min_step_s` or `straggle_p` > 0; else both are None.
Each sleeps after the work it paces: a link after a collective succeeded (never inside its deadline).
"""

import random
import time
from dataclasses import dataclass

from hsgd.config.sites import site_pacing


@dataclass
class LinkModel:
    """`n` bytes take latency + jitter + n * 8 / (gbps * 1e9) s, the jitter uniform in [0, jitter_ms]
    from the link's own seeded generator (no other random stream moves); values validated by the config."""

    gbps: float
    latency_ms: float
    jitter_ms: float = 0.0
    seed: int = 0

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def seconds(self, payload_bytes: int, most: bool = False) -> float:
        """Modeled time for `payload_bytes`: one jitter draw per call; `most`: all of it (a deadline's)."""
        jitter_ms = self.jitter_ms if most else self._rng.uniform(0.0, self.jitter_ms) if self.jitter_ms > 0 else 0.0
        return (self.latency_ms + jitter_ms) / 1e3 + payload_bytes * 8 / (self.gbps * 1e9)

    def pace(self, start: float, payload_bytes: int) -> None:
        """Sleep until a collective begun at `start` (monotonic) lasted the modeled time."""
        rest = self.seconds(payload_bytes) - (time.monotonic() - start)
        if rest > 0:
            time.sleep(rest)


def link_from_config(level, seed: int = 0) -> LinkModel | None:
    """The link of one level's config node (`cfg.links.outer`); None when absent or gbps is 0."""
    return (
        None
        if level is None or not float(level.gbps)
        else LinkModel(float(level.gbps), float(level.latency_ms), float(level.jitter_ms), seed=seed)
    )


@dataclass(frozen=True)
class StepPacer:
    """Sleep until a step lasted `min_step_s`; then, with probability `straggle_p` drawn from (seed,
    replica index, step) alone (a replay straggles alike), `straggle_factor` times its time so far."""

    min_step_s: float
    straggle_p: float
    straggle_factor: float
    seed: int

    def after_step(self, started: float, replica_index: int, step: int) -> None:
        if self.min_step_s > 0:
            time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - started)))
        if self.straggle_p > 0 and self.straggles(replica_index, step):
            time.sleep(self.straggle_factor * (time.perf_counter() - started))

    def straggles(self, replica_index: int, step: int) -> bool:
        return random.Random(hash((self.seed, replica_index, step)) & (2**63 - 1)).random() < self.straggle_p


def pacer_from_config(cfg, cluster: int = 0) -> StepPacer | None:
    """Cluster `cluster`'s pacer: its site's `min_step_s` / `straggle_*` where set, else `train.*`."""
    min_step_s, straggle_p, straggle_factor = site_pacing(cfg, cluster)
    return (
        None
        if min_step_s <= 0 and straggle_p <= 0
        else StepPacer(min_step_s, straggle_p, straggle_factor, int(cfg.seed))
    )
