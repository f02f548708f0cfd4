"""A complete user task for hsgd, outside the package: forecast a noisy signal with an MLP.

Not a language model: the model is a small MLP, the data a synthetic signal (a sum of sines plus
noise) generated on demand, the loss a mean-squared error. Train it with

    python -m jobs.train model._target_=examples.regression.build_mlp \\
        data._target_=examples.regression.build_dataset loss._target_=examples.regression.mse_loss \\
        model.block_size=32 +model.args.hidden=64 data.batch_size=16 optim.inner.lr=0.001

(from the folder that holds `examples/`, which is then on the path of every replica).

What hsgd asks of each piece (hsgd/train/task.py, README "Bring your own model and data"):
- the model factory returns an nn.Module, built from torch's default generator (hsgd seeds it);
- the dataset's `batch(split, *, seed, replica_index, step, micro)` is a pure function of its
  arguments and returns CPU tensors: here (x, y) with x the last `block_size` points of the signal
  and y the next one;
- the loss takes (model, batch) and returns a scalar tensor.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """(B, window) -> (B,): the next point of the signal from the `window` before it."""

    def __init__(self, window: int, hidden: int, depth: int):
        super().__init__()
        layers, width = [], window
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)  # (B,)


def build_mlp(model_cfg, hidden: int = 64, depth: int = 2) -> MLP:
    """model._target_: the window is model.block_size; model.args may set hidden and depth."""
    return MLP(model_cfg.block_size, hidden, depth)


def _seed(*parts) -> int:
    """A well-spread 63-bit seed from the parts (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class SineDataset:
    """A noisy sum of sines over t = 0, 1, 2, ...; train windows start in [0, TRAIN_SPAN), val
    windows after it. Nothing is stored: a batch is computed from its arguments alone."""

    TRAIN_SPAN = 1_000_000
    VAL_SPAN = 100_000

    def __init__(self, batch_size: int, window: int, waves: int, noise: float):
        g = torch.Generator().manual_seed(_seed("waves", waves))  # the signal itself: fixed for all runs
        self.freq = torch.rand(waves, generator=g, dtype=torch.float64) * 0.2 + 0.01  # radians per step
        self.phase = torch.rand(waves, generator=g, dtype=torch.float64) * 2 * math.pi
        self.amp = torch.rand(waves, generator=g, dtype=torch.float64) + 0.5
        self.batch_size, self.window, self.noise = batch_size, window, noise
        self.source = f"examples.regression:sines(waves={waves}, noise={noise})"
        self.vocab_size = None  # not tokens
        self.tokens_per_batch = batch_size  # samples, for the throughput figures

    def _signal(self, t: torch.Tensor) -> torch.Tensor:  # t (..., ) float64 -> (..., ) float64
        return (self.amp * torch.sin(t[..., None] * self.freq + self.phase)).sum(-1)

    def batch(self, split: str, *, seed: int, replica_index: int, step: int, micro: int):
        if split not in ("train", "val"):
            raise ValueError(f"split {split!r} is not train or val")
        g = torch.Generator().manual_seed(_seed(split, seed, replica_index, step, micro))
        base, span = (0, self.TRAIN_SPAN) if split == "train" else (self.TRAIN_SPAN, self.VAL_SPAN)
        start = base + torch.randint(0, span - self.window - 1, (self.batch_size,), generator=g)  # (B,)
        t = (start[:, None] + torch.arange(self.window + 1)).double()  # (B, window + 1)
        noisy = self._signal(t) + self.noise * torch.randn(t.shape, generator=g, dtype=torch.float64)
        noisy = noisy.float()
        return noisy[:, :-1].contiguous(), noisy[:, -1].contiguous()  # x (B, window), y (B,)


def build_dataset(data_cfg, block_size: int, waves: int = 3, noise: float = 0.05) -> SineDataset:
    """data._target_: windows of model.block_size points, data.batch_size of them per batch."""
    return SineDataset(data_cfg.batch_size, block_size, waves, noise)


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    """loss._target_: mean squared error of the forecast."""
    x, y = batch
    return F.mse_loss(model(x).float(), y)
