"""Issue 33's defaults (hsgd/config/auto.py): null = auto, resolved once at the run's start, explicit values win,
the fingerprint holds what the run uses, and a resume keeps what its checkpoint recorded for keys left auto."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hsgd.config.auto import auto_outer_step, outer_step_of, resolve, warmup_steps_of
from hsgd.config.layout import layout_of
from hsgd.train import checkpoint as ckpt
from hsgd.train.inner import inner_lr
from tests.fakes.checkpoint_states import replica_state, write_checkpoint


def _cfg(*overrides):
    from hsgd.config.schema import HsgdConfig

    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(list(overrides)))


def test_the_defaults_are_auto_with_a_cosine_inner_schedule():
    cfg = _cfg()
    assert cfg.optim.outer.lr is None and cfg.optim.outer.momentum is None and cfg.optim.inner.warmup_steps is None
    assert cfg.optim.inner.schedule is None
    resolve(cfg, layout_of(cfg))
    assert cfg.optim.inner.schedule == "cosine"


def test_resolve_fills_only_what_was_left_auto_and_says_what():
    cfg = _cfg("train.rounds=40", "sync.outer_every=50", "topology.clusters=2")
    filled = resolve(cfg, layout_of(cfg))
    lr, momentum = auto_outer_step(2, 40)
    assert filled == {
        "optim.outer.lr": lr,
        "optim.outer.momentum": momentum,
        "optim.inner.schedule": "cosine",
        "optim.inner.warmup_steps": 100,
    }
    assert (cfg.optim.outer.lr, cfg.optim.outer.momentum, cfg.optim.inner.warmup_steps) == (lr, momentum, 100)
    assert resolve(cfg, layout_of(cfg)) == {}, "a resolved config has nothing left to fill"
    mine = _cfg(
        "train.rounds=40",
        "sync.outer_every=50",
        "optim.outer.lr=0.7",
        "optim.inner.warmup_steps=0",
        "optim.inner.schedule=constant",
    )
    assert resolve(mine, layout_of(mine)) == {"optim.outer.momentum": momentum}
    assert mine.optim.outer.lr == 0.7 and mine.optim.inner.warmup_steps == 0, "explicit values win"


def test_warmup_is_five_percent_of_the_run_and_the_schedule_reads_it_unresolved():
    cfg = _cfg("train.rounds=10", "sync.outer_every=20", "optim.inner.lr=1.0")
    assert warmup_steps_of(cfg.optim.inner, 200) == 10
    explicit = _cfg("train.rounds=10", "sync.outer_every=20", "optim.inner.lr=1.0", "optim.inner.warmup_steps=10")
    for step in (0, 5, 9, 10, 100, 199):
        assert inner_lr(cfg.optim.inner, step, 200) == inner_lr(explicit.optim.inner, step, 200)
    assert inner_lr(cfg.optim.inner, 0, 200) == pytest.approx(0.1) and inner_lr(cfg.optim.inner, 199, 200) == 0.1


@pytest.mark.parametrize("outer_steps", [1, 10, 40, 100, 149, 150, 499, 500, 5000])
def test_the_auto_outer_step_is_a_valid_nesterov_step(outer_steps):
    for clusters in (2, 4, 8):
        lr, momentum = auto_outer_step(clusters, outer_steps)
        assert 0 < lr <= 1.0 and 0 <= momentum < 1


def test_momentum_grows_with_the_number_of_outer_steps():
    momenta = [auto_outer_step(2, n)[1] for n in (10, 40, 100, 200, 1000)]
    assert momenta == sorted(momenta) and auto_outer_step(2, 1000) == (0.7, 0.9), (
        "DiLoCo's for the runs it was fitted to"
    )


def test_four_clusters_or_more_take_the_higher_momentum_already_below_50_outer_steps():
    assert auto_outer_step(2, 40) == (1.0, 0.3) and auto_outer_step(3, 40) == (1.0, 0.3)
    assert auto_outer_step(4, 40) == (1.0, 0.5) and auto_outer_step(8, 10) == (1.0, 0.5)
    assert auto_outer_step(2, 100) == auto_outer_step(4, 100) == (1.0, 0.5)


def test_the_fingerprint_holds_the_values_the_run_uses():
    cfg = _cfg("train.rounds=40", "sync.outer_every=50")
    fp = ckpt.fingerprint(cfg)
    assert (fp["optim.outer.lr"], fp["optim.outer.momentum"]) == outer_step_of(cfg)
    resolve(cfg, layout_of(cfg))
    assert ckpt.fingerprint(cfg) == fp, "resolving changes nothing the fingerprint holds"


def test_a_resume_keeps_the_outer_step_its_checkpoint_recorded_for_keys_left_auto(tmp_path):
    from actors.startup import find_resume_point
    from hsgd.config import ConfigError

    old = _cfg("train.rounds=40", "sync.outer_every=50", "optim.outer.lr=0.7", "optim.outer.momentum=0.9")
    write_checkpoint(tmp_path, 3, fingerprint=ckpt.fingerprint(old))
    # the same run resumed with the keys left auto, and more rounds (the rule would pick other values)
    cfg = _cfg("train.rounds=100", "sync.outer_every=50")
    filled = resolve(cfg, layout_of(cfg))
    assert (cfg.optim.outer.lr, cfg.optim.outer.momentum) != (0.7, 0.9)
    point = find_resume_point(str(tmp_path), cfg, adopt=tuple(filled))
    assert point.path is not None and point.config_diff == ()
    assert (cfg.optim.outer.lr, cfg.optim.outer.momentum) == (0.7, 0.9)
    # an explicit other value is still refused, naming the key
    mine = _cfg("train.rounds=40", "sync.outer_every=50", "optim.outer.lr=0.5", "optim.outer.momentum=0.9")
    with pytest.raises(ConfigError, match=r"optim.outer.lr 0.7 -> 0.5"):
        find_resume_point(str(tmp_path), mine, adopt=tuple(resolve(mine, layout_of(mine))))


def _checkpoint(root, cfg, *, with_schedule: bool):
    """A finalized checkpoint of `cfg` (resolved); `with_schedule=False`: as one written before issue 33's defaults."""
    from hsgd.config.auto import inner_schedule

    tmp = ckpt.new_temp_dir(root, 3, owner="run-a")
    files = {rid: ckpt.save_replica_state(tmp, rid, replica_state(i)) for i, rid in enumerate(("c0r0", "c1r0"))}
    manifest = {"round": 3, "step": 60, "files": files, "fingerprint": ckpt.fingerprint(cfg)}
    if with_schedule:
        manifest["inner_schedule"] = inner_schedule(cfg, layout_of(cfg))
    ckpt.finalize(tmp, manifest, {rid: 3 for rid in files})


def test_a_resume_of_a_checkpoint_from_before_the_new_defaults_keeps_the_constant_rate(tmp_path):
    from actors.startup import find_resume_point

    old = _cfg(
        "train.rounds=40",
        "sync.outer_every=50",
        "optim.outer.lr=0.7",
        "optim.outer.momentum=0.9",
        "optim.inner.schedule=constant",
        "optim.inner.warmup_steps=0",
    )
    _checkpoint(tmp_path, old, with_schedule=False)
    cfg = _cfg("train.rounds=40", "sync.outer_every=50")
    point = find_resume_point(str(tmp_path), cfg, adopt=tuple(resolve(cfg, layout_of(cfg))))
    assert point.config_diff == ()
    assert (cfg.optim.inner.schedule, cfg.optim.inner.warmup_steps) == ("constant", 0)
    assert (cfg.optim.outer.lr, cfg.optim.outer.momentum) == (0.7, 0.9)


def test_a_resume_with_more_rounds_keeps_the_warmup_its_checkpoint_recorded(tmp_path):
    from actors.startup import find_resume_point

    first = _cfg("train.rounds=40", "sync.outer_every=50")
    resolve(first, layout_of(first))
    _checkpoint(tmp_path, first, with_schedule=True)
    cfg = _cfg("train.rounds=80", "sync.outer_every=50")
    assert resolve(cfg, layout_of(cfg))["optim.inner.warmup_steps"] == 200
    find_resume_point(
        str(tmp_path),
        cfg,
        adopt=("optim.outer.lr", "optim.outer.momentum", "optim.inner.schedule", "optim.inner.warmup_steps"),
    )
    assert (cfg.optim.inner.schedule, cfg.optim.inner.warmup_steps) == ("cosine", 100)
