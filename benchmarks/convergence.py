"""Convergence benchmark: `python -m benchmarks convergence [--model small] [--steps 2000] [--quick]
[--arms a,b] [--at bench|defaults|both] [--flat-lrs 1.5e-3,3e-3,6e-3] [--batch-size 32]
[--outer-lr 1.0 --outer-momentum 0.3] [--wan-runs flat_ddp,diloco_h100] [--out DIR] [--set key=value ...]`.

Issue 22, Acceptance 3: how far each way of syncing across the slow link falls behind flat DDP for
how many fewer bytes over that link. One invocation, one embedded Ray, the arms run one after
another through the real system (`actors.launch.run_training`, as the default suite, benchmarks/cli.py, does). Every arm
has the same model, batch, seed (so the same initial params and the same tokens: a batch is a pure
function of seed, global replica index and step) and the same number of inner steps per replica
(`train.rounds` x steps per round = `--steps`, checked on each arm's composed config), on
2 clusters x 2 replicas (4 replicas):

- `flat_ddp`: one cluster of all 4 replicas, ddp every step, `sync.outer=average` (a no-op
  across one cluster): what a flat trainer does when one group spans both sites;
- `localsgd_h<H>`: hierarchical local SGD — ddp inside each cluster, the clusters' params averaged
  every H steps (`sync.outer=average`: DiLoCo's outer step with lr 1 and no momentum). Not
  `sync.inner=localsgd`, which averages *inside* a cluster and crosses no slow link;
- `localsgd_h<H>_int4`: the same, the averaged update crossing as int4 with error feedback;
- `diloco_h<H>`: ddp inside, DiLoCo (Nesterov outer step: `--outer-lr` 1.0, `--outer-momentum` 0.3,
  see `common_overrides`) every H steps, fp32;
- `diloco_h<H>_<codec>`: the same with `sync.outer_compress` bf16 | int8 | int4 | topk (1 %),
  error feedback on;
- `diloco_h<H>_frag<F>`: Streaming DiLoCo, F fragments synced in turn (a round is H/F steps,
  `sync.fragment_alpha=0`);
- `diloco_h<H>_sharded`: `sync.outer_path=sharded` (every member exchanges a shard);
- `diloco_h<H>_delay<tau>`: overlap, fp32, 1 fragment: the pseudo-gradient is taken tau inner steps
  before the round's end and the outer all-reduce runs behind those last tau steps
  (`sync.fragment_delay=tau`), the synced params merged with `sync.fragment_alpha=0.5` (Streaming
  DiLoCo's mixing, which its paper found to help under a delay); tau = 5 (the paper's for H=100);
- `diloco_h<H>_streaming` (full only): the combination Streaming DiLoCo reports: 4 fragments (a
  round is H/4 steps), `sync.fragment_delay=5`, `sync.fragment_alpha=0.5`, `sync.outer_compress=int4`;
- `torchft_diloco_h<H>` (a peer, in the default list when torchft is importable; `peer_arms`):
  torchft 0.2.0's `torchft.local_sgd.DiLoCo` (its Manager, a LighthouseServer, its outer optimizer: torch SGD with
  Nesterov momentum at the invocation's `--outer-lr` / `--outer-momentum`) on the config the
  `diloco_h<H>` arm composes: the same model, seed, batches (rank r of group g reads hsgd replica
  c{g}r{r}'s), inner optimizer and schedule, H and inner steps; 2 replica groups of 2 processes,
  torch DDP over gloo inside each, fp32 (torchft's quantization needs triton). It runs outside Ray
  (benchmarks/peers/torchft_diloco.py). Its slow-link bytes are what every rank hands to torchft's
  cross-group all-reduce (`torchft.manager.Manager.allreduce`), summed: under DDP each rank sends the whole
  pseudo-gradient, so 4 senders per outer step where hsgd's leader path has 2. Its eval loss is
  hsgd's evaluation (the same batches and loss as `hsgd.train.trainer.ReplicaTrainer.eval_loss`) of the final global
  params, computed in the peer. `hsgd_diloco_vs_torchft_diloco` (JSON, table footer): the eval loss of
  `diloco_h<H>` (codec none) / that of `torchft_diloco_h<H>`, both of the same invocation (< 1: hsgd ends lower).
Every arm sets every `sync.*` key it varies (`fragment_delay` 0 and `fragment_alpha` 0 where unused).
Every arm trains with the same inner schedule: warmup over 5 % of the steps, then cosine decay
(`schedule_overrides`; `--set optim.inner.schedule=constant` for a constant rate).

At the bench's settings or at the config's defaults (`--at`, issue 33 Build 4; default `bench`):
- `bench`: every arm on `common_overrides` (the bench's batch, inner schedule and DiLoCo outer step);
- `defaults`: every arm, named `<arm>@defaults`, on `defaults_overrides`: only what makes the arms
  comparable — model, seed, `train.eval_batches`, and each arm's own overrides (topology, `sync.*`,
  `train.rounds`, the eval cadence) — and `--set`; no `data.batch_size`, no schedule, no
  `optim.outer.*`: the per-replica batch, the inner schedule and warmup, and the outer step (auto:
  hsgd/config/auto.py) are what a user who sets nothing gets;
- `both`: the bench arms, then the same arms at the defaults; each is compared with flat DDP of its
  own kind (`diloco_h50@defaults` with `flat_ddp@defaults`), never across kinds.
The torchft peer runs at whichever kind(s) `--at` names, each on the config of hsgd's `diloco_h<H>`
of the same kind: `torchft_diloco_h<H>` on the bench's outer step, `torchft_diloco_h<H>@defaults` on
the outer step hsgd resolves for that config (`hsgd.config.auto.outer_step_of`, the same the peer
reads), so the ratio compares like with like: `hsgd_diloco_vs_torchft_diloco` keys `<H>` (bench) and
`<H>@defaults`.

Flat DDP at its best inner rate (`--flat-lrs 1.5e-3,3e-3,6e-3`; default: none, flat DDP at the
config's rate only): `flat_ddp` runs once more per `optim.inner.lr` given, as `flat_ddp_lr<lr>`
(a rate equal to the one every arm trains with is `flat_ddp` itself, not run twice), at each kind
`--at` names. The best (`flat_best`, JSON and table footer) is the flat run of the kind with the
lowest final eval loss; every arm's row gives its gap against flat DDP at the arm's own rate (`gap`,
`flat_ddp`) and against flat DDP at its best rate (`gap_vs_best_flat`), so the baseline is not a
strawman. The other arms are not swept: they train at the config's (or `--set`'s) rate.

What is counted as slow-link bytes (`slow_link_bytes`), from the run's metrics.jsonl:
- hierarchical arms: the sum over committed rounds of `outer_bytes`, which is the sum over every
  member that sent on the outer level that round (each cluster's leader on the `leader` path,
  every shard holder on the `sharded` path) of the bytes its outer group counted as sent: an
  uncompressed all-reduce counts its fp32 payload once per member, a codec's all-gather counts
  the encoded payload x (clusters - 1) per member (what a ring all-gather sends). Inner traffic
  (ddp, the commit's broadcast inside a cluster) is not counted: it stays inside a site.
- `flat_ddp`: the sum of `inner_bytes` (every member's gradient all-reduce payload, once per
  member and step, plus the commit's broadcast inside the one cluster), all of which crosses
  between the sites because the one cluster spans them — exactly as the default suite counts it.
Gap = (final eval loss - flat_ddp's) / flat_ddp's; ratio = flat_ddp's slow-link bytes / the arm's.
Target (the issue's): ratio >= 500 at gap <= 2 %.

Wall-clock: `wall_s` is the run's own (summary.json `wall_s`, from the supervisor's start to the
end). Under a simulated slow link (`--gbps`, `--latency-ms`; default 1 Gb/s, 50 ms) two figures:
- measured (`wan_wall_s`): the arms named in `--wan-runs` run a second time with the link
  simulated by hsgd itself (`links.outer.*` for hierarchical arms; `links.inner.*` for flat_ddp,
  whose every step crosses it), right after their plain run;
- modeled (`wan_wall_s_modeled`), for every arm: `wall_s` + the modeled link time
  (`modeled_link_s`): per slow-link collective one latency, plus each member's bytes at the link's
  rate (members send at once, so a collective costs its largest member's share: the arm's
  slow-link bytes / the members sending). Hierarchical: one outer collective per round.
  flat_ddp: one gradient all-reduce per step plus the commit's broadcast per round. An arm with a
  delay tau (`sync.fragment_delay`) hides each round's outer collective behind its last tau inner
  steps: per round it adds max(0, latency + that round's share of the bytes (the arm's slow-link
  bytes / rounds, evenly) at the link's rate - tau x step_s), step_s = `wall_s` / the arm's inner
  steps. An upper bound: it ignores that a real overlapped ddp all-reduce hides behind backward,
  and it adds the link on top of the local transfer it replaces.

Writes `<out>/convergence.json` (benchmarks/report.py's header — suite, date, machine, command,
quick — then arms, per-run results, rows, `flat_best`; BENCHMARKS.md's convergence section is
rendered from it), `<out>/convergence.md` (the table, also printed), `<out>/convergence.png` (final
eval loss vs slow-link bytes, log x, one labelled point per arm, the <= 2 % gap band shaded, the
500x-fewer-bytes line marked) and `<out>/convergence_curves.png` (per arm, eval loss at each
evaluation vs tokens trained and vs cumulative slow-link bytes: `eval_points`). One progress line
per arm as it ends. An arm that fails is recorded (status, error) and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]
CLUSTERS, REPLICAS_PER_CLUSTER = 2, 2
TARGET_RATIO, TARGET_GAP = 500.0, 0.02
CODECS = ("bf16", "int8", "int4", "topk")
TOPK_DENSITY = 0.01
DELAY, DELAY_ALPHA = 5, 0.5  # Streaming DiLoCo's tau (for H=100) and mixing weight of the local copy
STREAMING_FRAGMENTS = 4
BATCH_SIZE, QUICK_BATCH_SIZE = 32, 8  # sequences per replica and step (data.batch_size), every arm
OUTER_LR, OUTER_MOMENTUM = 1.0, 0.3  # the DiLoCo arms' outer step, for tens of outer steps (common_overrides)


@dataclass(frozen=True)
class Arm:
    """One way of training the same tokens: its name, a line saying what it is, the overrides
    that make it (on top of the invocation's common ones), and its round geometry."""

    name: str
    what: str
    hierarchical: bool  # slow-link bytes are outer_bytes (else: one cluster spanning the sites, inner_bytes)
    steps_per_round: int
    rounds: int
    senders: int  # members sending on the slow link in each of its collectives (modeled WAN)
    overrides: tuple[str, ...] = field(default=())
    delay: int = 0  # inner steps the outer exchange hides behind (sync.fragment_delay)
    peer: str = ""  # "" = hsgd through Ray; "torchft_diloco" = benchmarks/peers/torchft_diloco.py
    at: str = "bench"  # "bench": on common_overrides; "defaults": on defaults_overrides (the config's defaults)
    inner_lr: float | None = None  # flat DDP's sweep (`--flat-lrs`): its optim.inner.lr; None = the config's


def _sync(
    outer: str,
    every: int,
    *,
    compress: str = "none",
    fragments: int = 1,
    path: str = "leader",
    delay: int = 0,
    alpha: float = 0.0,
) -> list[str]:
    # every sync key set on every arm: no arm inherits a default another arm overrides
    return [
        "sync.inner=ddp",
        f"sync.outer={outer}",
        f"sync.outer_every={every}",
        f"sync.outer_compress={compress}",
        f"sync.outer_topk={TOPK_DENSITY}",
        f"sync.fragments={fragments}",
        f"sync.fragment_alpha={alpha}",
        f"sync.fragment_delay={delay}",
        f"sync.outer_path={path}",
    ]


def main_every(quick: bool, every: int | None = None) -> int:
    """The H of the main DiLoCo arm, and of the LocalSGD, codec, fragment, sharded, delay and
    streaming arms: `every` when given (`--every`), else 100 (50 quick)."""
    return every if every else 50 if quick else 100


def plan_arms(steps: int, *, quick: bool = False, every: int | None = None) -> list[Arm]:
    """The arms of one invocation, each `steps` inner steps per replica. Full: flat DDP, LocalSGD
    at H=100, DiLoCo at H = 50, 100, 250, DiLoCo H=100 with each codec, with 4 fragments, on the
    sharded path, with a delay of 5 steps (alpha 0.5), and Streaming DiLoCo's combination (4
    fragments, delay 5, alpha 0.5, int4). Quick (a smoke run): H=50, one codec (int4), 2 fragments,
    sharded, delay 5; no streaming combination. `every` moves the main H (the extra DiLoCo arms stay
    at 50 and 250). Raises ValueError when `steps` is not a whole number of rounds for some arm."""
    every = main_every(quick, every)
    others, fragments = ((), 2) if quick else ((50, 250), 4)
    codecs = ("int4",) if quick else CODECS
    n = CLUSTERS * REPLICAS_PER_CLUSTER
    hier = [f"topology.clusters={CLUSTERS}", f"topology.replicas_per_cluster={REPLICAS_PER_CLUSTER}"]
    # (name, what, hierarchical, H, fragments, senders, overrides, delay)
    specs = [
        (
            "flat_ddp",
            f"1 cluster x {n} replicas, ddp every step",
            False,
            every,
            1,
            n,
            ["topology.clusters=1", f"topology.replicas_per_cluster={n}"] + _sync("average", every),
            0,
        ),
        (
            f"localsgd_h{every}",
            f"ddp inside, params averaged across clusters every {every} steps",
            True,
            every,
            1,
            CLUSTERS,
            hier + _sync("average", every),
            0,
        ),
        (
            f"localsgd_h{every}_int4",
            f"as localsgd_h{every}, the averaged update sent as int4 + error feedback",
            True,
            every,
            1,
            CLUSTERS,
            hier + _sync("average", every, compress="int4"),
            0,
        ),
    ]
    for h in sorted({every, *others}):
        specs.append(
            (
                f"diloco_h{h}",
                f"ddp inside, DiLoCo every {h} steps, fp32",
                True,
                h,
                1,
                CLUSTERS,
                hier + _sync("diloco", h),
                0,
            )
        )
    for codec in codecs:
        label = f"topk{TOPK_DENSITY * 100:g}" if codec == "topk" else codec
        what = f"top-{TOPK_DENSITY:.0%} (bf16 values + int16 indices)" if codec == "topk" else codec
        specs.append(
            (
                f"diloco_h{every}_{label}",
                f"DiLoCo every {every}, {what} + error feedback",
                True,
                every,
                1,
                CLUSTERS,
                hier + _sync("diloco", every, compress=codec),
                0,
            )
        )
    specs.append(
        (
            f"diloco_h{every}_frag{fragments}",
            f"Streaming DiLoCo every {every}, {fragments} fragments in turn",
            True,
            every,
            fragments,
            CLUSTERS,
            hier + _sync("diloco", every, fragments=fragments),
            0,
        )
    )
    specs.append(
        (
            f"diloco_h{every}_sharded",
            f"DiLoCo every {every}, sharded outer path (every member a shard)",
            True,
            every,
            1,
            n,
            hier + _sync("diloco", every, path="sharded"),
            0,
        )
    )
    specs.append(
        (
            f"diloco_h{every}_delay{DELAY}",
            f"DiLoCo every {every}, fp32, outer all-reduce behind the last {DELAY} steps, alpha {DELAY_ALPHA:g}",
            True,
            every,
            1,
            CLUSTERS,
            hier + _sync("diloco", every, delay=DELAY, alpha=DELAY_ALPHA),
            DELAY,
        )
    )
    if not quick:
        f = STREAMING_FRAGMENTS
        specs.append(
            (
                f"diloco_h{every}_streaming",
                f"Streaming DiLoCo every {every}: {f} fragments, delay {DELAY}, alpha {DELAY_ALPHA:g}, int4",
                True,
                every,
                f,
                CLUSTERS,
                hier + _sync("diloco", every, compress="int4", fragments=f, delay=DELAY, alpha=DELAY_ALPHA),
                DELAY,
            )
        )
    arms = []
    for name, what, hierarchical, h, f, senders, overrides, delay in specs:
        spr = h // f
        if steps % spr:
            raise ValueError(f"--steps {steps} is not a whole number of {spr}-step rounds for arm {name}")
        arms.append(
            Arm(
                name,
                what,
                hierarchical,
                spr,
                steps // spr,
                senders,
                tuple(overrides) + (f"train.rounds={steps // spr}",),
                delay,
            )
        )
    return arms


PEER_PREFIX = "torchft_diloco_h"


def torchft_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchft") is not None


def peer_arms(steps: int, *, quick: bool = False, every: int | None = None) -> list[Arm]:
    """The peer arms: `torchft_diloco_h<H>` at the main H, on exactly the overrides of hsgd's
    `diloco_h<H>` (2 x 2, DiLoCo every H, fp32, leader path: the peer reads what it reproduces
    from them). Every rank of both groups sends on the slow link (senders 4). Raises ValueError
    when `steps` is not a whole number of H-step rounds."""
    h = main_every(quick, every)
    if steps % h:
        raise ValueError(f"--steps {steps} is not a whole number of {h}-step rounds for arm {PEER_PREFIX}{h}")
    hier = [f"topology.clusters={CLUSTERS}", f"topology.replicas_per_cluster={REPLICAS_PER_CLUSTER}"]
    return [
        Arm(
            f"{PEER_PREFIX}{h}",
            f"torchft 0.2.0 DiLoCo every {h} steps, fp32: Manager + Lighthouse, "
            f"{CLUSTERS} groups x {REPLICAS_PER_CLUSTER} ranks, torch DDP inside",
            True,
            h,
            steps // h,
            CLUSTERS * REPLICAS_PER_CLUSTER,
            tuple(hier + _sync("diloco", h)) + (f"train.rounds={steps // h}",),
            0,
            "torchft_diloco",
        )
    ]


def peer_ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Per H and kind where both ran: hsgd's `diloco_h<H>` (codec none) final eval loss / torchft's
    `torchft_diloco_h<H>`, of the same invocation and the same kind (`@defaults` with `@defaults`:
    keyed `<H>@defaults`; the bench's keyed `<H>`); runs under the simulated link (`@wan`) are not
    compared. Ratio None when either has no loss."""
    out = {}
    for name, r in results.items():
        base, _, kind = name.partition("@")
        if not base.startswith(PEER_PREFIX) or kind not in ("", "defaults"):
            continue
        suffix = f"@{kind}" if kind else ""
        h = base[len(PEER_PREFIX) :]
        hsgd = results.get(f"diloco_h{h}{suffix}")
        if hsgd is None:
            continue
        a, b = hsgd.get("final_eval_loss"), r.get("final_eval_loss")
        out[h + suffix] = {
            "hsgd_arm": f"diloco_h{h}{suffix}",
            "torchft_arm": name,
            "hsgd_eval_loss": a,
            "torchft_eval_loss": b,
            "hsgd_slow_link_bytes": hsgd.get("slow_link_bytes"),
            "torchft_slow_link_bytes": r.get("slow_link_bytes"),
            "ratio": a / b if a is not None and b else None,
        }
    return out


AT = ("bench", "defaults")  # `--at` kinds, in the order they run
DEFAULTS = "@defaults"  # an arm's name at the config's defaults: <arm>@defaults
FLAT = "flat_ddp"


def suffix_of(at: str) -> str:
    """The name suffix of an arm of kind `at`: "" (bench) or "@defaults"."""
    return DEFAULTS if at == "defaults" else ""


def at_kinds(at: str) -> list[str]:
    """`--at bench|defaults|both` as the kinds to run, in order."""
    return list(AT) if at == "both" else [at]


def at_defaults(arm: Arm) -> Arm:
    """The arm at the config's defaults: its own overrides (what makes it this arm: topology,
    `sync.*`, rounds, a sweep's inner rate), run on `defaults_overrides`, named `<name>@defaults`."""
    return replace(arm, name=arm.name + DEFAULTS, what=f"{arm.what}; at the config's defaults", at="defaults")


def expand_at(arms: list[Arm], at: str) -> list[Arm]:
    """The arms at each kind `--at` names: the bench's as planned, then each at the defaults."""
    return [a if kind == "bench" else at_defaults(a) for kind in at_kinds(at) for a in arms]


def lr_label(lr: float) -> str:
    """An inner rate as arm names and tables write it: 6e-3, 1.5e-3, 0.1 -> 1e-1."""
    mantissa, exponent = f"{lr:.3e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def flat_lr_arms(flat: Arm, lrs: Sequence[float], own_lr: float) -> list[Arm]:
    """Flat DDP once per inner rate of `--flat-lrs`: `flat_ddp_lr<lr>`, `flat`'s overrides with
    `optim.inner.lr=<lr>` last (so it wins over `--set`). A rate equal to `own_lr`, the one every
    arm trains with, is `flat` itself and is not run twice; repeated rates run once."""
    out, seen = [], {float(own_lr)}
    for lr in lrs:
        if float(lr) in seen:
            continue
        seen.add(float(lr))
        out.append(
            replace(
                flat,
                name=f"{flat.name}_lr{lr_label(lr)}",
                what=f"{flat.what}, inner lr {lr_label(lr)}",
                overrides=tuple(flat.overrides) + (f"optim.inner.lr={lr!r}",),
                inner_lr=float(lr),
            )
        )
    return out


def invocation_arms(arms: list[Arm], *, at: str, flat_lrs: Sequence[float] = (), own_lr: float = 0.0) -> list[Arm]:
    """The arms one invocation runs, in order: `arms` with flat DDP's sweep (`flat_lr_arms`) right
    after `flat_ddp`, at each kind `--at` names (`expand_at`). ValueError when rates are given
    without flat_ddp among `arms`."""
    arms = list(arms)
    if flat_lrs:
        flat = next((a for a in arms if a.name == FLAT), None)
        if flat is None:
            raise ValueError("--flat-lrs sweeps flat_ddp: name it in --arms")
        i = arms.index(flat) + 1
        arms[i:i] = flat_lr_arms(flat, flat_lrs, own_lr)
    return expand_at(arms, at)


def best_flat(arms: list[Arm], results: dict[str, dict], at: str) -> dict | None:
    """Flat DDP of kind `at` at its best inner rate: of the flat arms (flat_ddp and its `--flat-lrs`
    sweep) with a final eval loss, the lowest; with every rate tried (`rates`, lr -> eval loss).
    None when none has a loss."""
    tried = []
    for arm in arms:
        r = results.get(arm.name)
        if arm.hierarchical or arm.peer or arm.at != at or r is None:
            continue
        lr = arm.inner_lr if arm.inner_lr is not None else r.get("inner_lr")
        tried.append({"arm": arm.name, "inner_lr": lr, "final_eval_loss": r.get("final_eval_loss")})
    done = [t for t in tried if t["final_eval_loss"] is not None]
    if not done:
        return None
    return {**min(done, key=lambda t: t["final_eval_loss"]), "rates": tried}


def _lr(lr: float | None) -> str:
    return "-" if lr is None else lr_label(lr)


def flat_best_md(bests: dict[str, dict]) -> str:
    """The table's footer: flat DDP's best rate per kind, and every rate it tried (empty without a sweep)."""
    lines = []
    for at, b in bests.items():
        if len(b["rates"]) < 2:
            continue
        tried = ", ".join(f"{_lr(t['inner_lr'])}: {_fmt(t['final_eval_loss'], '.4f')}" for t in b["rates"])
        lines.append(
            f"flat DDP's best inner rate ({at}): {b['arm']}, lr {_lr(b['inner_lr'])}, eval loss "
            f"{_fmt(b['final_eval_loss'], '.4f')} (tried lr: eval loss {tried})"
        )
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def ratios_md(ratios: dict[str, dict]) -> str:
    """The table's footer: a line per H with both arms (empty without)."""
    lines = [
        f"hsgd_diloco_vs_torchft_diloco (H={h}): {c['hsgd_arm']} {_fmt(c['hsgd_eval_loss'], '.4f')} / "
        f"{c['torchft_arm']} {_fmt(c['torchft_eval_loss'], '.4f')} = {_fmt(c['ratio'], '.4f')} "
        f"(eval loss; < 1: hsgd ends lower)"
        for h, c in ratios.items()
    ]
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def schedule_overrides(steps: int) -> list[str]:
    """The inner learning rate every arm trains with, as a run of `steps` steps is trained: linear
    warmup over the first 5 % of the steps, then cosine decay to a tenth (DiLoCo's and nanoGPT's
    shape; the config's default too since issue 33). A constant rate (the old default) leaves the clusters'
    models far apart at the end and the comparison says more about the rate than the sync. `--set` overrides it."""
    return ["optim.inner.schedule=cosine", f"optim.inner.warmup_steps={max(1, steps // 20)}"]


def common_overrides(
    *,
    model: str,
    seed: int,
    eval_batches: int,
    steps: int,
    batch_size: int,
    outer_lr: float,
    outer_momentum: float,
    extra: list[str] = (),
) -> list[str]:
    """The overrides every arm of one invocation shares: model, seed, batch, eval size, the inner
    schedule (`schedule_overrides`) and the DiLoCo arms' outer step; `extra` (`--set`) last, so it wins.

    The batch (`data.batch_size` sequences per replica and step, `--batch-size`) is the same in every
    arm, so every arm trains on the same tokens; each cluster steps on half of flat DDP's batch. The
    outer step (`optim.outer.*`, read by `sync.outer=diloco` only; `average` is lr 1, no momentum):
    DiLoCo's lr 0.7 with Nesterov momentum 0.9 is tuned for thousands of outer steps, and a run of
    2,000 steps at H = 100 has 20; lr 1.0 with momentum 0.3 was the best of seven settings at
    `--model tiny`, 1,000 steps, H = 100, int4 (README "Benchmarks")."""
    return [
        f"model={model}",
        f"seed={seed}",
        f"train.eval_batches={eval_batches}",
        f"data.batch_size={batch_size}",
        *schedule_overrides(steps),
        f"optim.outer.lr={outer_lr:g}",
        f"optim.outer.momentum={outer_momentum:g}",
        *extra,
    ]


def defaults_overrides(*, model: str, seed: int, eval_batches: int, extra: list[str] = ()) -> list[str]:
    """The overrides every arm at the config's defaults (`--at defaults`) shares: only what makes the
    arms comparable — model, seed, eval size — and `extra` (`--set`) last. No batch, no inner schedule
    or warmup, no outer step: the config's defaults (hsgd/config/auto.py resolves the nulls per run)."""
    return [f"model={model}", f"seed={seed}", f"train.eval_batches={eval_batches}", *extra]


def arm_overrides(arm: Arm, common: list[str], *, eval_every_steps: int) -> list[str]:
    """Every override of one arm's run: the common ones, its own, and its eval cadence (every
    `eval_every_steps` inner steps when that is a whole number of its rounds, else at the end only)."""
    every = (
        eval_every_steps // arm.steps_per_round
        if eval_every_steps and not eval_every_steps % arm.steps_per_round
        else arm.rounds
    )
    return list(common) + list(arm.overrides) + [f"train.eval_every={max(1, every)}"]


def link_overrides(arm: Arm, gbps: float, latency_ms: float) -> list[str]:
    """The simulated slow link: between clusters for a hierarchical arm; for flat DDP its one
    cluster spans the sites, so the inner level is the slow link."""
    level = "outer" if arm.hierarchical else "inner"
    return [f"links.{level}.gbps={gbps:g}", f"links.{level}.latency_ms={latency_ms:g}"]


def slow_link_bytes(arm: Arm, metrics: list[dict]) -> int:
    """Bytes over the slow link in a run (see the module docstring for what is counted)."""
    key = "outer_bytes" if arm.hierarchical else "inner_bytes"
    return int(sum(m.get(key) or 0 for m in metrics))


def slow_link_collectives(arm: Arm, rounds: int) -> int:
    """Collectives crossing the slow link in `rounds` committed rounds: one outer exchange per
    round (hierarchical); one gradient all-reduce per step and the commit's broadcast per round (flat)."""
    return rounds if arm.hierarchical else rounds * (arm.steps_per_round + 1)


def modeled_link_s(arm: Arm, nbytes: int, rounds: int, gbps: float, latency_ms: float, step_s: float = 0.0) -> float:
    """Seconds the simulated link adds to a run: a latency per slow-link collective plus one
    member's share of the bytes (the members send at once) at `gbps`. An arm with a delay hides
    each round's outer collective (latency + nbytes / rounds, evenly, as one member's share) behind
    `arm.delay` inner steps of `step_s` seconds: a round adds only what is left over, never less than 0."""
    if arm.delay == 0 or rounds == 0:
        return slow_link_collectives(arm, rounds) * latency_ms / 1e3 + (nbytes / arm.senders) * 8 / (gbps * 1e9)
    per_round = latency_ms / 1e3 + (nbytes / rounds / arm.senders) * 8 / (gbps * 1e9)
    return rounds * max(0.0, per_round - arm.delay * step_s)


def tokens_per_step(cfg) -> int:
    """Tokens one inner step trains across the run's replicas: replicas x batch x grad_accum x block."""
    replicas = int(cfg.topology.clusters) * int(cfg.topology.replicas_per_cluster)
    return replicas * int(cfg.data.batch_size) * int(cfg.data.grad_accum) * int(cfg.model.block_size)


def eval_points(arm: Arm, metrics: list[dict], *, initial_eval_loss: float | None, step_tokens: int) -> list[dict]:
    """The run's eval loss at each evaluation, with what it had cost by then: `inner_step` (per
    replica), `tokens` trained (the metrics' own `cluster_tokens` summed over the rounds so far when
    every round has them, else inner steps x `step_tokens`) and `slow_link_bytes` (counted as
    `slow_link_bytes` does, over the rounds so far). The initial evaluation is the point at 0."""
    points = (
        []
        if initial_eval_loss is None
        else [{"inner_step": 0, "tokens": 0, "slow_link_bytes": 0, "eval_loss": initial_eval_loss}]
    )
    key = "outer_bytes" if arm.hierarchical else "inner_bytes"
    own_tokens = bool(metrics) and all(m.get("cluster_tokens") for m in metrics)
    tokens = nbytes = 0
    for m in metrics:
        nbytes += m.get(key) or 0
        tokens = tokens + sum(m["cluster_tokens"]) if own_tokens else m["inner_step"] * step_tokens
        if m.get("eval_loss") is not None:
            points.append(
                {
                    "inner_step": m["inner_step"],
                    "tokens": int(tokens),
                    "slow_link_bytes": int(nbytes),
                    "eval_loss": m["eval_loss"],
                }
            )
    return points


def peer_eval_points(result: dict, *, steps: int, step_tokens: int) -> list[dict]:
    """`eval_points` of a peer run from its `eval_curve` ([inner step, eval loss]): tokens = inner
    steps x `step_tokens`; slow-link bytes = its total x inner step / `steps` (it sends the same
    payload at every outer step, and evaluates only at outer steps)."""
    total = result.get("slow_link_bytes") or 0
    return [
        {
            "inner_step": s,
            "tokens": int(s * step_tokens),
            "slow_link_bytes": int(total * s / steps) if steps else 0,
            "eval_loss": loss,
        }
        for s, loss in result.get("eval_curve") or []
    ]


def trained_with(cfg) -> dict:
    """What a run trained with, auto values resolved (hsgd/config/auto.py): inner rate, batch,
    schedule and warmup, and the outer step (read by `sync.outer=diloco` only)."""
    from hsgd.config.auto import outer_step_of, run_steps, schedule_of, warmup_steps_of
    from hsgd.config.layout import layout_of

    lr, momentum = outer_step_of(cfg)
    return {
        "inner_lr": float(cfg.optim.inner.lr),
        "batch_size": int(cfg.data.batch_size),
        "schedule": schedule_of(cfg.optim.inner),
        "warmup_steps": warmup_steps_of(cfg.optim.inner, run_steps(cfg, layout_of(cfg))),
        "outer_lr": lr,
        "outer_momentum": momentum,
    }


def _run(arm: Arm, overrides: list[str], run_dir: Path, steps: int) -> dict:
    from actors.launch import compose_config, run_training
    from hsgd.config import validate
    from hsgd.config.rounds import steps_per_round
    from hsgd.record.rundir import read_jsonl

    cfg = compose_config(QUIET + overrides)
    validate(cfg)
    if steps_per_round(cfg) * int(cfg.train.rounds) != steps:
        raise ValueError(f"{arm.name}: {cfg.train.rounds} rounds x {steps_per_round(cfg)} steps != {steps} inner steps")
    start = time.monotonic()
    try:
        summary = run_training(cfg, str(run_dir))
    except Exception as err:  # noqa: BLE001 — one arm's failure is recorded; the others still run
        return {
            "status": "error",
            "error": f"{type(err).__name__}: {err}"[:500],
            "final_eval_loss": None,
            "slow_link_bytes": None,
            "outer_overlapped_rounds": None,
            "wall_s": None,
            "driver_wall_s": time.monotonic() - start,
        }
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return {
        "status": summary.get("status"),
        "final_eval_loss": summary.get("final_eval_loss"),
        **trained_with(cfg),
        "initial_eval_loss": summary.get("initial_eval_loss"),
        "rounds_committed": summary.get("rounds_committed"),
        "inner_steps_committed": summary.get("inner_steps_committed"),
        "slow_link_bytes": slow_link_bytes(arm, metrics),
        "outer_bytes": int(sum(m.get("outer_bytes") or 0 for m in metrics)),
        "inner_bytes": int(sum(m.get("inner_bytes") or 0 for m in metrics)),
        # committed rounds whose outer reduce ran behind the last inner steps (sync.fragment_delay)
        "outer_overlapped_rounds": sum(1 for m in metrics if m.get("outer_overlapped")),
        "eval_curve": [[m["inner_step"], m["eval_loss"]] for m in metrics if m.get("eval_loss") is not None],
        "eval_points": eval_points(
            arm, metrics, initial_eval_loss=summary.get("initial_eval_loss"), step_tokens=tokens_per_step(cfg)
        ),
        # seconds per phase over the run (the slowest member's inner phase per round): the outer
        # phases show a simulated link apart from the compute noise of a shared machine
        "phase_s": {
            k: sum((m.get("phase_s") or {}).get(k, 0.0) for m in metrics)
            for k in sorted({k for m in metrics for k in (m.get("phase_s") or {})})
        },
        "wall_s": summary.get("wall_s"),
        "driver_wall_s": time.monotonic() - start,
        "faults": len(summary.get("faults") or []),
    }


def _run_peer(arm: Arm, overrides: list[str], run_dir: Path, steps: int) -> dict:
    """One peer arm's run, as `_run`'s result (plus the peer's own figures); an error is recorded."""
    from benchmarks.peers.torchft_diloco import compose, run_diloco
    from hsgd.config.rounds import steps_per_round

    start = time.monotonic()
    try:
        cfg = compose(overrides)
        if steps_per_round(cfg) * int(cfg.train.rounds) != steps:
            raise ValueError(
                f"{arm.name}: {cfg.train.rounds} rounds x {steps_per_round(cfg)} steps != {steps} inner steps"
            )
        # a stuck worker fails on its own (gloo 120 s, quorum 600 s); this bound is for the run as a whole
        r = run_diloco(overrides=overrides, out=run_dir, timeout_s=max(3600.0, steps * 60.0))
    except Exception as err:  # noqa: BLE001 — one arm's failure is recorded; the others still run
        return {
            "status": "error",
            "error": f"{type(err).__name__}: {err}"[:500],
            "final_eval_loss": None,
            "slow_link_bytes": None,
            "outer_overlapped_rounds": None,
            "wall_s": None,
            "driver_wall_s": time.monotonic() - start,
        }
    return {
        **trained_with(cfg),
        **r,
        "outer_overlapped_rounds": 0,
        "driver_wall_s": time.monotonic() - start,
        "faults": 0,
        "eval_points": peer_eval_points(r, steps=steps, step_tokens=tokens_per_step(cfg)),
    }


def _gap(loss: float | None, flat_loss: float | None) -> float | None:
    return (loss - flat_loss) / flat_loss if loss is not None and flat_loss else None


def rows(arms: list[Arm], results: dict[str, dict], *, gbps: float, latency_ms: float) -> list[dict]:
    """The table: per arm its eval loss, gap and bytes ratio against flat_ddp of the same
    invocation and kind (`flat_ddp` or `flat_ddp@defaults`: the arm's own inner rate), its gap against
    flat DDP of that kind at its best rate (`best_flat`; the same as `gap` without a `--flat-lrs`
    sweep), wall-clock plain, under the simulated link measured (when run) and modeled, whether it
    meets the target (against flat DDP at the arm's rate, and at the best rate), and how many
    committed rounds had their outer reduce overlapped. `results[name]` is a run's result,
    `results[name + '@wan']` its run under the link."""
    bests = {at: best_flat(arms, results, at) or {} for at in AT}
    flat_rates = {at: len(bests[at].get("rates") or []) for at in AT}
    out = []
    for arm in arms:
        r = results.get(arm.name)
        if r is None:
            continue
        flat, best = results.get(FLAT + suffix_of(arm.at)) or {}, bests[arm.at]
        flat_loss, flat_bytes = flat.get("final_eval_loss"), flat.get("slow_link_bytes")
        loss, nbytes, wall = r.get("final_eval_loss"), r.get("slow_link_bytes"), r.get("wall_s")
        gap, gap_best = _gap(loss, flat_loss), _gap(loss, best.get("final_eval_loss"))
        ratio = flat_bytes / nbytes if flat_bytes and nbytes else None
        rounds = r.get("rounds_committed") or 0
        step_s = wall / (arm.rounds * arm.steps_per_round) if wall is not None else 0.0
        modeled = (
            wall + modeled_link_s(arm, nbytes, rounds, gbps, latency_ms, step_s)
            if wall is not None and nbytes is not None
            else None
        )
        wan = results.get(f"{arm.name}@wan") or {}
        out.append(
            {
                "arm": arm.name,
                "what": arm.what,
                "at": arm.at,
                "status": r.get("status"),
                "final_eval_loss": loss,
                "gap": gap,
                "gap_vs_best_flat": gap_best,
                "best_flat_arm": best.get("arm"),
                "flat_rates": flat_rates[arm.at],
                "slow_link_bytes": nbytes,
                "bytes_ratio_vs_flat": ratio,
                "wall_s": wall,
                "wan_wall_s": wan.get("wall_s"),
                "wan_final_eval_loss": wan.get("final_eval_loss"),
                "wan_wall_s_modeled": modeled,
                "outer_overlapped_rounds": r.get("outer_overlapped_rounds"),
                "meets_target": _meets(gap, ratio),
                "meets_target_vs_best_flat": _meets(gap_best, ratio),
            }
        )
    return out


def _meets(gap: float | None, ratio: float | None) -> bool | None:
    return None if gap is None or ratio is None else bool(ratio >= TARGET_RATIO and gap <= TARGET_GAP)


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _pct(gap: float | None) -> str:
    return "-" if gap is None else f"{gap * 100:+.2f} %"


def _yes(meets: bool | None) -> str:
    return "-" if meets is None else ("yes" if meets else "no")


def table_md(table: list[dict], *, gbps: float, latency_ms: float) -> str:
    """The rows as a Markdown table; with flat DDP at more than one rate (`--flat-lrs`), two more
    columns: the gap against flat DDP at its best rate, and the target against it."""
    link = f"{gbps:g} Gb/s, {latency_ms:g} ms"
    swept = any((r.get("flat_rates") or 0) > 1 for r in table)
    target = f"target (>= {TARGET_RATIO:g}x, <= {TARGET_GAP:.0%})"
    lines = [
        f"| arm | eval loss | gap vs flat |{' gap vs best flat |' if swept else ''} slow-link MB "
        f"| flat / arm bytes | wall s | wall s @ {link} (run) | wall s @ {link} (modeled) | {target} |"
        f"{' target vs best flat |' if swept else ''}",
        "|---|---:|---:|" + ("---:|" if swept else "") + "---:|---:|---:|---:|---:|---|" + ("---|" if swept else ""),
    ]
    for r in table:
        status = "" if r["status"] == "completed" else f" ({r['status']})"
        lines.append(
            f"| {r['arm']}{status} | {_fmt(r['final_eval_loss'], '.4f')} | {_pct(r['gap'])} | "
            + (f"{_pct(r.get('gap_vs_best_flat'))} | " if swept else "")
            + f"{_fmt(None if r['slow_link_bytes'] is None else r['slow_link_bytes'] / 1e6, '.2f')} | "
            f"{_fmt(r['bytes_ratio_vs_flat'], '.1f')} | {_fmt(r['wall_s'], '.1f')} | "
            f"{_fmt(r['wan_wall_s'], '.1f')} | {_fmt(r['wan_wall_s_modeled'], '.1f')} | "
            f"{_yes(r['meets_target'])} |" + (f" {_yes(r.get('meets_target_vs_best_flat'))} |" if swept else "")
        )
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    """Final eval loss vs slow-link bytes (log x), one labelled point per arm, the gap <= 2 % band
    shaded and the 500x-fewer-bytes line marked (both against flat_ddp, when it ran)."""
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    points = [r for r in table if r["final_eval_loss"] is not None and r["slow_link_bytes"]]
    flat = next((r for r in points if r["arm"] == FLAT), None) or next(
        (r for r in points if r["arm"] == FLAT + DEFAULTS), None
    )
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    labels: dict[tuple[int, float], list[str]] = {}  # arms landing on the same point share one label
    for r in points:
        color = (
            "#444"
            if r["arm"].startswith(FLAT)
            else "#ff7f0e"
            if r["arm"].startswith(PEER_PREFIX)
            else "#2ca02c"
            if r["meets_target"]
            else "#3b75af"
        )
        marker = "s" if r.get("at") == "defaults" else "o"  # at the config's defaults: squares
        ax.scatter(r["slow_link_bytes"], r["final_eval_loss"], color=color, marker=marker, zorder=3)
        labels.setdefault((r["slow_link_bytes"], r["final_eval_loss"]), []).append(r["arm"])
    for (x, y), names in labels.items():
        ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    if flat is not None:
        bottom, top = ax.get_ylim()
        band_top = flat["final_eval_loss"] * (1 + TARGET_GAP)
        ax.axhspan(bottom, band_top, color="#2ca02c", alpha=0.12, label=f"gap <= {TARGET_GAP:.0%} vs flat DDP")
        ax.set_ylim(bottom, max(top, band_top * 1.002))
        ax.axhline(flat["final_eval_loss"], color="#444", lw=0.8, ls=":")  # the band and line: vs `flat`
        ax.axvline(
            flat["slow_link_bytes"] / TARGET_RATIO,
            color="#c44e52",
            ls="--",
            lw=1,
            label=f"{TARGET_RATIO:g}x fewer bytes than flat DDP",
        )
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("bytes over the slow link (log)")
    ax.set_ylabel("final eval loss")
    ax.set_title("hsgd convergence: eval loss vs slow-link bytes, same seed and tokens", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    save_png(fig, path)


def plot_curves(arms: list[Arm], results: dict[str, dict], path: Path) -> None:
    """Two panels, one curve per arm from its `eval_points`: eval loss vs tokens trained, and eval
    loss vs cumulative slow-link bytes (log x; the initial point, at 0 bytes, is left out there).
    Flat DDP grey (its other rates lighter), the torchft peer orange, arms at the defaults dashed."""
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()
    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(12, 5), dpi=110, sharey=True)
    others = iter(plt.get_cmap("tab10").colors[:1] + plt.get_cmap("tab10").colors[2:] * 4)
    colors: dict[str, tuple] = {}
    for arm in arms:
        points = (results.get(arm.name) or {}).get("eval_points") or []
        if not points:
            continue
        base = arm.name.split("@")[0]
        color = (
            "#444"
            if base == FLAT
            else "#999"
            if not arm.hierarchical and not arm.peer
            else "#ff7f0e"
            if arm.peer
            else colors.setdefault(base, next(others))
        )
        style = {
            "color": color,
            "ls": "--" if arm.at == "defaults" else "-",
            "marker": ".",
            "lw": 1.2,
            "label": arm.name,
        }
        by_tokens.plot([p["tokens"] for p in points], [p["eval_loss"] for p in points], **style)
        spent = [p for p in points if p["slow_link_bytes"] > 0]
        by_bytes.plot([p["slow_link_bytes"] for p in spent], [p["eval_loss"] for p in spent], **style)
    by_tokens.set_xlabel("tokens trained (all replicas)")
    by_tokens.set_ylabel("eval loss")
    by_bytes.set_xlabel("bytes over the slow link so far (log)")
    by_bytes.set_xscale("log")
    for ax in (by_tokens, by_bytes):
        ax.grid(True, which="both", alpha=0.25)
    if by_tokens.lines:
        by_tokens.legend(fontsize=7, loc="upper right")
    fig.suptitle(
        "hsgd convergence: eval loss vs tokens and vs slow-link bytes, same seed and tokens "
        "(dashed: at the config's defaults)",
        fontsize=10,
    )
    save_png(fig, path)


def write_report(
    out: Path, arms: list[Arm], results: dict[str, dict], meta: dict, *, gbps: float, latency_ms: float
) -> str:
    """convergence.json, convergence.md, convergence.png and convergence_curves.png in `out`;
    returns the table's text (the table, then flat DDP's best rate and the peer ratios)."""
    from hsgd.record.rundir import atomic_write_text

    table = rows(arms, results, gbps=gbps, latency_ms=latency_ms)
    ratios = peer_ratios(results)
    bests = {at: b for at in AT if (b := best_flat(arms, results, at))}
    text = table_md(table, gbps=gbps, latency_ms=latency_ms) + flat_best_md(bests) + ratios_md(ratios)
    report = {
        "machine_note": "timings are this machine's; compare within one invocation",
        **meta,
        "target": {"bytes_ratio_vs_flat": TARGET_RATIO, "gap": TARGET_GAP},
        "link": {"gbps": gbps, "latency_ms": latency_ms},
        "arms": [asdict(a) for a in arms],
        "results": results,
        "rows": table,
        "flat_best": bests,
        "plots": ["convergence.png", "convergence_curves.png"],
    }
    if ratios:  # eval loss of hsgd's diloco_h<H> (codec none) / torchft's DiLoCo at the same H, per H and kind
        report["hsgd_diloco_vs_torchft_diloco"] = {h: c["ratio"] for h, c in ratios.items()}
        report["peer_comparison"] = ratios
    atomic_write_text(out / "convergence.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "convergence.md", text)
    plot(table, out / "convergence.png")
    plot_curves(arms, results, out / "convergence_curves.png")
    return text


def _lrs(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--flat-lrs takes comma-separated rates (1.5e-3,3e-3,6e-3), not {text!r}"
        ) from None


def config_inner_lr(overrides: list[str]) -> float:
    """The inner rate a run composed from `overrides` trains with (the config's, or `--set`'s)."""
    from actors.launch import compose_config

    return float(compose_config(QUIET + overrides).optim.inner.lr)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import header

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for convergence.{json,md,png} and the runs")
    parser.add_argument("--quick", action="store_true", help="smoke run: model=tiny, 200 steps, few arms")
    parser.add_argument("--model", default=None, help="model preset (default small; tiny with --quick)")
    parser.add_argument(
        "--steps", type=int, default=None, help="inner steps per replica (default 2000; 200 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches per evaluation")
    parser.add_argument("--eval-every-steps", type=int, default=None, help="default: steps / 4")
    parser.add_argument(
        "--every",
        type=int,
        default=None,
        help="H of the main arms (LocalSGD, codecs, fragments, sharded, delay; default 100, 50 quick)",
    )
    parser.add_argument(
        "--arms",
        default=None,
        help="comma-separated subset of the arm names (as planned, without @defaults; "
        "flat_ddp brings its --flat-lrs sweep)",
    )
    parser.add_argument(
        "--at",
        choices=("bench", "defaults", "both"),
        default="bench",
        help="every arm at the bench's settings (batch, schedule, outer step), at the config's "
        "defaults (<arm>@defaults), or both",
    )
    parser.add_argument(
        "--flat-lrs",
        type=_lrs,
        default=[],
        metavar="LR,LR,...",
        help="flat_ddp again at each optim.inner.lr (flat_ddp_lr<lr>); the table names the best",
    )
    parser.add_argument(
        "--wan-runs",
        default=None,
        help="arms run again under the simulated link (comma-separated, or 'none'); "
        "default: flat_ddp and the main DiLoCo arm, of the first kind --at runs",
    )
    parser.add_argument("--gbps", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"sequences per replica and step, every arm (default {BATCH_SIZE}; {QUICK_BATCH_SIZE} with --quick)",
    )
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR, help="the DiLoCo arms' outer learning rate")
    parser.add_argument(
        "--outer-momentum", type=float, default=OUTER_MOMENTUM, help="the DiLoCo arms' outer Nesterov momentum"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every arm")
    args = parser.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "small")
    steps = args.steps or (200 if args.quick else 2000)
    arms = plan_arms(steps, quick=args.quick, every=args.every)
    if torchft_available():  # the peer arms (benchmarks/peers/torchft_diloco.py)
        arms += peer_arms(steps, quick=args.quick, every=args.every)
    if args.arms:
        wanted = args.arms.split(",")
        unknown = sorted(set(wanted) - {a.name for a in arms})
        if unknown:
            parser.error(f"unknown arms {unknown}; valid: {','.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in wanted]
    kinds = at_kinds(args.at)
    batch_size = args.batch_size or (QUICK_BATCH_SIZE if args.quick else BATCH_SIZE)
    commons = {
        "bench": common_overrides(
            model=model,
            seed=args.seed,
            eval_batches=args.eval_batches,
            steps=steps,
            batch_size=batch_size,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            extra=args.set,
        ),
        "defaults": defaults_overrides(model=model, seed=args.seed, eval_batches=args.eval_batches, extra=args.set),
    }
    eval_every = args.eval_every_steps if args.eval_every_steps is not None else steps // 4
    flat = next((a for a in arms if a.name == FLAT), None)
    # the rate every arm trains with: neither kind's common overrides set it, only --set does
    own_lr = (
        config_inner_lr(arm_overrides(flat, commons[kinds[0]], eval_every_steps=eval_every))
        if args.flat_lrs and flat is not None
        else 0.0
    )
    try:
        arms = invocation_arms(arms, at=args.at, flat_lrs=args.flat_lrs, own_lr=own_lr)
    except ValueError as err:
        parser.error(str(err))
    wan_names = (
        ([] if args.wan_runs == "none" else args.wan_runs.split(","))
        if args.wan_runs is not None
        else [n + suffix_of(kinds[0]) for n in (FLAT, f"diloco_h{main_every(args.quick, args.every)}")]
    )
    unknown = sorted(set(wan_names) - {a.name for a in arms})
    if unknown and args.wan_runs is not None:
        parser.error(f"--wan-runs names arms not in this invocation: {unknown}")
    wan_names = [n for n in wan_names if n not in unknown]
    peers = sorted(n for n in wan_names if any(a.name == n and a.peer for a in arms))
    if peers:
        parser.error(f"--wan-runs: the peer arms {peers} run outside hsgd and cannot simulate its link")
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-convergence-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = [item for arm in arms for item in ([(arm, False)] + ([(arm, True)] if arm.name in wan_names else []))]
    meta = {
        **header("convergence", argv, args.quick),
        "args": vars(args),
        "model": model,
        "steps": steps,
        "seed": args.seed,
        "at": kinds,
        "topology": f"{CLUSTERS} clusters x {REPLICAS_PER_CLUSTER} replicas",
        "wan_runs": wan_names,
        "wan_wall_note": "wan_wall_s: measured, the arm run again under the simulated link; wan_wall_s_modeled: "
        "wall_s + modeled_link_s (every arm)",
    }
    print(
        f"convergence: {len(arms)} arms ({len(runs)} runs), model={model}, {steps} inner steps per replica, "
        f"seed {args.seed}, out {out}",
        flush=True,
    )
    results: dict[str, dict] = {}
    import ray

    n = CLUSTERS * REPLICAS_PER_CLUSTER
    ray.init(
        address="local", num_cpus=max(n + 1, 2), namespace="hsgd-bench", include_dashboard=False, log_to_driver=False
    )
    t0 = time.monotonic()
    try:
        for i, (arm, wan) in enumerate(runs, 1):
            name = f"{arm.name}@wan" if wan else arm.name
            overrides = arm_overrides(arm, commons[arm.at], eval_every_steps=eval_every)
            if wan:
                overrides += link_overrides(arm, args.gbps, args.latency_ms)
            run = _run_peer if arm.peer else _run
            r = run(arm, overrides, out / "runs" / name.replace("@", "_"), steps)
            r["overrides"] = overrides
            results[name] = r
            elapsed = time.monotonic() - t0
            mb = "-" if r["slow_link_bytes"] is None else f"{r['slow_link_bytes'] / 1e6:.2f}"
            print(
                f"[{i}/{len(runs)}] {name:<26} {r['status']}: eval {_fmt(r['final_eval_loss'], '.4f')}  "
                f"slow link {mb} MB  wall {_fmt(r['wall_s'], '.1f')}s  (bench {elapsed / 60:.1f} min, "
                f"~{elapsed / i * (len(runs) - i) / 60:.0f} min left)",
                flush=True,
            )
            write_report(out, arms, results, meta, gbps=args.gbps, latency_ms=args.latency_ms)  # partial, kept
    finally:
        ray.shutdown()
    text = write_report(out, arms, results, meta, gbps=args.gbps, latency_ms=args.latency_ms)
    print(text, end="")
    print(f"convergence.json, convergence.md, convergence.png and convergence_curves.png in {out}")
    return 0 if all(r.get("status") == "completed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
