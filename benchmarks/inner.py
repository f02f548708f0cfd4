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
PEAK_BF16 = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12),
             ("L40S", 362e12), ("L4", 121e12), ("RTX 4090", 165e12)]


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in device_name), None)


def make_cfg(preset: str, batch_size: int, steps: int, sets: list[str]):
    """The run config, built from the typed schema (no Hydra composition, no Ray)."""
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(PRESET_DIR / f"{preset}.yaml"))
    base = [f"data.batch_size={batch_size}", f"sync.outer_every={steps}", "sync.outer=none",
            "topology.clusters=1", "topology.replicas_per_cluster=1", "train.rounds=1000000",
            "logging.wandb.mode=disabled",
            "optim.inner.schedule=constant", "optim.inner.warmup_steps=0"]  # the plain loops step at a constant rate
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
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.momentum, 0.95), weight_decay=o.weight_decay,
                                     **kind)
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
    return {"bytes": nbytes, "first_s": times[0], "steady_s": steady,
            "first_gb_per_s": nbytes / times[0] / 1e9, "steady_gb_per_s": nbytes / steady / 1e9}


def bench_preset(preset: str, args, device: str, device_name: str) -> dict:
    from hsgd.train.trainer import optimizer_implementation

    batch_size = args.batch_size or (8 if args.quick and not device.startswith("cuda") else BATCH.get(preset, 8))
    hsgd_sets = (["train.precision=bf16", "train.compile=true"] if device.startswith("cuda") else []) + args.set
    cfg = make_cfg(preset, batch_size, args.steps, hsgd_sets)
    tuned_compile = args.compile_tuned == "on" or (args.compile_tuned == "auto" and device.startswith("cuda"))
    variants = {
        "hsgd": HsgdVariant(cfg, device),
        "plain": LoopVariant(cfg, device, precision=cfg.train.precision, compile_model=bool(cfg.train.compile),
                             implementation=optimizer_implementation(cfg, device)),
        "tuned": LoopVariant(cfg, device, precision="bf16", compile_model=tuned_compile,
                             implementation="fused" if device.startswith("cuda") else "foreach"),
    }
    settings = {
        "hsgd": {"precision": cfg.train.precision, "compile": bool(cfg.train.compile),
                 "optimizer": optimizer_implementation(cfg, device), "sync.inner": cfg.sync.inner,
                 "comm.bucket_mb": float(cfg.comm.bucket_mb)},
        "plain": {"precision": cfg.train.precision, "compile": bool(cfg.train.compile),
                  "optimizer": optimizer_implementation(cfg, device)},
        "tuned": {"precision": "bf16", "compile": tuned_compile,
                  "optimizer": "fused" if device.startswith("cuda") else "foreach"},
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
    result = {"preset": preset, "params": n_params, "batch_size": batch_size, "block_size": cfg.model.block_size,
              "steps_per_repeat": args.steps, "repeats": args.repeats, "variants": {}}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        result["variants"][name] = {**settings[name], "tokens_per_s": [r["tokens_per_s"] for r in rs],
                                    "tokens_per_s_median": tps, "last_loss": rs[-1]["loss"],
                                    "mfu": 6 * n_params * tps / peak if peak else None}
    med = {name: result["variants"][name]["tokens_per_s_median"] for name in runs}
    result["ratio"] = {"hsgd_vs_plain": med["hsgd"] / med["plain"], "hsgd_vs_tuned": med["hsgd"] / med["tuned"]}
    result["heal"] = measure_heal(variants["hsgd"].trainer, device)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks inner", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for inner.json")
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (CPU: batch 8)")
    parser.add_argument("--presets", nargs="+", default=None,
                        help="conf/model presets (default: tiny small, + gpt-86m on CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per variant")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: per preset)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--compile-tuned", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile the tuned loop (auto: on CUDA only)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for hsgd's trainer (and the plain loop's settings)")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    args.steps = args.steps or (3 if args.quick and not cuda else 10 if args.quick else 30)
    args.repeats = args.repeats or (2 if args.quick else 5)
    presets = args.presets or (["tiny", "small", "gpt-86m"] if cuda else ["tiny", "small"])
    skipped = [p for p in presets if p in GPU_ONLY and not cuda]
    presets = [p for p in presets if p not in skipped]
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    out = Path(args.out or tempfile.mkdtemp(prefix="hsgd-bench-inner-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = [bench_preset(p, args, device, device_name) for p in presets]
    report = {"machine_note": "timings are this machine's; compare the ratios, measured in one invocation",
              "device": device, "device_name": device_name, "peak_bf16_flops": peak_flops(device_name) if cuda else None,
              "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
              "ray_imported": sys.modules.get("ray") is not None, "skipped_gpu_only_presets": skipped,
              "args": vars(args), "results": results}
    atomic_write_text(out / "inner.json", json.dumps(report, indent=2))
    print(f"device {device} ({device_name}), {args.repeats} interleaved repeats of {args.steps} steps")
    print(f"{'preset':>8} {'params':>8} {'batch':>8} {'variant':>6} {'numerics':>24} {'tok/s':>10} {'MFU':>6}  ratio")
    for r in results:
        for name, v in r["variants"].items():
            numerics = f"{v['precision']} {v['optimizer']}{' compiled' if v['compile'] else ''}"
            mfu = f"{v['mfu'] * 100:5.1f}%" if v["mfu"] is not None else "    -"
            ratio = {"hsgd": "", "plain": f"hsgd/plain {r['ratio']['hsgd_vs_plain']:.3f}",
                     "tuned": f"hsgd/tuned {r['ratio']['hsgd_vs_tuned']:.3f}"}[name]
            print(f"{r['preset']:>8} {r['params'] / 1e6:7.1f}M {r['batch_size']:>3}x{r['block_size']:<4} {name:>6} "
                  f"{numerics:>24} {v['tokens_per_s_median']:10.0f} {mfu:>6}  {ratio}")
        h = r["heal"]
        print(f"{r['preset']:>8} heal: state_dict of {h['bytes'] / 1e6:.1f} MB to host: "
              f"{h['steady_gb_per_s']:.2f} GB/s steady, {h['first_gb_per_s']:.2f} GB/s first call")
    if skipped:
        print(f"skipped on {device}: {' '.join(skipped)} (GPU presets)")
    print(f"inner.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
