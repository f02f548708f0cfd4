"""The torchft DiLoCo peer: hsgd's own model trained by torchft 0.2.0's `torchft.local_sgd.DiLoCo` (its Manager, a
LighthouseServer and its outer optimizer), for the convergence benchmark's `torchft_diloco_h<H>`
arm (`python -m benchmarks convergence`, issue 33, Build 3).

What is trained
    The run's hsgd config (composed from the arm's overrides, the same ones an hsgd 2 x 2 DiLoCo
    arm of the same invocation composes) says everything: model, seed, per-replica batch, inner
    optimizer (`build_inner_optimizer`), inner learning-rate schedule (`inner_lr`, with the arm's
    schedule overrides), gradient clipping, grad accumulation, H (`sync.outer_every`), the number
    of inner steps (`train.rounds` x H) and the outer step (`optim.outer.lr`, `momentum`,
    `nesterov`, through `hsgd.train.outer.outer_hyperparameters`, as hsgd's DiLoCo builds it).
    Every process seeds torch with the run's seed before building the model, so every replica
    starts from the same params as hsgd's; rank `r` of group `g` reads the batches of hsgd's
    replica `c{g}r{r}` (`dataset.batch("train", seed, replica_index=Topology(2, 2).global_index,
    step, micro)`, a pure function), so both sides train on the same tokens.

Topology
    `groups` replica groups (torchft's replica groups: hsgd's clusters) of `ranks` processes each
    (hsgd's replicas in a cluster), every one a process started as benchmarks/peers/torchft_peer.py
    starts its workers (`python -m benchmarks.peers.torchft_diloco worker <spec>`, OMP/MKL at one
    thread), all on the CPU over gloo:
    - inside a group: plain `torch.nn.parallel.DistributedDataParallel` over a gloo process group
      of the group's ranks (its own TCPStore, hosted by the group's rank 0): gradients averaged
      every inner step, as hsgd's inner `ddp`;
    - across groups: torchft. Every rank has a `torchft.Manager` (rank 0's runs the group's
      ManagerServer, which asks the lighthouse for the quorum) with a `torchft.ProcessGroupGloo`
      joining rank r of every group; `torchft.local_sgd.DiLoCo` wraps the inner optimizer: its
      step hook counts inner steps and every H-th step asks for a quorum (synchronous:
      `use_async_quorum=False`, which DiLoCo requires), takes the pseudo-gradient (params at the
      last sync - params now), averages it over the quorum (`torchft.manager.Manager.allreduce`, one all-reduce
      per parameter tensor, fp32: no quantization, which needs triton in 0.2.0), restores the
      last sync's params, sets the mean pseudo-gradient as their `.grad` and steps the outer
      optimizer (`torch.optim.SGD(lr, momentum, nesterov)`) if `should_commit()` says so.
    Lighthouse: `min_replicas = groups` (every outer step waits for every group: hsgd's arm has
    both clusters in every round), README's quorum tick (100 ms) and join timeout (10 s), the
    default heartbeat timeout (5 s). Manager: `min_replica_size = groups`, `init_sync=False` (every
    replica builds the same params from the seed; with the default True the first quorum, which
    DiLoCo asks for only at the first sync, would overwrite one group's first H steps with the
    other's), quorum timeout 10 min (a quorum is asked once per H steps).

Slow-link bytes (as convergence.py's docstring counts hsgd's): the bytes each sender hands to
the cross-group all-reduce, summed over senders and outer steps. Every rank's `torchft.manager.Manager.allreduce`
is wrapped to count its tensor's payload (numel x element size, fp32) when the manager has not
errored (an errored manager sends nothing). Under DDP every rank of a group holds the whole model,
and torchft's cross-group process group joins rank r of every group, so every rank sends its full
pseudo-gradient: per outer step `groups x ranks x 4 x params` bytes, twice what hsgd's leader path
sends for the same topology (one leader per cluster). (With FSDP inside a group, torchft's
intended HSDP, each rank would send its shard.) The per-rank figures are in `per_rank`.

Evaluation: rank 0 of group 0 computes the loss of the global params (after a sync with
`fragment_update_alpha=0` the model's params are the outer optimizer's) on hsgd's evaluation
batches, exactly as `hsgd.train.trainer.ReplicaTrainer.eval_loss` does (`dataset.batch("val", seed=task.EVAL_SEED,
replica_index=-1, step=i, micro=0)` for i < `train.eval_batches`, model in eval mode, mean of the
batch losses), before the first step and after the outer steps `train.eval_every` says
(`hsgd.core.round.schedule.due`, as hsgd's supervisor decides), the last always.

What can fail: a worker that exits non-zero ends the run (RuntimeError naming it and its log's
tail); a run past `timeout_s` raises TimeoutError; every worker is killed in a `finally`. A sync
whose `should_commit()` says no leaves the params at the last sync (torchft's behaviour) and is
counted in `commit_failures`; the status is then "incomplete" (fewer outer steps committed than
rounds). No faults are injected here: this peer measures convergence, not recovery.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0"]

LIGHTHOUSE = {"join_timeout_ms": 10000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 5000}
MANAGER = {"timeout_s": 120.0, "quorum_timeout_s": 600.0, "connect_timeout_s": 60.0, "heartbeat_interval_ms": 100}
GLOO_TIMEOUT_S = 120.0  # the cross-group all-reduce and the DDP group: waits for the slowest group's H steps + eval


def compose(overrides: Sequence[str]):
    """The run's hsgd config (validated), as an hsgd arm composes it."""
    from actors.launch import compose_config
    from hsgd.config import validate

    cfg = compose_config(QUIET + list(overrides))
    validate(cfg)
    return cfg


def check_supported(cfg) -> None:
    """What this peer reproduces: DiLoCo, inner ddp, one fragment, no delay, no codec, no balance, fp32,
    eager, on the CPU (it pads no steps: train.min_step_s and stragglers are ignored, they change
    timings only). ValueError naming the keys otherwise."""
    s, t = cfg.sync, cfg.train
    wanted = {
        "sync.outer": (s.outer, "diloco"),
        "sync.inner": (s.inner, "ddp"),
        "sync.fragments": (s.fragments, 1),
        "sync.fragment_delay": (s.fragment_delay, 0),
        "sync.outer_compress": (s.outer_compress, "none"),
        "sync.balance": (s.balance, "none"),
        "train.precision": (t.precision, "fp32"),
        "train.compile": (bool(t.compile), False),
    }
    wrong = {k: have for k, (have, want) in wanted.items() if have != want}
    if wrong:
        raise ValueError(
            f"the torchft DiLoCo peer runs {', '.join(f'{k}={w}' for k, (_, w) in wanted.items())}; not {wrong}"
        )


def run_diloco(*, overrides: Sequence[str], out: str | os.PathLike, timeout_s: float = 1800) -> dict:
    """Train the config `overrides` compose (its topology: `topology.clusters` groups of
    `topology.replicas_per_cluster` ranks) under torchft's DiLoCo and return the figures: status,
    final/initial eval loss, eval curve, slow-link bytes (total and per rank), outer steps
    committed, commit failures, whether every rank ended with the same params, wall seconds.
    Raises ValueError for a config this peer does not reproduce, TimeoutError after `timeout_s`,
    RuntimeError when a worker exits non-zero."""
    from benchmarks.peers.torchft_peer import _lighthouse_class
    from hsgd.config.rounds import steps_per_round
    from hsgd.core.topology import Topology, replica_id

    cfg = compose(overrides)
    check_supported(cfg)
    groups, ranks = int(cfg.topology.clusters), int(cfg.topology.replicas_per_cluster)
    every, rounds = int(cfg.sync.outer_every), int(cfg.train.rounds)
    steps = steps_per_round(cfg) * rounds
    topology = Topology(groups, ranks)
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "stores").mkdir(parents=True, exist_ok=True)
    for stale in list((out / "results").glob("*.json")) + list((out / "stores").glob("*")):
        stale.unlink()
    lighthouse = _lighthouse_class()(bind="[::]:0", min_replicas=groups, **LIGHTHOUSE)
    spec = {
        "overrides": list(overrides),
        "out": str(out),
        "lighthouse": lighthouse.address(),
        "groups": groups,
        "ranks": ranks,
        "steps": steps,
        "every": every,
        "rounds": rounds,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("RUST_LOG", "warn")
    procs: dict[str, subprocess.Popen] = {}
    start = time.time()
    deadline = time.monotonic() + timeout_s
    try:
        for g in range(groups):
            for r in range(ranks):
                name = f"g{g}r{r}"
                wspec = dict(spec, group=g, rank=r, name=name, index=topology.global_index(replica_id(g, r)))
                with open(out / "logs" / f"{name}.log", "wb") as log:
                    procs[name] = subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.peers.torchft_diloco", "worker", json.dumps(wspec)],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
        while True:
            codes = {name: p.poll() for name, p in procs.items()}
            failed = {name: rc for name, rc in codes.items() if rc not in (None, 0)}
            if failed:
                name = sorted(failed)[0]
                tail = (out / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"torchft DiLoCo worker {name} exited {failed[name]}:\n{tail}")
            if all(rc == 0 for rc in codes.values()):
                break
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {n} ---\n{(out / 'logs' / f'{n}.log').read_text(errors='replace')[-1200:]}" for n in procs
                )
                raise TimeoutError(f"torchft DiLoCo run did not finish within {timeout_s:.0f} s\n{tails}")
            time.sleep(0.1)
        wall = time.time() - start
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        lighthouse.shutdown()
    per_rank = {name: json.loads((out / "results" / f"{name}.json").read_text()) for name in procs}
    first = per_rank["g0r0"]
    committed = min(r["outer_steps"] for r in per_rank.values())
    digests = {r["digest"] for r in per_rank.values()}
    sent = sum(r["bytes_sent"] for r in per_rank.values())
    return {
        "peer": "torchft_diloco",
        "status": "completed" if committed == rounds and len(digests) == 1 else "incomplete",
        "final_eval_loss": first["final_eval_loss"],
        "initial_eval_loss": first["initial_eval_loss"],
        "eval_curve": first["eval_curve"],
        "rounds_committed": committed,
        "inner_steps_committed": steps,
        "slow_link_bytes": sent,
        "outer_bytes": sent,
        "inner_bytes": None,
        "params_agree": len(digests) == 1,
        "commit_failures": sum(r["commit_failures"] for r in per_rank.values()),
        "param_count": first["param_count"],
        "senders": len(per_rank),
        "per_rank": {
            n: {
                k: r[k]
                for k in ("index", "bytes_sent", "bytes_per_outer_step", "outer_steps", "commit_failures", "train_s")
            }
            for n, r in per_rank.items()
        },
        "outer": first["outer"],
        "groups": groups,
        "ranks": ranks,
        "every": every,
        "rounds": rounds,
        "wall_s": wall,
        "train_s": max(r["train_s"] for r in per_rank.values()),
        "settings": {
            "lighthouse": dict(LIGHTHOUSE, min_replicas=groups),
            "manager": dict(MANAGER, min_replica_size=groups, use_async_quorum=False, init_sync=False),
            "gloo_timeout_s": GLOO_TIMEOUT_S,
            "ddp": "torch.nn.parallel.DistributedDataParallel (gloo)",
            "quantization": False,
            "bucketization": False,
        },
    }


# -- the worker side -----------------------------------------------------------------------------


def _group_store(out: Path, group: int, rank: int, timeout_s: float):
    """The group's TCPStore: hosted by its rank 0, which writes the port to a file the others read."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    path = out / "stores" / f"g{group}.port"
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(str(store.port))
        tmp.replace(path)
        return store
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"g{group}r{rank}: the group's store did not come up within {timeout_s:g} s")
        time.sleep(0.02)
    return TCPStore(
        "127.0.0.1",
        int(path.read_text()),
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def _worker(spec: dict) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hsgd.config.auto import outer_step_of
    from hsgd.core.round.schedule import due
    from hsgd.train import task
    from hsgd.train.inner import build_inner_optimizer, inner_lr, optimizer_implementation
    from hsgd.train.outer import outer_hyperparameters
    from hsgd.train.trainer import param_digest

    out, group, rank, ranks, groups = Path(spec["out"]), spec["group"], spec["rank"], spec["ranks"], spec["groups"]
    index, steps, every, rounds = spec["index"], spec["steps"], spec["every"], spec["rounds"]
    cfg = compose(spec["overrides"])
    dataset = task.build_dataset(cfg)
    torch.manual_seed(cfg.seed)  # identical initial params everywhere, as hsgd's replicas
    model = task.build_model(cfg, dataset.vocab_size)
    params = list(model.parameters())
    loss_fn = task.build_loss(cfg)
    inner = build_inner_optimizer(cfg, params)
    foreach = optimizer_implementation(cfg) != "single"
    clip, accum, o = float(cfg.optim.inner.grad_clip), int(cfg.data.grad_accum), cfg.optim.inner

    def batch(step: int, micro: int):
        return dataset.batch("train", seed=cfg.seed, replica_index=index, step=step, micro=micro)

    @torch.no_grad()
    def eval_loss() -> float:  # as ReplicaTrainer.eval_loss (fp32, CPU: no autocast)
        model.eval()
        try:
            losses = [
                loss_fn(model, dataset.batch("val", seed=task.EVAL_SEED, replica_index=-1, step=i, micro=0))
                .detach()
                .float()
                for i in range(cfg.train.eval_batches)
            ]
        finally:
            model.train()
        return sum(torch.stack(losses).tolist()) / len(losses)

    # warm-up before joining (a fresh process's first forward/backward is slow): grads dropped
    loss_fn(model, batch(0, 0)).backward()
    for p in params:
        p.grad = None

    import torchft
    from torch.distributed import PrefixStore
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    store = _group_store(out, group, rank, MANAGER["connect_timeout_s"])
    # inside the group: plain torch DDP over gloo
    dist.init_process_group(
        "gloo",
        store=PrefixStore("hsgd_ddp", store),
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)

    def state_dict() -> dict:  # what a healing peer would receive (no heal is expected here)
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    m = MANAGER
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=groups,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"g{group}",
        lighthouse_addr=spec["lighthouse"],
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=m["timeout_s"]),
        quorum_timeout=timedelta(seconds=m["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=m["connect_timeout_s"]),
        heartbeat_interval=timedelta(milliseconds=m["heartbeat_interval_ms"]),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=m["timeout_s"]), device=torch.device("cpu")),
    )

    # the slow link: what this rank hands to the cross-group all-reduce
    sent = [0]
    allreduce = manager.allreduce

    def counting_allreduce(tensor, *args, **kwargs):
        if manager.errored() is None:
            sent[0] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counting_allreduce

    hp = outer_hyperparameters(cfg.sync.outer, *outer_step_of(cfg), cfg.optim.outer.nesterov)
    outer = torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], nesterov=hp["nesterov"])
    evaluator = group == 0 and rank == 0
    curve = [[0, eval_loss()]] if evaluator else []
    per_step_bytes: list[int] = []
    commit_failures = 0
    started = time.perf_counter()
    with DiLoCo(
        manager, [model], inner, outer, sync_every=every, backup_device=torch.device("cpu"), pin_memory=False
    ) as _diloco:
        for step in range(steps):
            for g in inner.param_groups:  # a pure function of the step, as hsgd's inner_lr
                g["lr"] = inner_lr(o, step, steps)
            inner.zero_grad(set_to_none=False)
            for micro in range(accum):
                if micro < accum - 1:
                    with ddp.no_sync():
                        (loss_fn(ddp, batch(step, micro)) / accum).backward()
                else:
                    loss = loss_fn(ddp, batch(step, micro))
                    (loss / accum if accum > 1 else loss).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=foreach)
            before, bytes_before = manager.current_step(), sent[0]
            inner.step()  # DiLoCo's post-hook: every H-th step, quorum + pseudo-gradient all-reduce + outer step
            if (step + 1) % every == 0:
                per_step_bytes.append(sent[0] - bytes_before)
                if manager.current_step() != before + 1:
                    commit_failures += 1
                done = manager.current_step()
                if evaluator and due(done, int(cfg.train.eval_every), rounds):
                    curve.append([step + 1, eval_loss()])
    train_s = time.perf_counter() - started
    result = {
        "name": spec["name"],
        "index": index,
        "pid": os.getpid(),
        "outer_steps": manager.current_step(),
        "commit_failures": commit_failures,
        "bytes_sent": sent[0],
        "bytes_per_outer_step": per_step_bytes,
        "digest": param_digest(params),
        "param_count": sum(p.numel() for p in params),
        "initial_eval_loss": curve[0][1] if curve else None,
        "final_eval_loss": curve[-1][1] if evaluator and curve[-1][0] == steps else None,
        "eval_curve": curve,
        "train_s": train_s,
        "outer": hp,
    }
    path = out / "results" / f"{spec['name']}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    dist.barrier()  # the group's rank 0 hosts its store and ManagerServer: it leaves last
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torchft's server threads need not wind down: everything is written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.torchft_diloco", description="a torchft DiLoCo worker (spawned by run_diloco)"
    )
    parser.add_argument("role", choices=["worker"])
    parser.add_argument("spec", help="the worker's spec as JSON")
    args = parser.parse_args(argv)
    return _worker(json.loads(args.spec))


if __name__ == "__main__":
    sys.exit(main())
