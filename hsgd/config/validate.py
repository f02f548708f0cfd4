"""Validation of a resolved config: every rule the types cannot express, checked before any actor
starts; `validate(cfg)` raises a one-line `ConfigError`. Each field's range or choices come from the
schema's metadata (nan and inf refused everywhere).
"""

from __future__ import annotations

import configparser
import dataclasses
import functools
import math
import netrc
import os
import re
import typing
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hsgd.config.layout import RunLayout, layout_of
from hsgd.config.paths import output_path
from hsgd.config.rounds import steps_per_round
from hsgd.config.schema import ConfigError, HsgdConfig
from hsgd.config.sites import (
    MAX_STEP_S,
    MAX_STRAGGLE_FACTOR,
    check_padded_steps,
    check_site_ranks,
    check_sites,
)
from hsgd.core.phases import SUPERVISOR, Phase

# A random fault schedule is drawn in full at the run's start; beyond this many faults it is a typo.
MAX_RANDOM_FAULTS = 10_000


@dataclass(frozen=True)
class Bound:
    """What one numeric field may hold (schema.py `_ranged`): its type (an int is fine where a float
    is asked), [low, high] with an open end refused, null when `optional`, -1 when `forever`."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    forever: bool = False

    def problem(self, value: Any) -> str | None:
        """None when `value` is valid, else one line: 'got <value>; valid: <describe()>'."""
        ok = (value is None and self.optional) or (
            not isinstance(value, bool)
            and isinstance(value, int if self.kind is int else (int, float))
            and math.isfinite(value)
            and (
                (self.forever and value == -1)
                or (
                    (self.low is None or value > self.low or (value == self.low and not self.low_open))
                    and (self.high is None or value < self.high or (value == self.high and not self.high_open))
                )
            )
        )
        return None if ok else f"got {value!r}; valid: {self.describe()}"

    def describe(self) -> str:
        """The valid values in words, e.g. 'an int >= 0, or -1 for forever'."""
        text = "an int" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            text += (
                f" in {'(' if self.low_open else '['}{_number(self.low)}, "
                f"{_number(self.high)}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text += f" {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.forever:
            text += ", or -1 for forever"
        return f"null or {text}" if self.optional else text


def _number(x: float) -> str:
    return "2^63" if x == 2**63 else f"{x:g}"


def schema_fields(cls: type = HsgdConfig, prefix: str = ""):
    """(dotted path, annotated type, dataclasses.Field) of every leaf of the schema's dataclass tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name], f


def _numeric_bounds() -> dict[str, Bound]:
    bounds = {}
    for path, hint, f in schema_fields():
        args = set(typing.get_args(hint)) or {hint}
        kind = next((k for k in (int, float) if k in args), None)
        if kind is None:
            continue
        if "range" not in f.metadata:
            raise TypeError(
                f"{path}: a numeric schema field needs a range (hsgd/config/schema.py: count, seconds, ...)"
            )
        bounds[path] = Bound(kind, optional=type(None) in args, **f.metadata["range"])
    return bounds


# The run-wide pacing keys are bounded tighter than their schema ranges (issue 45), as a site's are
# (hsgd.config.sites): a step never padded past a day, a straggler at most 1000 steps long.
NUMERIC_FIELDS: dict[str, Bound] = {
    **_numeric_bounds(),
    "train.min_step_s": Bound(float, 0.0, MAX_STEP_S),
    "train.straggle_factor": Bound(float, 0.0, MAX_STRAGGLE_FACTOR),
}
# Fields that name one of a fixed set of values (None in the set: null is allowed).
CHOICE_FIELDS: dict[str, tuple] = {
    path: ((None,) if type(None) in typing.get_args(hint) else ()) + tuple(f.metadata["choices"])
    for path, hint, f in schema_fields()
    if "choices" in f.metadata
}


def field_value(cfg: HsgdConfig, path: str) -> Any:
    """The value at a dotted path, e.g. field_value(cfg, "optim.inner.lr")."""
    return functools.reduce(getattr, path.split("."), cfg)


def validate(cfg: HsgdConfig) -> None:
    """Check a resolved config (HsgdConfig or a DictConfig of the same shape). Raises ConfigError
    (one line) for the first problem found; returns None when the run may start."""
    for path, bound in NUMERIC_FIELDS.items():
        if (problem := bound.problem(field_value(cfg, path))) is not None:
            raise ConfigError(path, problem)
    for path, valid in CHOICE_FIELDS.items():
        _choice(path, field_value(cfg, path), valid)
    layout = _check_relations(cfg)
    _check_links(cfg)
    _check_faults(cfg, layout)
    _check_folders(cfg)
    from hsgd.train.task import resolve  # imports torch: only when a whole config is validated

    for path in ("model._target_", "data._target_", "loss._target_"):  # each must import to a callable
        resolve(field_value(cfg, path), path)
    _check_wandb_credentials(cfg.logging.wandb.mode)
    _check_data(cfg)


def _choice(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        shown = "|".join("null" if v is None else v for v in valid)
        raise ConfigError(name, f"unknown value {value!r}; valid: {shown}")


def _check_balance_time(s: Any, spr: int) -> None:
    """A round closed by the clock ends at a step known only at its close."""
    if s.fragment_delay:
        raise ConfigError(
            "sync.fragment_delay",
            f"is {s.fragment_delay} with sync.balance=time, where a round's last step is known only at its close; "
            "valid: 0, or sync.balance none | steps",
        )
    if s.min_round_steps > spr:
        raise ConfigError(
            "sync.min_round_steps",
            f"{s.min_round_steps} is above a round's {spr} steps (sync.outer_every / sync.fragments); "
            f"valid: 1 <= min_round_steps <= {spr}",
        )


def _check_fragment_delay(s: Any, spr: int) -> None:
    """The pseudo-gradient is taken `fragment_delay` steps before the round's end, where every
    member of a cluster holds the same params, and its all-reduce runs behind the remaining steps."""
    if s.outer == "none":
        raise ConfigError(
            "sync.fragment_delay",
            f"is {s.fragment_delay} but sync.outer is none: no outer all-reduce "
            f"to overlap; valid: 0 with sync.outer=none",
        )
    if s.fragment_delay >= spr:
        raise ConfigError(
            "sync.fragment_delay",
            f"{s.fragment_delay} is not below a round's {spr} steps "
            f"(sync.outer_every / sync.fragments); valid: 0 <= fragment_delay < {spr}",
        )
    if s.inner == "none":
        raise ConfigError(
            "sync.fragment_delay",
            f"is {s.fragment_delay} with sync.inner=none, where a cluster's members "
            f"agree only after the round's average; valid: 0 with inner none, or inner ddp | localsgd",
        )
    if s.inner == "localsgd" and s.fragment_delay % s.inner_every != 0:
        raise ConfigError(
            "sync.fragment_delay",
            f"{s.fragment_delay} is not a multiple of sync.inner_every="
            f"{s.inner_every}; localsgd members agree only at an average: valid: k * inner_every",
        )


def _check_relations(cfg: HsgdConfig) -> RunLayout:
    """The relations between fields; returns the run's layout, worked out once its sites and ranks are checked."""
    t, s, sup, w = cfg.topology, cfg.sync, cfg.supervisor, cfg.watchdog
    if t.cluster_labels and len(t.cluster_labels) != t.clusters:
        raise ConfigError(
            "topology.cluster_labels",
            f"has {len(t.cluster_labels)} labels; valid: one per cluster ({t.clusters}) or none",
        )
    if s.outer_every % s.fragments != 0:
        raise ConfigError(
            "sync.outer_every",
            f"{s.outer_every} is not a multiple of sync.fragments={s.fragments}; "
            f"valid: outer_every = k * fragments (a round is outer_every / fragments steps)",
        )
    spr = steps_per_round(cfg)
    if s.inner == "localsgd" and spr % s.inner_every != 0:
        raise ConfigError(
            "sync.outer_every",
            f"{s.outer_every} gives rounds of {spr} steps, not a multiple of "
            f"sync.inner_every={s.inner_every}; localsgd needs outer_every / fragments = k * inner_every",
        )
    if s.outer == "none" and (s.outer_compress != "none" or s.fragments > 1 or s.outer_path != "leader"):
        raise ConfigError(
            "sync.outer",
            "is none, so nothing crosses clusters to compress, fragment or shard; valid: "
            "sync.outer_compress=none, sync.fragments=1, sync.outer_path=leader with sync.outer=none",
        )
    if s.outer_exchange == "reduce_scatter" and s.outer_compress in ("none", "topk"):
        raise ConfigError(
            "sync.outer_exchange",
            f"reduce_scatter needs a codec whose chunks add up, not sync.outer_compress={s.outer_compress} "
            f"(none all-reduces, topk gathers); valid: bf16, int8 or int4, or outer_exchange auto or gather",
        )
    if s.fragment_delay:
        _check_fragment_delay(s, spr)
    if s.balance == "time":
        _check_balance_time(s, spr)
    if cfg.model.n_embd % cfg.model.n_head != 0:
        raise ConfigError("model.n_embd", f"{cfg.model.n_embd} is not divisible by model.n_head={cfg.model.n_head}")
    check_sites(cfg)
    check_padded_steps(cfg)
    check_site_ranks(cfg)
    layout = layout_of(cfg)
    _check_ranks(cfg, layout.ranks_per_replica)
    if not t.sites and sup.min_replicas_per_cluster > t.replicas_per_cluster:
        raise ConfigError(
            "supervisor.min_replicas_per_cluster",
            f"got {sup.min_replicas_per_cluster}; "
            f"valid: in [1, topology.replicas_per_cluster={t.replicas_per_cluster}]",
        )
    clusters = len(t.sites) or t.clusters
    if sup.min_clusters > clusters:
        raise ConfigError(
            "supervisor.min_clusters",
            f"got {sup.min_clusters}; valid: in [1, "
            f"{'the number of topology.sites' if t.sites else 'topology.clusters'}={clusters}]",
        )
    if w.ceiling_s < w.floor_s:
        raise ConfigError("watchdog.ceiling_s", f"got {w.ceiling_s}; valid: >= watchdog.floor_s={w.floor_s}")
    return layout


def _check_ranks(cfg: HsgdConfig, k: int) -> None:
    """A replica of k ranks (topology.gpus_per_replica, issue 34): one k for every cluster, its batch
    split evenly over its ranks, and the sharded outer path not yet generalised to shards of replicas.
    The per-node device count is checked against k where the nodes are known (hsgd.config.capacity)."""
    if k == 1:
        return
    if cfg.sync.outer_path == "sharded":
        raise ConfigError(
            "sync.outer_path",
            f"sharded is not supported with topology.gpus_per_replica={k} (each rank "
            f"already holds one shard of the replica); valid: leader with gpus_per_replica > 1, or "
            f"sharded with gpus_per_replica=1",
        )
    if cfg.data.batch_size % k != 0:
        raise ConfigError(
            "data.batch_size",
            f"{cfg.data.batch_size} sequences per replica do not split over "
            f"topology.gpus_per_replica={k} ranks; valid: a multiple of {k}",
        )


def _check_links(cfg: HsgdConfig) -> None:
    """A latency without a simulated link's gbps would be silently ignored; a link slower than
    comm.min_gbps would outlast the deadlines scaled at it (its sleep is outside each collective's)."""
    for level in ("outer", "inner"):
        link, name = getattr(cfg.links, level), f"links.{level}"
        if link.gbps == 0:
            for key in ("latency_ms", "jitter_ms"):
                if getattr(link, key) > 0:
                    raise ConfigError(
                        f"{name}.{key}",
                        f"{getattr(link, key):g} has no effect with {name}.gbps=0 "
                        f"(no simulated link); valid: 0, or set {name}.gbps > 0",
                    )
        elif link.gbps < cfg.comm.min_gbps:
            raise ConfigError(
                f"{name}.gbps",
                f"{link.gbps:g} is below comm.min_gbps={cfg.comm.min_gbps:g}, the slowest "
                f"link every deadline assumes; valid: 0 (off) or >= comm.min_gbps (lower comm.min_gbps "
                f"to simulate a slower link)",
            )


def _check_faults(cfg: HsgdConfig, layout: RunLayout) -> None:
    """Random mode's size and kinds, and the explicit schedule's grammar and moments, so a typo
    fails before any actor starts."""
    from hsgd.core.faults import FAULT_KINDS, parse_schedule, topology_shape

    f, spr = cfg.faults, layout.steps_per_round
    for kind in f.kinds:
        _choice("faults.kinds", kind, FAULT_KINDS)
    if f.mtbf_s > 0:
        if not f.kinds:
            raise ConfigError(
                "faults.kinds", f"is empty but faults.mtbf_s={f.mtbf_s}; valid: at least one of {'|'.join(FAULT_KINDS)}"
            )
        # the schedule is drawn whole at the start (hsgd/core/faults.py random_schedule): bound its size
        run_s = cfg.train.rounds * spr * f.step_s
        expected, smallest = run_s / f.mtbf_s, run_s / MAX_RANDOM_FAULTS
        if expected > MAX_RANDOM_FAULTS:
            raise ConfigError(
                "faults.mtbf_s",
                f"got {f.mtbf_s:g}: about {expected:.3g} random faults over the "
                f"run's {run_s:g} s (train.rounds * sync.outer_every * faults.step_s); "
                f"valid: 0 (off) or >= {smallest:g} (at most {MAX_RANDOM_FAULTS} faults)",
            )
    specs = parse_schedule(list(f.schedule), **topology_shape(layout.topology))
    for i, spec in enumerate(specs):  # a fault that can never fire is a typo, not a plan
        if spec.round >= cfg.train.rounds:
            raise ConfigError(
                f"faults.schedule[{i}].round",
                f"{spec.round} is past the run's last round "
                f"(train.rounds={cfg.train.rounds}); valid: 0..{cfg.train.rounds - 1}",
            )
        if spec.phase.startswith("inner") and spec.step >= spr:
            raise ConfigError(
                f"faults.schedule[{i}].step",
                f"{spec.step} is past the round's last step "
                f"(a round is {spr} steps: sync.outer_every / sync.fragments); "
                f"valid: 0..{spr - 1}",
            )
        if (problem := unfirable_reason(spec, cfg, spr)) is not None:
            raise ConfigError(f"faults.schedule[{i}].{problem[0]}", problem[1])


def _check_folders(cfg: HsgdConfig) -> None:
    """A run folder of its own: never a filesystem root or the home folder (a run writes and prunes
    there). Whether an existing folder belongs to another run is the driver's check (run lock)."""
    for path in ("run.dir", "run.sweep_dir"):
        raw = str(field_value(cfg, path)).strip()
        if not raw:
            raise ConfigError(path, "is empty; valid: a folder path (relative or absolute)")
        folder = os.path.realpath(output_path(raw))
        if os.path.dirname(folder) == folder or folder == os.path.realpath(os.path.expanduser("~")):
            what = "the home folder" if os.path.dirname(folder) != folder else "a filesystem root"
            raise ConfigError(path, f"{raw!r} is {what}; valid: a folder of the run's own, e.g. outputs/<name>")
    where = cfg.checkpoint.dir
    if where is not None and (not isinstance(where, str) or not where.strip()):
        raise ConfigError(
            "checkpoint.dir",
            f"got {where!r}; valid: null (<run.dir>/checkpoints), "
            "a folder path or an fsspec URL (file://, s3://, gs://, ...)",
        )


def _check_wandb_credentials(mode: str) -> None:
    """Online logging without credentials fails late, in the supervisor: refuse it here, looking
    where wandb looks for an API key or identity token (the environment, netrc, wandb's settings
    file), without the network (no check that it is accepted)."""
    if mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    settings = configparser.ConfigParser()
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb"
    try:
        settings.read(os.path.join(os.path.expanduser(config_dir), "settings"))
        key = settings.get("default", "api_key", fallback="")
    except configparser.Error:
        key = ""
    if (entry and entry[2]) or key:
        return
    raise ConfigError(
        "logging.wandb.mode",
        "online needs W&B credentials and none were found (no WANDB_API_KEY, "
        f"no key for {host} in the netrc file or wandb settings); valid: offline|disabled, "
        "or set WANDB_API_KEY as a secret (docs/operations.md, wandb)",
    )


def _check_data(cfg: HsgdConfig) -> None:
    """Test-load the corpus (or the plug-in data) here, so a bad file is one line now instead of
    every replica dying in its constructor later."""
    from hsgd.train.data import check_data  # imports torch: only when a whole config is validated

    try:
        check_data(cfg)
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        message = _one_line(err)  # the data module's style: 'data.path=...: problem'
        found = re.match(r"([a-z_]+(?:\.[a-z_]+)+)\s*[=:]\s*", message)
        raise ConfigError(*((found.group(1), message[found.end() :]) if found else ("data.path", message))) from None
    except Exception as err:  # noqa: BLE001 — a plug-in data factory may fail in any way
        raise ConfigError(
            "data._target_", f"test-loading the data failed ({type(err).__name__}: {_one_line(err)})"
        ) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:400] or type(err).__name__


def unfirable_reason(spec, cfg: HsgdConfig, spr: int) -> tuple[str, str] | None:
    """(field, one-line reason) when a scheduled fault's moment never comes in this config: a drill
    must not "pass" a failure that never happened."""
    s, t = cfg.sync, cfg.topology
    if spec.target_kind == "supervisor" and spec.phase not in Phase.having(SUPERVISOR):
        return (
            "phase",
            f"the supervisor has no {str(spec.phase)!r} phase; valid for it: {'|'.join(Phase.having(SUPERVISOR))}",
        )
    if spec.phase == "checkpoint":
        every, rounds = cfg.checkpoint.every, cfg.train.rounds
        saved = [r for r in range(rounds) if every and ((r + 1) % every == 0 or r + 1 == rounds)]
        if spec.round not in saved:
            shown = ", ".join(map(str, saved[:6])) + (", ..." if len(saved) > 6 else "")
            return "phase", (
                f"checkpoint never happens in round {spec.round} (checkpoint.every={every} saves after "
                f"rounds {shown or 'none'}); valid rounds for checkpoint: {shown or 'none'}"
            )
    if spec.phase == Phase.INNER_SYNC:
        if s.inner == "none" and t.replicas_per_cluster == 1:
            return (
                "phase",
                "inner_sync never happens with sync.inner=none and one replica per cluster; "
                "valid: inner|outer|outer_commit|checkpoint",
            )
        if s.inner == "localsgd" and (spec.step + 1) % s.inner_every != 0:
            steps = [k for k in range(spr) if (k + 1) % s.inner_every == 0]
            return "step", (
                f"localsgd syncs after steps {', '.join(map(str, steps[:6]))}{', ...' if len(steps) > 6 else ''} "
                f"(sync.inner_every={s.inner_every}); inner_sync at step {spec.step} never happens"
            )
        if s.inner == "none" and spec.step != 0:
            return "step", "with sync.inner=none the cluster average happens once, at the round's end; use step 0"
    return None  # outer and outer_commit happen in every round, whatever the algorithm
