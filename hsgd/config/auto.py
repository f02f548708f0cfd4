"""Defaults a run derives from itself once, at its start (issue 33): `null` in the config means "auto".

- `optim.inner.schedule: null` -> `cosine`.
- `optim.inner.warmup_steps: null` -> 5 % of the run's inner steps (`train.rounds x outer_every / fragments`),
  at least 0: the inner rate rises linearly over them, then follows `optim.inner.schedule` (cosine by default).
- `optim.outer.lr` / `optim.outer.momentum: null` -> `auto_outer_step` of the run's clusters and outer steps.

Why these (docs/converging.md, `python -m benchmarks outer_sweep`): on the shipped corpus, model
tiny, 2,000 inner steps, batch 8 per replica, flat DDP (1 x 4) reached 1.710 with the old constant inner rate
and 1.651 with cosine decay; hierarchical 2 x 2 DiLoCo at H = 50 with DiLoCo's 0.7 / 0.9 went from 2.219
(+30 %) to 1.734 (+5.0 %) with cosine alone, and to 1.678 (+1.6 %) with lr 1.0, momentum 0.3 (40 outer steps);
at H = 20 (100 outer steps) momentum 0.5 did best, 1.674 (+1.4 %), and so it did for 4 x 1 at H = 50 (1.735 against
1.750 at 0.3: four clusters of one replica each average noisier pseudo-gradients, and stay +5 % behind). The decay
closes most of the gap (a constant rate leaves the clusters' models far apart at the end); the outer step does the
rest: DiLoCo's 0.9 was fitted to hundreds of outer steps, and a run of tens overshoots with it. From 500 outer
steps on the rule returns DiLoCo's published 0.7 / 0.9 (not measured here).

Explicit values always win. A resume keeps, for keys left auto, what its checkpoint recorded (`recorded`: the
fingerprint's outer step, the manifest's `inner_schedule`; a checkpoint written before these defaults holds no
`inner_schedule` and ran the old constant rate without warmup), so a run started under other defaults, or resumed
with more rounds, resumes on the same rates (actors.startup.find_resume_point).
"""

from __future__ import annotations

from typing import Any

from hsgd.config.layout import RunLayout, layout_of
from hsgd.config.schema import HsgdConfig

WARMUP_FRACTION = 0.05  # of the run's inner steps
SCHEDULE = "cosine"
# what a checkpoint written before these defaults (no `inner_schedule` in its manifest) trained with
OLD_INNER_SCHEDULE = {"optim.inner.schedule": "constant", "optim.inner.warmup_steps": 0}


def run_steps(cfg: HsgdConfig, layout: RunLayout) -> int:
    """The run's inner steps per replica: train.rounds x steps per round."""
    return int(cfg.train.rounds) * layout.steps_per_round


def outer_steps(cfg: HsgdConfig, layout: RunLayout) -> int:
    """Outer steps each parameter takes over the run: one per `outer_every` inner steps."""
    return max(1, run_steps(cfg, layout) // int(cfg.sync.outer_every))


def auto_outer_step(clusters: int, outer_steps: int) -> tuple[float, float]:
    """(lr, momentum) of the Nesterov outer step for a run of `outer_steps` outer steps over `clusters`."""
    if outer_steps >= 500:
        return 0.7, 0.9  # DiLoCo's, fitted to hundreds of outer steps and more
    return 1.0, 0.5 if outer_steps >= 50 or clusters >= 4 else 0.3


def warmup_steps_of(inner: Any, total_steps: int) -> int:
    """`optim.inner.warmup_steps`, or 5 % of `total_steps` when null."""
    value = inner.warmup_steps
    return int(total_steps * WARMUP_FRACTION) if value is None else int(value)


def schedule_of(inner: Any) -> str:
    """`optim.inner.schedule`, or cosine when null."""
    return inner.schedule or SCHEDULE


def inner_schedule(cfg: HsgdConfig, layout: RunLayout) -> dict:
    """The inner schedule's keys as the run uses them, for a checkpoint's manifest."""
    o = cfg.optim.inner
    return {
        "optim.inner.schedule": schedule_of(o),
        "optim.inner.warmup_steps": warmup_steps_of(o, run_steps(cfg, layout)),
    }


def recorded(manifest: dict) -> dict:
    """{key: value} a checkpoint recorded for the keys this module resolves."""
    fingerprint = manifest.get("fingerprint") or {}
    outer = {k: fingerprint[k] for k in ("optim.outer.lr", "optim.outer.momentum") if k in fingerprint}
    return {**outer, **(manifest.get("inner_schedule") or OLD_INNER_SCHEDULE)}


def outer_step_of(cfg: HsgdConfig, layout: RunLayout | None = None) -> tuple[float, float]:
    """(lr, momentum) the run's outer optimizer uses: each explicit value, else the auto one, from the
    run's `layout` (None: the config's, `layout_of`; a resolved config, the replicas', needs none)."""
    o = cfg.optim.outer
    lr = momentum = None
    if o.lr is None or o.momentum is None:
        layout = layout if layout is not None else layout_of(cfg)
        lr, momentum = auto_outer_step(layout.topology.clusters, outer_steps(cfg, layout))
    return (float(o.lr) if o.lr is not None else lr, float(o.momentum) if o.momentum is not None else momentum)


def resolve(cfg: HsgdConfig, layout: RunLayout) -> dict:
    """Write the auto values into `cfg` (keys left null); returns {key: value} of those it filled (a resume
    adopts what its checkpoint recorded for them instead; the run's config.yaml shows the values it ran with).
    Idempotent: a resolved config has nothing left to fill."""
    from omegaconf import open_dict

    filled = {}
    lr, momentum = outer_step_of(cfg, layout)
    with open_dict(cfg):
        if cfg.optim.outer.lr is None:
            cfg.optim.outer.lr = filled["optim.outer.lr"] = lr
        if cfg.optim.outer.momentum is None:
            cfg.optim.outer.momentum = filled["optim.outer.momentum"] = momentum
        if cfg.optim.inner.schedule is None:
            cfg.optim.inner.schedule = filled["optim.inner.schedule"] = SCHEDULE
        if cfg.optim.inner.warmup_steps is None:
            cfg.optim.inner.warmup_steps = filled["optim.inner.warmup_steps"] = warmup_steps_of(
                cfg.optim.inner, run_steps(cfg, layout)
            )
    return filled
