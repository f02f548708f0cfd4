"""`python -m benchmarks inner [--out DIR] [--quick] [--presets tiny small gpt-86m] [--set key=value ...]`:
hsgd's inner step against hand-written PyTorch loops, in ONE process and WITHOUT Ray (nothing on
this path imports ray, so it runs on a bare GPU machine with torch and torchft only).

On `cuda` when present, else the CPU, for each model preset and the same batch, interleaved
(every repeat runs each variant once, in turn, so drift hits all alike):
- `hsgd`:  `hsgd.train.trainer.ReplicaTrainer.run_inner` on a solo inner group (world size 1) with the config's
           numerics (on CUDA by default train.precision=bf16, train.compile=true, fused AdamW;
           on the CPU the defaults; `--set` overrides any config key);
- `plain`: the same step written out in this file (same model, batch, precision, optimizer
           implementation, compile, grad clip; losses read back once at the end);
- `tuned`: the loop a GPU user writes: bf16 autocast, fused AdamW (foreach on the CPU), and
           torch.compile (on CUDA; on the CPU only with --compile-tuned on: it takes minutes there).
Each variant runs one untimed round first (compilation, lazy init). Reported per variant: tokens/s
of each repeat and their median; on GPU the MFU, 6 * params * tokens/s over the device's dense
bf16 peak (PEAK_BF16 below; null for a device not in it); the ratios hsgd/plain and hsgd/tuned;
and the heal's local side: the trainer's `state_dict()` (params + optimizer + outer state into host
memory, pinned buffers on CUDA) in bytes/s, first call and steady. Writes <out>/inner.json and
prints a table. Timings are this machine's: compare the ratios of one invocation.

`--gpus-per-replica k` (issue 34) adds, in the same invocation, hsgd's replica at k=1 and sharded over
k ranks with FSDP2 (hsgd.train.sharding), each in its own rank processes (k=1: one), started with
`spawn`: gloo on the CPU (one torch thread per rank), on CUDA one GPU per rank over a
"cpu:gloo,cuda:nccl" group (NCCL carries FSDP2's collectives; the trainer's replica-level scalars
and objects are CPU tensors, which NCCL refuses). Same preset, same replica batch (data.batch_size,
split across the ranks), same seed, so the losses agree. Every repeat runs one round of k=1, then
one of k (interleaved); a round is `steps` inner steps and a DiLoCo commit over solo groups, so the
state holds what a training replica holds. Reported per k, under inner.json's "sharded" key and
printed after the table: the replica's tokens/s (its whole batch over the slowest rank's seconds;
median of the repeats) and its ratio to k=1; the training state's bytes per rank (the trainer's
local tensors: params, grads, inner optimizer state, global params, outer momentum, residual and
snapshot where held) and its ratio to k=1 (the largest rank's); on CUDA the peak allocated bytes
per rank. With fewer than k GPUs on CUDA the section is skipped with a line saying so. Failures:
a rank that raises, dies or answers no command within RANK_TIMEOUT_S fails the invocation, naming
the rank (its traceback when it had one); every rank process is stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

PRESET_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"
# the batch each preset is measured with (sequences, and the preset's own block size)
BATCH = {"tiny": 8, "small": 64, "gpt-30m": 32, "gpt-86m": 16}
GPU_ONLY = {"gpt-30m", "gpt-86m"}
# dense bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name (first match)
PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
]


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in device_name), None)


def make_cfg(preset: str, batch_size: int, steps: int, sets: list[str]):
    """The run config, built from the typed schema (no Hydra composition, no Ray)."""
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(PRESET_DIR / f"{preset}.yaml"))
    base = [
        f"data.batch_size={batch_size}",
        f"sync.outer_every={steps}",
        "sync.outer=none",
        "topology.clusters=1",
        "topology.replicas_per_cluster=1",
        "train.rounds=1000000",
        "logging.wandb.mode=disabled",
        "optim.inner.schedule=constant",
        "optim.inner.warmup_steps=0",
    ]  # the plain loops step at a constant rate
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(base + sets))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class HsgdVariant:
    """hsgd's own inner phase: one round of `steps` steps per call, committed (outer `none`)."""

    def __init__(self, cfg, device: str):
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup
        from hsgd.train.trainer import ReplicaTrainer

        self.trainer = ReplicaTrainer(cfg, "c0r0", Topology(1, 1), device=device)
        self.inner = LevelGroup("inner", backend="gloo")
        self.inner.configure(None, "bench-inner", 0, 1, 0)  # world size 1: no store, no peers
        self.device = device
        self.num_params = sum(p.numel() for p in self.trainer.params)

    def run(self) -> tuple[int, float, float]:
        """(tokens, seconds, last loss) of one round."""
        t = self.trainer
        _sync(self.device)
        start = time.perf_counter()
        report = t.run_inner(t.round, self.inner)
        _sync(self.device)
        seconds = time.perf_counter() - start
        t.outer_commit(t.round, self.inner, roots=(0,))
        return report.tokens, seconds, report.losses[-1]


class LoopVariant:
    """The inner step written out by hand: forward under autocast when bf16, backward, clip,
    optimizer step; losses stay on the device until the round's end."""

    def __init__(self, cfg, device: str, *, precision: str, compile_model: bool, implementation: str):
        import torch

        from hsgd.train import task

        self.cfg, self.device, self.precision = cfg, device, precision
        self.dataset = task.build_dataset(cfg)
        torch.manual_seed(cfg.seed)
        self.model = task.build_model(cfg, self.dataset.vocab_size).to(device)
        self.params = list(self.model.parameters())
        self.num_params = sum(p.numel() for p in self.params)
        self.step_model = torch.compile(self.model) if compile_model else self.model
        o = cfg.optim.inner
        kind = {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
        self.opt = torch.optim.AdamW(
            self.params, lr=o.lr, betas=(o.momentum, 0.95), weight_decay=o.weight_decay, **kind
        )
        self.foreach = implementation != "single"
        self.step = 0

    def _to_device(self, t):
        if self.device.startswith("cuda"):
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def run(self) -> tuple[int, float, float]:
        import torch

        cfg, device_type = self.cfg, self.device.split(":")[0]
        steps, B, T = cfg.sync.outer_every, cfg.data.batch_size, cfg.model.block_size
        losses = []
        _sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            x, y = self.dataset.batch("train", seed=cfg.seed, replica_index=0, step=self.step, micro=0)
            x, y = self._to_device(x), self._to_device(y)
            self.opt.zero_grad(set_to_none=False)
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                _, loss = self.step_model(x, y)
            loss.backward()
            if cfg.optim.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.inner.grad_clip, foreach=self.foreach)
            self.opt.step()
            losses.append(loss.detach().float())
            self.step += 1
        last = torch.stack(losses).tolist()[-1]  # the one read-back
        _sync(self.device)
        return steps * B * T, time.perf_counter() - start, last


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def measure_heal(trainer, device: str, repeats: int = 3) -> dict:
    """The heal's local side: the trainer's state into host memory."""
    times, nbytes = [], 0
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        state = trainer.state_dict()
        _sync(device)
        times.append(time.perf_counter() - start)
        nbytes = _tensor_bytes(state)
        del state
    steady = statistics.median(times[1:])
    return {
        "bytes": nbytes,
        "first_s": times[0],
        "steady_s": steady,
        "first_gb_per_s": nbytes / times[0] / 1e9,
        "steady_gb_per_s": nbytes / steady / 1e9,
    }


def batch_of(preset: str, args, device: str) -> int:
    """Sequences per step (per replica): --batch-size, else 8 for --quick on the CPU, else the preset's."""
    return args.batch_size or (8 if args.quick and not device.startswith("cuda") else BATCH.get(preset, 8))


def bench_preset(preset: str, args, device: str, device_name: str) -> dict:
    from hsgd.train.inner import optimizer_implementation

    batch_size = batch_of(preset, args, device)
    hsgd_sets = (["train.precision=bf16", "train.compile=true"] if device.startswith("cuda") else []) + args.set
    cfg = make_cfg(preset, batch_size, args.steps, hsgd_sets)
    tuned_compile = args.compile_tuned == "on" or (args.compile_tuned == "auto" and device.startswith("cuda"))
    variants = {
        "hsgd": HsgdVariant(cfg, device),
        "plain": LoopVariant(
            cfg,
            device,
            precision=cfg.train.precision,
            compile_model=bool(cfg.train.compile),
            implementation=optimizer_implementation(cfg, device),
        ),
        "tuned": LoopVariant(
            cfg,
            device,
            precision="bf16",
            compile_model=tuned_compile,
            implementation="fused" if device.startswith("cuda") else "foreach",
        ),
    }
    settings = {
        "hsgd": {
            "precision": cfg.train.precision,
            "compile": bool(cfg.train.compile),
            "optimizer": optimizer_implementation(cfg, device),
            "sync.inner": cfg.sync.inner,
            "comm.bucket_mb": float(cfg.comm.bucket_mb),
        },
        "plain": {
            "precision": cfg.train.precision,
            "compile": bool(cfg.train.compile),
            "optimizer": optimizer_implementation(cfg, device),
        },
        "tuned": {
            "precision": "bf16",
            "compile": tuned_compile,
            "optimizer": "fused" if device.startswith("cuda") else "foreach",
        },
    }
    for v in variants.values():  # one untimed round each: compilation and lazy initialisation
        v.run()
    runs = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, v in variants.items():
            tokens, seconds, loss = v.run()
            runs[name].append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "loss": loss})
    n_params = variants["hsgd"].num_params
    peak = peak_flops(device_name) if device.startswith("cuda") else None
    result = {
        "preset": preset,
        "params": n_params,
        "batch_size": batch_size,
        "block_size": cfg.model.block_size,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "variants": {},
    }
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        result["variants"][name] = {
            **settings[name],
            "tokens_per_s": [r["tokens_per_s"] for r in rs],
            "tokens_per_s_median": tps,
            "last_loss": rs[-1]["loss"],
            "mfu": 6 * n_params * tps / peak if peak else None,
        }
    med = {name: result["variants"][name]["tokens_per_s_median"] for name in runs}
    result["ratio"] = {"hsgd_vs_plain": med["hsgd"] / med["plain"], "hsgd_vs_tuned": med["hsgd"] / med["tuned"]}
    result["heal"] = measure_heal(variants["hsgd"].trainer, device)
    return result


# -- a replica sharded over k ranks (--gpus-per-replica k) -------------------------------------
RANK_TIMEOUT_S = 600.0  # one command's deadline per rank: a first round with compilation takes a minute or two


def _progress(line: str) -> None:
    """Progress of the long work, on stderr: stdout keeps the table."""
    print(f"[bench inner] {line}", file=sys.stderr, flush=True)


def state_bytes(trainer) -> dict[str, int]:
    """The training state this rank's trainer holds, by part, counted on its own (local) tensors:
    params, their grads, the inner optimizer's state, the outer global params and momentum, the
    error-feedback residual and the overlap snapshot (zero where not held)."""
    outer = trainer.outer_opt
    snapshot = trainer._outer_snapshot
    parts = {
        "params": _tensor_bytes(list(trainer.params)),
        "grads": _tensor_bytes([p.grad for p in trainer.params if p.grad is not None]),
        "inner_optimizer": _tensor_bytes(list(trainer.inner_opt.state.values())),
        "global_params": _tensor_bytes(list(outer.global_params)),
        "outer_momentum": _tensor_bytes(list(outer._sgd.state.values())),
        "outer_residual": _tensor_bytes(trainer.outer_residual or []),
        "outer_snapshot": 0 if snapshot is None else _tensor_bytes(snapshot[1]),
    }
    return {**parts, "total": sum(parts.values())}


def _rank_main(rank: int, k: int, store_port: int | None, cfg, cuda: bool, commands, results) -> None:
    """One rank process of a replica of k ranks: build the trainer, then answer commands from the
    parent ("round", "state", "stop") until "stop", or until none arrives within RANK_TIMEOUT_S (the
    parent is gone). Any error is reported with its traceback, then the process ends."""
    import queue
    import traceback
    from datetime import timedelta

    import torch

    try:
        if not cuda:
            torch.set_num_threads(1)  # k ranks share the machine's cores
        device = f"cuda:{rank}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(rank)
        import torch.distributed as dist

        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup
        from hsgd.train.sharding import ReplicaRanks
        from hsgd.train.trainer import ReplicaTrainer

        ranks = None
        if k > 1:  # the replica's own group of its k processes (level "replica")
            store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=RANK_TIMEOUT_S))
            dist.init_process_group(
                "cpu:gloo,cuda:nccl" if cuda else "gloo",
                store=dist.PrefixStore(f"bench-inner/k{k}", store),
                rank=rank,
                world_size=k,
                timeout=timedelta(seconds=RANK_TIMEOUT_S),
                device_id=torch.device(device) if cuda else None,
            )
            ranks = ReplicaRanks(rank, k, dist.group.WORLD)
        trainer = ReplicaTrainer(cfg, "c0r0", Topology(1, 1), device=device, ranks=ranks)
        inner, outer = LevelGroup("inner", backend="gloo"), LevelGroup("outer", backend="gloo")
        inner.configure(None, f"bench-inner/k{k}/inner", 0, 1, 0)  # one replica: no peers at either level
        outer.configure(None, f"bench-inner/k{k}/outer", 0, 1, 0)
        results.put({"rank": rank, "ready": True})
        while True:
            try:
                command = commands.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                return  # the parent is gone: nothing left to answer
            if command == "stop":
                break
            if command == "round":
                _sync(device)
                first, start = trainer.step, time.perf_counter()
                report = trainer.run_inner(trainer.round, inner)
                _sync(device)
                seconds = time.perf_counter() - start
                # the replica's tokens from the committed steps (a sharded InnerReport's `tokens` reads 0)
                tokens = (trainer.step - first) * trainer.tokens_per_step
                trainer.outer_reduce(trainer.round, 1, outer)
                trainer.outer_commit(trainer.round, inner, roots=(0,))
                results.put({"rank": rank, "tokens": tokens, "seconds": seconds, "loss": report.losses[-1]})
            elif command == "state":
                peak = torch.cuda.max_memory_allocated(device) if cuda else None
                results.put({"rank": rank, "state": state_bytes(trainer), "peak_device_bytes": peak})
            else:
                raise ValueError(f"unknown command {command!r}: round | state | stop")
        if k > 1:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — every failure goes to the parent, with its traceback
        results.put({"rank": rank, "exception": traceback.format_exc()})


class ShardedReplica:
    """A replica of k rank processes (k=1: one process, no replica group), driven by commands."""

    def __init__(self, k: int, cfg, cuda: bool):
        import multiprocessing
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.k = k
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: no inherited torch threads
        self.results = ctx.Queue()
        self.store = (
            TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=RANK_TIMEOUT_S))
            if k > 1
            else None
        )
        port = self.store.port if self.store is not None else None
        self.commands = [ctx.Queue() for _ in range(k)]
        self.procs = [
            ctx.Process(
                target=_rank_main, args=(rank, k, port, cfg, cuda, self.commands[rank], self.results), daemon=True
            )
            for rank in range(k)
        ]
        for p in self.procs:
            p.start()
        try:
            self._answers()  # every rank built its trainer
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> list[dict]:
        """One answer per rank, in rank order. Raises RuntimeError naming the rank that raised,
        died, or did not answer within RANK_TIMEOUT_S."""
        import queue

        answers: dict[int, dict] = {}
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while len(answers) < self.k:
            try:
                answer = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in answers]
                if dead:
                    raise RuntimeError(
                        f"k={self.k}: rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode})"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.k)) - set(answers))
                    raise RuntimeError(
                        f"k={self.k}: ranks {missing} gave no answer in {RANK_TIMEOUT_S:.0f} s"
                    ) from None
                continue
            if "exception" in answer:
                raise RuntimeError(f"k={self.k}: rank {answer['rank']} failed:\n{answer['exception']}")
            answers[answer["rank"]] = answer
        return [answers[r] for r in range(self.k)]

    def ask(self, command: str) -> list[dict]:
        for q in self.commands:
            q.put(command)
        return self._answers()

    def stop(self) -> None:
        """Ask every rank to stop; a rank still alive after 10 s is killed."""
        for q in self.commands:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def bench_sharded(preset: str, args, device: str) -> dict:
    """hsgd's replica at k=1 and sharded over k=args.gpus_per_replica ranks, interleaved (see the
    module's docstring). Returns the preset's entry of inner.json's "sharded" results."""
    k, cuda = args.gpus_per_replica, device.startswith("cuda")
    batch_size = batch_of(preset, args, device)
    # diloco over solo groups: the commit builds the outer momentum a training replica holds
    sets = (["train.precision=bf16", "train.compile=true"] if cuda else []) + ["sync.outer=diloco"] + args.set
    cfg = make_cfg(preset, batch_size, args.steps, sets)
    runs: dict[int, list[dict]] = {1: [], k: []}
    replicas: dict[int, ShardedReplica] = {}
    try:
        for ranks in (1, k):
            _progress(
                f"{preset}: starting k={ranks} ({ranks} rank process{'es' if ranks > 1 else ''}), "
                f"then one untimed round"
            )
            replicas[ranks] = ShardedReplica(ranks, cfg, cuda)
            replicas[ranks].ask("round")  # compilation, lazy initialisation
        for repeat in range(args.repeats):
            for ranks, replica in replicas.items():
                answers = replica.ask("round")
                seconds = max(a["seconds"] for a in answers)  # the replica's round ends with its slowest rank
                runs[ranks].append(
                    {
                        "tokens": answers[0]["tokens"],
                        "seconds": seconds,
                        "tokens_per_s": answers[0]["tokens"] / seconds,
                        "loss": answers[0]["loss"],
                    }
                )
                _progress(
                    f"{preset}: repeat {repeat + 1}/{args.repeats} k={ranks}: "
                    f"{runs[ranks][-1]['tokens_per_s']:.0f} tokens/s"
                )
        states = {ranks: replica.ask("state") for ranks, replica in replicas.items()}
    finally:
        for replica in replicas.values():
            replica.stop()
    per_k = {}
    for ranks, rs in runs.items():
        per_rank = [a["state"]["total"] for a in states[ranks]]
        peaks = [a["peak_device_bytes"] for a in states[ranks]]
        per_k[str(ranks)] = {
            "ranks": ranks,
            "rows_per_rank": batch_size // ranks,
            "tokens_per_s": [r["tokens_per_s"] for r in rs],
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "last_loss": rs[-1]["loss"],
            "state_bytes_per_rank": per_rank,
            "state_bytes_per_rank_max": max(per_rank),
            "state_bytes_by_part_rank0": states[ranks][0]["state"],
            "peak_device_bytes_per_rank": None if peaks[0] is None else peaks,
        }
    one, many = per_k["1"], per_k[str(k)]
    return {
        "preset": preset,
        "batch_size": batch_size,
        "block_size": cfg.model.block_size,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "settings": {
            "precision": cfg.train.precision,
            "compile": bool(cfg.train.compile),
            "sync.outer": cfg.sync.outer,
            "sync.outer_compress": cfg.sync.outer_compress,
        },
        "k": per_k,
        "ratio": {
            "tokens_per_s": many["tokens_per_s_median"] / one["tokens_per_s_median"],
            "state_bytes_per_rank": many["state_bytes_per_rank_max"] / one["state_bytes_per_rank_max"],
        },
    }


def sharded_section(presets: list[str], args, device: str) -> dict:
    """inner.json's "sharded" entry: the per-preset results, or why the section was skipped."""
    import torch

    k = args.gpus_per_replica
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    section = {"gpus_per_replica": k, "backend": backend, "skipped": None, "results": []}
    if device.startswith("cuda") and torch.cuda.device_count() < k:
        section["skipped"] = (
            f"--gpus-per-replica {k} needs {k} GPUs (one per rank); this machine has {torch.cuda.device_count()}"
        )
        return section
    section["results"] = [bench_sharded(p, args, device) for p in presets]
    return section


def print_sharded(section: dict) -> None:
    k = section["gpus_per_replica"]
    if section["skipped"]:
        print(f"sharded replica skipped: {section['skipped']}")
        return
    print(f"a replica sharded over k ranks (FSDP2, {section['backend']}), k=1 vs k={k}, same replica batch")
    print(
        f"{'preset':>8} {'k':>3} {'rows/rank':>9} {'tok/s':>10} {'vs k=1':>7} {'state/rank':>11} {'vs k=1':>7}"
        "  last loss"
    )
    for r in section["results"]:
        for key, v in r["k"].items():
            ratio = r["ratio"] if key != "1" else {"tokens_per_s": 1.0, "state_bytes_per_rank": 1.0}
            print(
                f"{r['preset']:>8} {v['ranks']:>3} {v['rows_per_rank']:>4}x{r['block_size']:<4} "
                f"{v['tokens_per_s_median']:10.0f} {ratio['tokens_per_s']:6.3f}x "
                f"{v['state_bytes_per_rank_max'] / 1e6:8.1f} MB {ratio['state_bytes_per_rank']:6.3f}x  "
                f"{v['last_loss']:.5f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks inner", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for inner.json")
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (CPU: batch 8)")
    parser.add_argument(
        "--presets", nargs="+", default=None, help="conf/model presets (default: tiny small, + gpt-86m on CUDA)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per variant")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: per preset)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument(
        "--compile-tuned",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the tuned loop (auto: on CUDA only)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for hsgd's trainer (and the plain loop's settings)",
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=int,
        default=None,
        metavar="K",
        help="also run hsgd's replica at k=1 and sharded over K ranks (FSDP2), interleaved",
    )
    args = parser.parse_args(argv)
    if args.gpus_per_replica is not None and args.gpus_per_replica < 2:
        parser.error(f"--gpus-per-replica {args.gpus_per_replica}: must be at least 2 (k=1 always runs beside it)")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    args.steps = args.steps or (3 if args.quick and not cuda else 10 if args.quick else 30)
    args.repeats = args.repeats or (2 if args.quick else 5)
    presets = args.presets or (["tiny", "small", "gpt-86m"] if cuda else ["tiny", "small"])
    skipped = [p for p in presets if p in GPU_ONLY and not cuda]
    presets = [p for p in presets if p not in skipped]
    uneven = [p for p in presets if args.gpus_per_replica and batch_of(p, args, device) % args.gpus_per_replica]
    if uneven:
        parser.error(
            f"--gpus-per-replica {args.gpus_per_replica}: the batch of preset {uneven[0]} "
            f"({batch_of(uneven[0], args, device)} sequences) does not split across "
            f"{args.gpus_per_replica} ranks; pass --batch-size as a multiple of {args.gpus_per_replica}"
        )
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-inner-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = [bench_preset(p, args, device, device_name) for p in presets]
    sharded = sharded_section(presets, args, device) if args.gpus_per_replica else None
    report = {
        "machine_note": "timings are this machine's; compare the ratios, measured in one invocation",
        "device": device,
        "device_name": device_name,
        "peak_bf16_flops": peak_flops(device_name) if cuda else None,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "ray_imported": sys.modules.get("ray") is not None,
        "skipped_gpu_only_presets": skipped,
        "args": vars(args),
        "results": results,
    }
    if sharded is not None:
        report["sharded"] = sharded
    atomic_write_text(out / "inner.json", json.dumps(report, indent=2))
    print(f"device {device} ({device_name}), {args.repeats} interleaved repeats of {args.steps} steps")
    print(f"{'preset':>8} {'params':>8} {'batch':>8} {'variant':>6} {'numerics':>24} {'tok/s':>10} {'MFU':>6}  ratio")
    for r in results:
        for name, v in r["variants"].items():
            numerics = f"{v['precision']} {v['optimizer']}{' compiled' if v['compile'] else ''}"
            mfu = f"{v['mfu'] * 100:5.1f}%" if v["mfu"] is not None else "    -"
            ratio = {
                "hsgd": "",
                "plain": f"hsgd/plain {r['ratio']['hsgd_vs_plain']:.3f}",
                "tuned": f"hsgd/tuned {r['ratio']['hsgd_vs_tuned']:.3f}",
            }[name]
            print(
                f"{r['preset']:>8} {r['params'] / 1e6:7.1f}M {r['batch_size']:>3}x{r['block_size']:<4} {name:>6} "
                f"{numerics:>24} {v['tokens_per_s_median']:10.0f} {mfu:>6}  {ratio}"
            )
        h = r["heal"]
        print(
            f"{r['preset']:>8} heal: state_dict of {h['bytes'] / 1e6:.1f} MB to host: "
            f"{h['steady_gb_per_s']:.2f} GB/s steady, {h['first_gb_per_s']:.2f} GB/s first call"
        )
    if sharded is not None:
        print_sharded(sharded)
    if skipped:
        print(f"skipped on {device}: {' '.join(skipped)} (GPU presets)")
    print(f"inner.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
