"""`python -m benchmarks ddp [--quick] [--out DIR] [--steps N] [--repeats R] [--model small]`: hsgd's inner
`ddp` against torch's DistributedDataParallel, 1 cluster x 2 replicas over gloo, no Ray.

Two processes (spawned here, one TCPStore in this process) each run, interleaved, R times:
- `hsgd`: `hsgd.train.trainer.ReplicaTrainer.run_inner` for one round of N steps on a 2-member inner LevelGroup
  (gradients all-reduced as `comm.bucket_mb` buckets from backward hooks when the trainer has
  them; the "buckets" field says whether it did);
- `hsgd_unbucketed`: the same with comm.bucket_mb=0 (one all-reduce after the whole backward);
- `torch_ddp`: `torch.nn.parallel.DistributedDataParallel` (bucket_cap_mb = comm.bucket_mb) on the
  same model, batches, loss, gradient clipping and AdamW, over a plain gloo process group.
Writes <out>/ddp.json: tokens/s of each (both replicas' tokens over the slower replica's wall time,
median over the repeats) and the ratios hsgd / torch_ddp measured in this one invocation. Timings
are this machine's: compare the ratios. One warm-up round of each is not counted. The bench ends a
round by hand (`trainer.round += 1`): no outer sync is run or measured.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

CASES = ("hsgd", "hsgd_unbucketed", "torch_ddp")


def _config(model: str, steps: int, overrides: list[str]):
    from actors.launch import compose_config

    return compose_config(
        [
            f"model={model}",
            "topology.clusters=1",
            "topology.replicas_per_cluster=2",
            "sync.inner=ddp",
            f"sync.outer_every={steps}",
            "train.rounds=1000",
            "logging.wandb.mode=disabled",
            "checkpoint.every=0",
            *overrides,
        ]
    )


def _worker(rank: int, port: int, args: dict, results) -> None:
    try:
        results.put(_measure(rank, port, args))
    except BaseException as err:  # noqa: BLE001 — report to the parent instead of hanging it
        import traceback

        results.put({"rank": rank, "exception": f"{err!r}\n{traceback.format_exc()}"})


def _measure(rank: int, port: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hsgd.core.topology import Topology
    from hsgd.train import task
    from hsgd.train.comm import LevelGroup
    from hsgd.train.inner import build_inner_optimizer
    from hsgd.train.trainer import ReplicaTrainer

    torch.set_num_threads(args["threads"])
    cfg = _config(args["model"], args["steps"], args["overrides"])
    rid = f"c0r{rank}"
    topo = Topology(1, 2)
    trainers = {"hsgd": ReplicaTrainer(cfg, rid, topo)}
    flat_cfg = OmegaConf.merge(cfg, {"comm": {"bucket_mb": 0}})
    trainers["hsgd_unbucketed"] = ReplicaTrainer(flat_cfg, rid, topo, dataset=trainers["hsgd"].dataset)
    addr = f"127.0.0.1:{port}/{'0' * 32}"
    group = LevelGroup("inner", "gloo", timeout_s=cfg.comm.timeout_s, configure_timeout_s=30.0)
    group.configure(addr, "bench-ddp/epoch1/inner/c0", rank=rank, world_size=2, epoch=1)

    # torch DDP on the same model (same seed), batches, loss and AdamW
    base = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("torch-ddp", base), rank=rank, world_size=2)
    ref = trainers["hsgd"]
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg, ref.dataset.vocab_size)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=float(cfg.comm.bucket_mb))
    ddp_opt = build_inner_optimizer(cfg, list(model.parameters()))
    clip, foreach = float(cfg.optim.inner.grad_clip), ref.foreach
    loss_fn = task.build_loss(cfg)
    ddp_step = [0]

    def run_ddp(steps: int) -> None:
        for _ in range(steps):
            ddp_opt.zero_grad(set_to_none=False)
            batch = ref.dataset.batch("train", seed=cfg.seed, replica_index=ref.global_index, step=ddp_step[0], micro=0)
            loss_fn(ddp, batch).backward()
            if clip > 0:  # the same math as hsgd's step
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
            ddp_opt.step()
            ddp_step[0] += 1

    def run_hsgd(name: str) -> None:
        t = trainers[name]
        t.run_inner(t.round, group)
        t.round += 1  # the round "commits" by hand: no outer sync in this bench

    def timed(name: str) -> float:
        dist.barrier()  # both replicas start together
        start = time.perf_counter()
        run_ddp(args["steps"]) if name == "torch_ddp" else run_hsgd(name)
        return time.perf_counter() - start

    for name in CASES:  # warm-up: first forward/backward, allocator, lazy imports
        timed(name)
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args["repeats"]):
        for name in CASES:
            seconds[name].append(timed(name))
    dist.barrier()
    dist.destroy_process_group()
    group.abort()
    return {
        "rank": rank,
        "seconds": seconds,
        "tokens_per_step": ref.tokens_per_step,
        "buckets": trainers["hsgd"].buckets is not None and len(trainers["hsgd"].buckets.buckets),
        "params": ref.param_bytes // 4,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for ddp.json")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=10, help="inner steps per timed round")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds of each case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--quick", action="store_true", help="a smoke run: model tiny, 3 steps, 1 repeat")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. comm.bucket_mb=5)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.repeats = "tiny", 3, 1
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-ddp-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    shared = {
        "model": args.model,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "overrides": args.overrides,
    }
    procs = [ctx.Process(target=_worker, args=(rank, store.port, shared, results), daemon=True) for rank in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    outs = {}
    try:
        deadline = time.monotonic() + 60 + 12 * args.steps * (args.repeats + 1)
        while len(outs) < 2:
            o = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if "exception" in o:
                raise RuntimeError(f"replica {o['rank']} failed: {o['exception']}")
            outs[o["rank"]] = o
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    tokens = 2 * args.steps * outs[0]["tokens_per_step"]  # both replicas' tokens per timed round
    report: dict = {
        "machine_note": "timings are this machine's; compare the ratios, measured in one invocation",
        "args": vars(args),
        "params": outs[0]["params"],
        "trainer_used_buckets": bool(outs[0]["buckets"]),
        "buckets": outs[0]["buckets"] or 0,
        "wall_s": time.monotonic() - start,
        "cases": {},
    }
    for name in CASES:
        per_round = [max(a, b) for a, b in zip(outs[0]["seconds"][name], outs[1]["seconds"][name], strict=True)]
        report["cases"][name] = {
            "seconds": per_round,
            "tokens_per_s": tokens / statistics.median(per_round),
            "tokens_per_s_each": [tokens / s for s in per_round],
        }
    ddp_tps = report["cases"]["torch_ddp"]["tokens_per_s"]
    report["ratio_hsgd_vs_torch_ddp"] = report["cases"]["hsgd"]["tokens_per_s"] / ddp_tps
    report["ratio_hsgd_unbucketed_vs_torch_ddp"] = report["cases"]["hsgd_unbucketed"]["tokens_per_s"] / ddp_tps
    report["ratio_each_repeat"] = [
        h / d
        for h, d in zip(
            report["cases"]["hsgd"]["tokens_per_s_each"], report["cases"]["torch_ddp"]["tokens_per_s_each"], strict=True
        )
    ]
    atomic_write_text(out / "ddp.json", json.dumps(report, indent=2))
    for name in CASES:
        print(f"{name:>16}: {report['cases'][name]['tokens_per_s']:9.0f} tok/s")
    print(
        f"hsgd / torch DDP: {report['ratio_hsgd_vs_torch_ddp']:.3f} "
        f"(unbucketed {report['ratio_hsgd_unbucketed_vs_torch_ddp']:.3f}; "
        f"trainer buckets: {report['buckets']}); ddp.json in {out}"
    )
    return 0
