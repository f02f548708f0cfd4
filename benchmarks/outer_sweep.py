"""`python -m benchmarks outer_sweep [--steps 2000] [--grid before|cosine|spread|flat_rate|four|small|defaults|all] [--jobs 2] [--out DIR]
[--set key=value ...]`: issue 33 Build 1's sweeps of the outer step and the inner schedule, in one process per
job, no Ray, no process groups, so a 2,000-step tiny run takes about a minute of one core.

What a job trains is what `python -m jobs.train <overrides>` trains, step for step, through hsgd's own
`hsgd.train.trainer.ReplicaTrainer` (model, data, inner optimizer and schedule, grad clipping, the
codec with error feedback, the outer optimizer, the commit, the evaluation), with one shortcut: a
cluster is ONE trainer whose batch is its replicas' batches side by side. Inner `ddp` averages the
members' gradients of equal-sized batches of bitwise-equal params, and `lm_loss` is the mean over
tokens, so the gradient of the concatenated batch is that average (equal up to fp32 summation
order). Across clusters the trainers' own `outer_reduce` runs, one thread per cluster, over an
in-process group (`ThreadGroup`: a mean in rank order, an all-gather), then each one's
`outer_commit`. So: flat DDP (1 cluster x R, `sync.outer=none`), DiLoCo and `average` at any H,
any codec, any number of clusters; not `sync.inner=localsgd`/`none`, fragments, delays or balance
(refused with one line). `tests/unit/test_outer_sweep.py` checks the shortcut against two real trainers
with inner ddp over gloo.

Writes `<out>/outer_sweep.json` (every job: its overrides, final and per-round eval loss, the gap to
its grid's flat DDP) and `<out>/outer_sweep.md` (one table per grid), one progress line per job.
"""  # noqa: E501 — its first line is the --help description (argparse reads __doc__'s first line)

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]
GRIDS = ("before", "cosine", "spread", "flat_rate", "four", "small", "defaults", "all")


class ClusterBatches:
    """A dataset whose train batch at (step, micro) is the batches of `members` (global replica indices)
    at that step, concatenated; evaluation batches as the wrapped dataset's."""

    def __init__(self, dataset, members: list[int]):
        self.dataset, self.members = dataset, members
        self.vocab_size = dataset.vocab_size
        self.tokens_per_batch = None

    def batch(self, split: str, *, seed: int, replica_index: int, step: int, micro: int):
        import torch

        if split != "train":
            return self.dataset.batch(split, seed=seed, replica_index=replica_index, step=step, micro=micro)
        parts = [self.dataset.batch(split, seed=seed, replica_index=m, step=step, micro=micro) for m in self.members]
        return tuple(torch.cat(xs, dim=0) for xs in zip(*parts, strict=True))


class ThreadGroup:
    """An outer group of `world` trainers in one process, one thread each: `allreduce_mean` sums in rank
    order (every rank gets the same bits), `all_gather` hands every rank every payload, `all_to_all`
    chunk j of every rank to rank j. Each rank calls through its own `ThreadGroup.Rank`, which counts
    bytes as hsgd.train.comm.LevelGroup does. A barrier that waits over 600 s raises (a bug, never a
    run's state)."""

    class Rank:
        def __init__(self, group: ThreadGroup, rank: int):
            self.group, self.rank, self.world_size = group, rank, group.world
            self.bytes_sent = self.bytes_received = 0

        def allreduce_mean(self, tensors, *, level: str) -> None:
            import torch

            assert level == "outer", level
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.bytes_sent += flat.numel() * flat.element_size()
            self.bytes_received += flat.numel() * flat.element_size()
            pieces = self.group.exchange(self.rank, flat)
            mean = torch.stack(pieces).sum(dim=0) / len(pieces)
            offset = 0
            for t in tensors:
                t.copy_(mean[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

        def all_gather(self, payload, *, level: str):
            assert level == "outer", level
            self.bytes_sent += payload.numel() * payload.element_size() * (self.world_size - 1)
            self.bytes_received += payload.numel() * payload.element_size() * (self.world_size - 1)
            return [p.clone() for p in self.group.exchange(self.rank, payload)]

        def all_to_all(self, chunks, recv_numel: int, *, level: str):
            assert level == "outer" and len(chunks) == self.world_size, (level, len(chunks))
            item = chunks[0].element_size()
            self.bytes_sent += sum(c.numel() for j, c in enumerate(chunks) if j != self.rank) * item
            self.bytes_received += recv_numel * (self.world_size - 1) * item
            received = [sent[self.rank].clone() for sent in self.group.exchange(self.rank, list(chunks))]
            assert all(c.numel() == recv_numel for c in received), "a chunk of another length than announced"
            return received

    def __init__(self, world: int):
        self.world = world
        self._slots: list = [None] * world
        self._barrier = threading.Barrier(world, timeout=600)

    def exchange(self, rank: int, value) -> list:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank read them all
        return values


def check_supported(cfg) -> None:
    s = cfg.sync
    bad = {
        "sync.inner": (s.inner, ("ddp",)),
        "sync.fragments": (s.fragments, (1,)),
        "sync.fragment_delay": (s.fragment_delay, (0,)),
        "sync.balance": (s.balance, ("none",)),
        "sync.outer_path": (s.outer_path, ("leader",)),
        "data.grad_accum": (cfg.data.grad_accum, (1,)),
    }
    for key, (value, allowed) in bad.items():
        if value not in allowed:
            raise ValueError(f"outer_sweep: {key}={value} is not simulated; valid: {', '.join(map(str, allowed))}")


def reduce_all(trainers: list, round_index: int) -> list:
    """Every trainer's outer_reduce of `round_index` at once, one thread each, over one ThreadGroup; its
    ranks (their byte counts). The first error is raised here, the other threads released."""
    from hsgd.train.comm import LevelGroup

    group = ThreadGroup(len(trainers))
    ranks = [ThreadGroup.Rank(group, k) for k in range(len(trainers))]
    errors: list[BaseException] = []

    def reduce(k: int) -> None:
        try:
            trainers[k].outer_reduce(round_index, 0, ranks[k] if len(trainers) > 1 else LevelGroup("outer"))
        except BaseException as err:  # noqa: BLE001 — re-raised below, in the caller's thread
            errors.append(err)
            group._barrier.abort()

    threads = [threading.Thread(target=reduce, args=(k,)) for k in range(len(trainers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return ranks


def simulate(overrides: list[str], *, eval_every: int = 0) -> dict:
    """Train the run `overrides` composes (see the module's shortcut) and return its eval losses."""
    import torch

    from actors.launch import compose_config
    from hsgd.config import validate
    from hsgd.core.topology import topology_of
    from hsgd.train import task
    from hsgd.train.comm import LevelGroup
    from hsgd.train.trainer import ReplicaTrainer

    torch.set_num_threads(1)
    cfg = compose_config(QUIET + list(overrides))
    validate(cfg)
    check_supported(cfg)
    topology = topology_of(cfg)
    dataset = task.build_dataset(cfg)
    clusters = [[topology.global_index(rid) for rid in topology.cluster_members(c)] for c in range(topology.clusters)]
    trainers = [
        ReplicaTrainer(cfg, topology.cluster_members(c)[0], topology, dataset=ClusterBatches(dataset, members))
        for c, members in enumerate(clusters)
    ]
    solo = LevelGroup("inner")
    started = time.perf_counter()
    losses = [trainers[0].eval_loss()]
    rounds, outer_bytes = int(cfg.train.rounds), 0
    site_sent, site_received = [0] * len(trainers), [0] * len(trainers)  # each site's slow link, both ways
    for r in range(rounds):
        for t in trainers:
            t.run_inner(r, solo)
        ranks = reduce_all(trainers, r)
        outer_bytes += sum(rk.bytes_sent for rk in ranks) if len(trainers) > 1 else 0
        for k, rk in enumerate(ranks if len(trainers) > 1 else []):
            site_sent[k] += rk.bytes_sent
            site_received[k] += rk.bytes_received
        for t in trainers:
            t.outer_commit(r, solo, (0,))
        if (eval_every and (r + 1) % eval_every == 0) or r == rounds - 1:
            losses.append(trainers[0].eval_loss())
    return {
        "overrides": list(overrides),
        "initial_eval_loss": losses[0],
        "final_eval_loss": losses[-1],
        "eval_losses": losses,
        "outer_bytes": outer_bytes,
        "site_sent_bytes": site_sent,
        "site_received_bytes": site_received,
        "outer_exchange": trainers[0].last_exchange,
        "inner_steps": rounds * int(cfg.sync.outer_every),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _job(name: str, overrides: list[str]) -> tuple[str, dict]:
    try:
        return name, simulate(overrides)
    except Exception as err:  # noqa: BLE001 — a failed job is recorded, the others still run
        return name, {"overrides": list(overrides), "error": f"{type(err).__name__}: {err}"}


def grid(name: str, steps: int, extra: list[str]) -> dict[str, list[str]]:
    """The jobs of grid `name`: {job name: overrides}. Every job has the same model, seed and inner steps."""

    def run(clusters: int, replicas: int, every: int, *more: str, model: str = "tiny") -> list[str]:
        return [
            f"model={model}",
            "seed=12",
            f"topology.clusters={clusters}",
            f"topology.replicas_per_cluster={replicas}",
            f"sync.outer_every={every}",
            f"train.rounds={steps // every}",
            *extra,
            *more,
        ]

    jobs: dict[str, list[str]] = {}
    if name in ("before", "all"):  # the runs: the old defaults (constant rate, DiLoCo's outer step)
        old = [
            "optim.inner.schedule=constant",
            "optim.inner.warmup_steps=0",
            "optim.outer.lr=0.7",
            "optim.outer.momentum=0.9",
        ]
        jobs["flat_const"] = run(1, 4, 50, "sync.outer=none", *old)
        jobs["h50_const"] = run(2, 2, 50, *old)
        jobs["h50_const_avg"] = run(2, 2, 50, *old, "sync.outer=average")
    if name in ("defaults", "all"):  # today's defaults, nothing but the topology, H and codec set
        jobs["flat"] = run(1, 4, 50, "sync.outer=none")
        jobs["h50_int4"] = run(2, 2, 50, "sync.outer_compress=int4")
        jobs["h20_int4"] = run(2, 2, 20, "sync.outer_compress=int4")
        jobs["4x1_h50_int4"] = run(4, 1, 50, "sync.outer_compress=int4")
    cos = ["optim.inner.schedule=cosine", f"optim.inner.warmup_steps={steps // 20}"]  # explicit: as the sweep ran
    if name in ("cosine", "all"):
        jobs["flat_cos"] = run(1, 4, 50, "sync.outer=none", *cos)
        for lr, mom in ((1.0, 0.0), (1.0, 0.3), (0.7, 0.9), (1.0, 0.5)):
            jobs[f"h50_cos_lr{lr}m{mom}"] = run(2, 2, 50, *cos, f"optim.outer.lr={lr}", f"optim.outer.momentum={mom}")
        jobs["flat_cos_lr6e-3"] = run(1, 4, 50, "sync.outer=none", *cos, "optim.inner.lr=6e-3")
    if name in ("spread", "all"):  # the best of `cosine` and its neighbours at other H, clusters and a codec
        for lr, mom in ((1.0, 0.3), (1.0, 0.5), (0.7, 0.9)):
            jobs[f"h20_cos_lr{lr}m{mom}"] = run(2, 2, 20, *cos, f"optim.outer.lr={lr}", f"optim.outer.momentum={mom}")
        jobs["h50_cos_int4_lr1.0m0.3"] = run(
            2, 2, 50, *cos, "sync.outer_compress=int4", "optim.outer.lr=1.0", "optim.outer.momentum=0.3"
        )
        for lr, mom in ((1.0, 0.3), (1.0, 0.5)):
            jobs[f"4x1_h50_cos_lr{lr}m{mom}"] = run(
                4, 1, 50, *cos, f"optim.outer.lr={lr}", f"optim.outer.momentum={mom}"
            )
        for lr, mom in ((1.0, 0.0), (1.0, 0.3)):
            jobs[f"h100_cos_lr{lr}m{mom}"] = run(2, 2, 100, *cos, f"optim.outer.lr={lr}", f"optim.outer.momentum={mom}")
    if name in ("four", "all"):  # four clusters of one replica: the levers left past the outer step tried in `spread`
        for lr, mom in ((1.0, 0.7), (1.3, 0.5)):
            jobs[f"4x1_h50_cos_lr{lr}m{mom}"] = run(
                4, 1, 50, *cos, f"optim.outer.lr={lr}", f"optim.outer.momentum={mom}"
            )
        jobs["4x1_h50_cos_inner1.5e-3"] = run(
            4, 1, 50, *cos, "optim.inner.lr=1.5e-3", "optim.outer.lr=1.0", "optim.outer.momentum=0.5"
        )
        jobs["4x1_h20_cos_lr1.0m0.5"] = run(4, 1, 20, *cos, "optim.outer.lr=1.0", "optim.outer.momentum=0.5")
    if name in ("small", "all"):  # issue 33 Acceptance 2's model=small pair at the defaults (run with --steps 1000)
        jobs["small_flat"] = run(1, 4, 50, "sync.outer=none", model="small")
        jobs["small_h50_int4"] = run(2, 2, 50, "sync.outer_compress=int4", model="small")
    if name in ("flat_rate", "all"):  # flat DDP's own best inner rate (cosine: 3e-3 and 6e-3 ran in `cosine`)
        jobs["flat_cos_lr1.5e-3"] = run(1, 4, 50, "sync.outer=none", *cos, "optim.inner.lr=1.5e-3")
    return jobs


def table_md(results: dict[str, dict]) -> str:
    flat = next(
        (v["final_eval_loss"] for k, v in results.items() if k.startswith("flat") and "final_eval_loss" in v), None
    )
    lines = ["| job | final eval loss | gap vs first flat | outer MB | wall s |", "| --- | --- | --- | --- | --- |"]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"| {name} | failed: {res['error']} | | | |")
            continue
        gap = f"{(res['final_eval_loss'] / flat - 1) * 100:+.1f} %" if flat else "-"
        lines.append(
            f"| {name} | {res['final_eval_loss']:.4f} | {gap} | {res['outer_bytes'] / 1e6:.1f} | {res['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks outer_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--grid", default="defaults", choices=GRIDS)
    parser.add_argument("--only", default="", help="comma-separated job names of the grid (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once (one core each)")
    parser.add_argument("--out", default="bench-results/outer_sweep")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="added to every job")
    args = parser.parse_args(argv)
    jobs = grid(args.grid, args.steps, args.set)
    if args.only:
        jobs = {k: v for k, v in jobs.items() if k in set(args.only.split(","))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_job, name, ov) for name, ov in jobs.items()]
        for done, future in enumerate(as_completed(futures), 1):
            name, res = future.result()
            results[name] = res
            loss = res.get("final_eval_loss")
            print(
                f"[outer_sweep] {done}/{len(jobs)} {name}: "
                f"{f'{loss:.4f}' if loss is not None else res.get('error')} ({res.get('wall_s', '-')} s)",
                flush=True,
            )
            atomic_write_text(
                out / "outer_sweep.json",
                json.dumps({"steps": args.steps, "grid": args.grid, "set": args.set, "results": results}, indent=1),
            )
    ordered = {k: results[k] for k in jobs if k in results}
    atomic_write_text(out / "outer_sweep.md", table_md(ordered))
    print(table_md(ordered))
    return 0 if all("error" not in r for r in results.values()) else 1
