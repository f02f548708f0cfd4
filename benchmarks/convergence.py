"""Convergence benchmark: `python -m benchmarks convergence [--model small] [--steps 2000] [--quick]
[--arms a,b] [--batch-size 32] [--outer-lr 1.0 --outer-momentum 0.3] [--wan-runs flat_ddp,diloco_h100]
[--out DIR] [--set key=value ...]`.

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
(`schedule_overrides`; `--set optim.inner.schedule=constant` for the config's default).

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

Writes `<out>/convergence.json` (arms, per-run results, rows), `<out>/convergence.md` (the table,
also printed) and `<out>/convergence.png` (final eval loss vs slow-link bytes, log x, one labelled
point per arm, the <= 2 % gap band shaded, the 500x-fewer-bytes line marked). One progress line
per arm as it ends. An arm that fails is recorded (status, error) and the others still run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
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


def _sync(outer: str, every: int, *, compress: str = "none", fragments: int = 1, path: str = "leader",
          delay: int = 0, alpha: float = 0.0) -> list[str]:
    # every sync key set on every arm: no arm inherits a default another arm overrides
    return ["sync.inner=ddp", f"sync.outer={outer}", f"sync.outer_every={every}", f"sync.outer_compress={compress}",
            f"sync.outer_topk={TOPK_DENSITY}", f"sync.fragments={fragments}", f"sync.fragment_alpha={alpha}",
            f"sync.fragment_delay={delay}", f"sync.outer_path={path}"]


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
    specs = [("flat_ddp", f"1 cluster x {n} replicas, ddp every step", False, every, 1, n,
              ["topology.clusters=1", f"topology.replicas_per_cluster={n}"] + _sync("average", every), 0),
             (f"localsgd_h{every}", f"ddp inside, params averaged across clusters every {every} steps", True, every, 1,
              CLUSTERS, hier + _sync("average", every), 0),
             (f"localsgd_h{every}_int4", f"as localsgd_h{every}, the averaged update sent as int4 + error feedback", True,
              every, 1, CLUSTERS, hier + _sync("average", every, compress="int4"), 0)]
    for h in sorted({every, *others}):
        specs.append((f"diloco_h{h}", f"ddp inside, DiLoCo every {h} steps, fp32", True, h, 1, CLUSTERS,
                      hier + _sync("diloco", h), 0))
    for codec in codecs:
        label = f"topk{TOPK_DENSITY * 100:g}" if codec == "topk" else codec
        what = f"top-{TOPK_DENSITY:.0%} (bf16 values + int16 indices)" if codec == "topk" else codec
        specs.append((f"diloco_h{every}_{label}", f"DiLoCo every {every}, {what} + error feedback", True, every, 1,
                      CLUSTERS, hier + _sync("diloco", every, compress=codec), 0))
    specs.append((f"diloco_h{every}_frag{fragments}", f"Streaming DiLoCo every {every}, {fragments} fragments in turn",
                  True, every, fragments, CLUSTERS, hier + _sync("diloco", every, fragments=fragments), 0))
    specs.append((f"diloco_h{every}_sharded", f"DiLoCo every {every}, sharded outer path (every member a shard)", True,
                  every, 1, n, hier + _sync("diloco", every, path="sharded"), 0))
    specs.append((f"diloco_h{every}_delay{DELAY}",
                  f"DiLoCo every {every}, fp32, outer all-reduce behind the last {DELAY} steps, alpha {DELAY_ALPHA:g}",
                  True, every, 1, CLUSTERS, hier + _sync("diloco", every, delay=DELAY, alpha=DELAY_ALPHA), DELAY))
    if not quick:
        f = STREAMING_FRAGMENTS
        specs.append((f"diloco_h{every}_streaming",
                      f"Streaming DiLoCo every {every}: {f} fragments, delay {DELAY}, alpha {DELAY_ALPHA:g}, int4",
                      True, every, f, CLUSTERS,
                      hier + _sync("diloco", every, compress="int4", fragments=f, delay=DELAY, alpha=DELAY_ALPHA),
                      DELAY))
    arms = []
    for name, what, hierarchical, h, f, senders, overrides, delay in specs:
        spr = h // f
        if steps % spr:
            raise ValueError(f"--steps {steps} is not a whole number of {spr}-step rounds for arm {name}")
        arms.append(Arm(name, what, hierarchical, spr, steps // spr, senders,
                        tuple(overrides) + (f"train.rounds={steps // spr}",), delay))
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
    return [Arm(f"{PEER_PREFIX}{h}", f"torchft 0.2.0 DiLoCo every {h} steps, fp32: Manager + Lighthouse, "
                f"{CLUSTERS} groups x {REPLICAS_PER_CLUSTER} ranks, torch DDP inside", True, h, steps // h,
                CLUSTERS * REPLICAS_PER_CLUSTER,
                tuple(hier + _sync("diloco", h)) + (f"train.rounds={steps // h}",), 0, "torchft_diloco")]


def peer_ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Per H where both ran: hsgd's `diloco_h<H>` (codec none) final eval loss / torchft's
    `torchft_diloco_h<H>`, of the same invocation (ratio None when either has no loss)."""
    out = {}
    for name, r in results.items():
        if not name.startswith(PEER_PREFIX) or "@" in name:
            continue
        h = name[len(PEER_PREFIX):]
        hsgd = results.get(f"diloco_h{h}")
        if hsgd is None:
            continue
        a, b = hsgd.get("final_eval_loss"), r.get("final_eval_loss")
        out[h] = {"hsgd_arm": f"diloco_h{h}", "torchft_arm": name, "hsgd_eval_loss": a, "torchft_eval_loss": b,
                  "hsgd_slow_link_bytes": hsgd.get("slow_link_bytes"),
                  "torchft_slow_link_bytes": r.get("slow_link_bytes"),
                  "ratio": a / b if a is not None and b else None}
    return out


def ratios_md(ratios: dict[str, dict]) -> str:
    """The table's footer: a line per H with both arms (empty without)."""
    lines = [f"hsgd_diloco_vs_torchft_diloco (H={h}): {c['hsgd_arm']} {_fmt(c['hsgd_eval_loss'], '.4f')} / "
             f"{c['torchft_arm']} {_fmt(c['torchft_eval_loss'], '.4f')} = {_fmt(c['ratio'], '.4f')} "
             f"(eval loss; < 1: hsgd ends lower)" for h, c in ratios.items()]
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def schedule_overrides(steps: int) -> list[str]:
    """The inner learning rate every arm trains with, as a run of `steps` steps is trained: linear
    warmup over the first 5 % of the steps, then cosine decay to a tenth (DiLoCo's and nanoGPT's
    shape). A constant rate (the config's default) leaves the clusters' models far apart at the end
    and the comparison says more about the rate than the sync. `--set` overrides it."""
    return ["optim.inner.schedule=cosine", f"optim.inner.warmup_steps={max(1, steps // 20)}"]


def common_overrides(*, model: str, seed: int, eval_batches: int, steps: int, batch_size: int, outer_lr: float,
                     outer_momentum: float, extra: list[str] = ()) -> list[str]:
    """The overrides every arm of one invocation shares: model, seed, batch, eval size, the inner
    schedule (`schedule_overrides`) and the DiLoCo arms' outer step; `extra` (`--set`) last, so it wins.

    The batch (`data.batch_size` sequences per replica and step, `--batch-size`) is the same in every
    arm, so every arm trains on the same tokens; each cluster steps on half of flat DDP's batch. The
    outer step (`optim.outer.*`, read by `sync.outer=diloco` only; `average` is lr 1, no momentum):
    DiLoCo's lr 0.7 with Nesterov momentum 0.9 is tuned for thousands of outer steps, and a run of
    2,000 steps at H = 100 has 20; lr 1.0 with momentum 0.3 was the best of seven settings at
    `--model tiny`, 1,000 steps, H = 100, int4 (README "Benchmarks")."""
    return [f"model={model}", f"seed={seed}", f"train.eval_batches={eval_batches}", f"data.batch_size={batch_size}",
            *schedule_overrides(steps), f"optim.outer.lr={outer_lr:g}", f"optim.outer.momentum={outer_momentum:g}",
            *extra]


def arm_overrides(arm: Arm, common: list[str], *, eval_every_steps: int) -> list[str]:
    """Every override of one arm's run: the common ones, its own, and its eval cadence (every
    `eval_every_steps` inner steps when that is a whole number of its rounds, else at the end only)."""
    every = eval_every_steps // arm.steps_per_round if eval_every_steps and not eval_every_steps % arm.steps_per_round \
        else arm.rounds
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
        return {"status": "error", "error": f"{type(err).__name__}: {err}"[:500], "final_eval_loss": None,
                "slow_link_bytes": None, "outer_overlapped_rounds": None, "wall_s": None,
                "driver_wall_s": time.monotonic() - start}
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return {"status": summary.get("status"), "final_eval_loss": summary.get("final_eval_loss"),
            "initial_eval_loss": summary.get("initial_eval_loss"),
            "rounds_committed": summary.get("rounds_committed"),
            "inner_steps_committed": summary.get("inner_steps_committed"),
            "slow_link_bytes": slow_link_bytes(arm, metrics),
            "outer_bytes": int(sum(m.get("outer_bytes") or 0 for m in metrics)),
            "inner_bytes": int(sum(m.get("inner_bytes") or 0 for m in metrics)),
            # committed rounds whose outer reduce ran behind the last inner steps (sync.fragment_delay)
            "outer_overlapped_rounds": sum(1 for m in metrics if m.get("outer_overlapped")),
            "eval_curve": [[m["inner_step"], m["eval_loss"]] for m in metrics if m.get("eval_loss") is not None],
            # seconds per phase over the run (the slowest member's inner phase per round): the outer
            # phases show a simulated link apart from the compute noise of a shared machine
            "phase_s": {k: sum((m.get("phase_s") or {}).get(k, 0.0) for m in metrics)
                        for k in sorted({k for m in metrics for k in (m.get("phase_s") or {})})},
            "wall_s": summary.get("wall_s"), "driver_wall_s": time.monotonic() - start,
            "faults": len(summary.get("faults") or [])}


def _run_peer(arm: Arm, overrides: list[str], run_dir: Path, steps: int) -> dict:
    """One peer arm's run, as `_run`'s result (plus the peer's own figures); an error is recorded."""
    from hsgd.config.rounds import steps_per_round

    from benchmarks.peers.torchft_diloco import compose, run_diloco

    start = time.monotonic()
    try:
        cfg = compose(overrides)
        if steps_per_round(cfg) * int(cfg.train.rounds) != steps:
            raise ValueError(f"{arm.name}: {cfg.train.rounds} rounds x {steps_per_round(cfg)} steps != {steps} inner steps")
        # a stuck worker fails on its own (gloo 120 s, quorum 600 s); this bound is for the run as a whole
        r = run_diloco(overrides=overrides, out=run_dir, timeout_s=max(3600.0, steps * 60.0))
    except Exception as err:  # noqa: BLE001 — one arm's failure is recorded; the others still run
        return {"status": "error", "error": f"{type(err).__name__}: {err}"[:500], "final_eval_loss": None,
                "slow_link_bytes": None, "outer_overlapped_rounds": None, "wall_s": None,
                "driver_wall_s": time.monotonic() - start}
    return {**r, "outer_overlapped_rounds": 0, "driver_wall_s": time.monotonic() - start, "faults": 0}


def rows(arms: list[Arm], results: dict[str, dict], *, gbps: float, latency_ms: float) -> list[dict]:
    """The table: per arm its eval loss, gap and bytes ratio against flat_ddp of the same
    invocation, wall-clock plain, under the simulated link measured (when run) and modeled, and
    whether it meets the target, and how many committed rounds had their outer reduce overlapped.
    `results[name]` is a run's result, `results[name + '@wan']` its run under the link."""
    flat = results.get("flat_ddp") or {}
    flat_loss, flat_bytes = flat.get("final_eval_loss"), flat.get("slow_link_bytes")
    out = []
    for arm in arms:
        r = results.get(arm.name)
        if r is None:
            continue
        loss, nbytes, wall = r.get("final_eval_loss"), r.get("slow_link_bytes"), r.get("wall_s")
        gap = (loss - flat_loss) / flat_loss if loss is not None and flat_loss else None
        ratio = flat_bytes / nbytes if flat_bytes and nbytes else None
        rounds = r.get("rounds_committed") or 0
        step_s = wall / (arm.rounds * arm.steps_per_round) if wall is not None else 0.0
        modeled = wall + modeled_link_s(arm, nbytes, rounds, gbps, latency_ms, step_s) \
            if wall is not None and nbytes is not None else None
        wan = results.get(f"{arm.name}@wan") or {}
        out.append({"arm": arm.name, "what": arm.what, "status": r.get("status"), "final_eval_loss": loss, "gap": gap,
                    "slow_link_bytes": nbytes, "bytes_ratio_vs_flat": ratio, "wall_s": wall,
                    "wan_wall_s": wan.get("wall_s"), "wan_final_eval_loss": wan.get("final_eval_loss"),
                    "wan_wall_s_modeled": modeled, "outer_overlapped_rounds": r.get("outer_overlapped_rounds"),
                    "meets_target": None if gap is None or ratio is None
                    else bool(ratio >= TARGET_RATIO and gap <= TARGET_GAP)})
    return out


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table_md(table: list[dict], *, gbps: float, latency_ms: float) -> str:
    """The rows as a Markdown table."""
    link = f"{gbps:g} Gb/s, {latency_ms:g} ms"
    lines = [f"| arm | eval loss | gap vs flat | slow-link MB | flat / arm bytes | wall s | wall s @ {link} (run) "
             f"| wall s @ {link} (modeled) | target (>= {TARGET_RATIO:g}x, <= {TARGET_GAP:.0%}) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in table:
        target = "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "no")
        status = "" if r["status"] == "completed" else f" ({r['status']})"
        lines.append(f"| {r['arm']}{status} | {_fmt(r['final_eval_loss'], '.4f')} | "
                     f"{_fmt(None if r['gap'] is None else r['gap'] * 100, '+.2f')}{'' if r['gap'] is None else ' %'} | "
                     f"{_fmt(None if r['slow_link_bytes'] is None else r['slow_link_bytes'] / 1e6, '.2f')} | "
                     f"{_fmt(r['bytes_ratio_vs_flat'], '.1f')} | {_fmt(r['wall_s'], '.1f')} | "
                     f"{_fmt(r['wan_wall_s'], '.1f')} | {_fmt(r['wan_wall_s_modeled'], '.1f')} | {target} |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    """Final eval loss vs slow-link bytes (log x), one labelled point per arm, the gap <= 2 % band
    shaded and the 500x-fewer-bytes line marked (both against flat_ddp, when it ran)."""
    from hsgd.record.plots import pyplot, save_png

    plt = pyplot()

    points = [r for r in table if r["final_eval_loss"] is not None and r["slow_link_bytes"]]
    flat = next((r for r in points if r["arm"] == "flat_ddp"), None)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    labels: dict[tuple[int, float], list[str]] = {}  # arms landing on the same point share one label
    for r in points:
        color = "#444" if r["arm"] == "flat_ddp" else "#ff7f0e" if r["arm"].startswith(PEER_PREFIX) \
            else "#2ca02c" if r["meets_target"] else "#3b75af"
        ax.scatter(r["slow_link_bytes"], r["final_eval_loss"], color=color, zorder=3)
        labels.setdefault((r["slow_link_bytes"], r["final_eval_loss"]), []).append(r["arm"])
    for (x, y), names in labels.items():
        ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    if flat is not None:
        bottom, top = ax.get_ylim()
        band_top = flat["final_eval_loss"] * (1 + TARGET_GAP)
        ax.axhspan(bottom, band_top, color="#2ca02c", alpha=0.12, label=f"gap <= {TARGET_GAP:.0%} vs flat DDP")
        ax.set_ylim(bottom, max(top, band_top * 1.002))
        ax.axhline(flat["final_eval_loss"], color="#444", lw=0.8, ls=":")
        ax.axvline(flat["slow_link_bytes"] / TARGET_RATIO, color="#c44e52", ls="--", lw=1,
                   label=f"{TARGET_RATIO:g}x fewer bytes than flat DDP")
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("bytes over the slow link (log)")
    ax.set_ylabel("final eval loss")
    ax.set_title("hsgd convergence: eval loss vs slow-link bytes, same seed and tokens", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    save_png(fig, path)


def write_report(out: Path, arms: list[Arm], results: dict[str, dict], meta: dict, *, gbps: float,
                 latency_ms: float) -> str:
    """convergence.json, convergence.md and convergence.png in `out`; returns the table's text."""
    from hsgd.record.rundir import atomic_write_text

    table = rows(arms, results, gbps=gbps, latency_ms=latency_ms)
    ratios = peer_ratios(results)
    text = table_md(table, gbps=gbps, latency_ms=latency_ms) + ratios_md(ratios)
    report = {"machine_note": "timings are this machine's; compare within one invocation", **meta,
              "target": {"bytes_ratio_vs_flat": TARGET_RATIO, "gap": TARGET_GAP},
              "link": {"gbps": gbps, "latency_ms": latency_ms},
              "arms": [asdict(a) for a in arms], "results": results, "rows": table}
    if ratios:  # eval loss of hsgd's diloco_h<H> (codec none) / torchft's DiLoCo at the same H, per H
        report["hsgd_diloco_vs_torchft_diloco"] = {h: c["ratio"] for h, c in ratios.items()}
        report["peer_comparison"] = ratios
    atomic_write_text(out / "convergence.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "convergence.md", text)
    plot(table, out / "convergence.png")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for convergence.{json,md,png} and the runs")
    parser.add_argument("--quick", action="store_true", help="smoke run: model=tiny, 200 steps, few arms")
    parser.add_argument("--model", default=None, help="model preset (default small; tiny with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per replica (default 2000; 200 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches per evaluation")
    parser.add_argument("--eval-every-steps", type=int, default=None, help="default: steps / 4")
    parser.add_argument("--every", type=int, default=None,
                        help="H of the main arms (LocalSGD, codecs, fragments, sharded, delay; default 100, 50 quick)")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arm names")
    parser.add_argument("--wan-runs", default=None,
                        help="arms run again under the simulated link (comma-separated, or 'none'); "
                             "default: flat_ddp and the main DiLoCo arm")
    parser.add_argument("--gbps", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"sequences per replica and step, every arm (default {BATCH_SIZE}; {QUICK_BATCH_SIZE} with --quick)")
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR, help="the DiLoCo arms' outer learning rate")
    parser.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM,
                        help="the DiLoCo arms' outer Nesterov momentum")
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
    wan_names = ([] if args.wan_runs == "none" else args.wan_runs.split(",")) if args.wan_runs is not None \
        else ["flat_ddp", f"diloco_h{main_every(args.quick, args.every)}"]
    unknown = sorted(set(wan_names) - {a.name for a in arms})
    if unknown and args.wan_runs is not None:
        parser.error(f"--wan-runs names arms not in this invocation: {unknown}")
    wan_names = [n for n in wan_names if n not in unknown]
    peers = sorted(n for n in wan_names if any(a.name == n and a.peer for a in arms))
    if peers:
        parser.error(f"--wan-runs: the peer arms {peers} run outside hsgd and cannot simulate its link")
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-convergence-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    batch_size = args.batch_size or (QUICK_BATCH_SIZE if args.quick else BATCH_SIZE)
    common = common_overrides(model=model, seed=args.seed, eval_batches=args.eval_batches, steps=steps,
                              batch_size=batch_size, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                              extra=args.set)
    eval_every = args.eval_every_steps if args.eval_every_steps is not None else steps // 4
    runs = [item for arm in arms for item in ([(arm, False)] + ([(arm, True)] if arm.name in wan_names else []))]
    meta = {"args": vars(args), "model": model, "steps": steps, "seed": args.seed,
            "topology": f"{CLUSTERS} clusters x {REPLICAS_PER_CLUSTER} replicas", "wan_runs": wan_names,
            "wan_wall_note": "wan_wall_s: measured, the arm run again under the simulated link; wan_wall_s_modeled: "
                             "wall_s + modeled_link_s (every arm)"}
    print(f"convergence: {len(arms)} arms ({len(runs)} runs), model={model}, {steps} inner steps per replica, "
          f"seed {args.seed}, out {out}", flush=True)
    results: dict[str, dict] = {}
    import ray

    n = CLUSTERS * REPLICAS_PER_CLUSTER
    ray.init(num_cpus=max(n + 1, 2), namespace="hsgd-bench", include_dashboard=False, log_to_driver=False)
    t0 = time.monotonic()
    try:
        for i, (arm, wan) in enumerate(runs, 1):
            name = f"{arm.name}@wan" if wan else arm.name
            overrides = arm_overrides(arm, common, eval_every_steps=eval_every)
            if wan:
                overrides += link_overrides(arm, args.gbps, args.latency_ms)
            run = _run_peer if arm.peer else _run
            r = run(arm, overrides, out / "runs" / name.replace("@", "_"), steps)
            r["overrides"] = overrides
            results[name] = r
            elapsed = time.monotonic() - t0
            mb = "-" if r["slow_link_bytes"] is None else f"{r['slow_link_bytes'] / 1e6:.2f}"
            print(f"[{i}/{len(runs)}] {name:<26} {r['status']}: eval {_fmt(r['final_eval_loss'], '.4f')}  "
                  f"slow link {mb} MB  wall {_fmt(r['wall_s'], '.1f')}s  (bench {elapsed / 60:.1f} min, "
                  f"~{elapsed / i * (len(runs) - i) / 60:.0f} min left)", flush=True)
            write_report(out, arms, results, meta, gbps=args.gbps, latency_ms=args.latency_ms)  # partial, kept
    finally:
        ray.shutdown()
    text = write_report(out, arms, results, meta, gbps=args.gbps, latency_ms=args.latency_ms)
    print(text, end="")
    print(f"convergence.json, convergence.md and convergence.png in {out}")
    return 0 if all(r.get("status") == "completed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
