"""What a run trains: the model, its data and its loss, each a Hydra-style `_target_` (a dotted
`package.module.callable`, importable where the replica runs) called as `target(**args, **context)`
with only the context names its signature accepts (all if it takes **kwargs; README, "Bring your
own model and data", lists them). An `args` name that is also a context name is refused
(ValueError): hsgd supplies it. A `_target_` that does not import to a callable is a ConfigError
naming the field (`resolve`).

The Dataset contract: `source: str` (for the record), `vocab_size: int | None` (None: not tokens),
optional `tokens_per_batch` (what one batch counts for tokens/s; default batch_size * block_size),
and `batch(split, *, seed, replica_index, step, micro)` -> a CPU tensor or a tuple/list/dict of
them, handed to the loss as it is. `batch` is PURE in its arguments: the same call gives the same
batch in any process at any time, so a healed or restarted replica reads exactly the stream it
would have read (no data-loader state; its data position IS its step). Evaluation draws
batch("val", seed=EVAL_SEED, replica_index=-1, step=i, micro=0) for i < train.eval_batches.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf

from hsgd.config.schema import ConfigError

EVAL_SEED = 1234  # evaluation batches: stream replica_index=-1 of this seed, never a training stream


class Dataset(Protocol):
    source: str
    vocab_size: int | None

    def batch(self, split: str, *, seed: int, replica_index: int, step: int, micro: int) -> Any: ...


def resolve(path: str, field: str) -> Callable:
    """The callable a dotted `_target_` names, imported here (hsgd.config.validate checks each
    before the run starts). Raises ConfigError, one line: '<field>: <path>: <problem>; valid: ...'."""
    valid = "valid: a dotted path 'package.module.callable' importable on every node"
    module_name, _, name = str(path).rpartition(".")
    if not module_name or not name:
        raise ConfigError(field, f"{path!r} is not a dotted path; {valid}")
    try:
        target = getattr(importlib.import_module(module_name), name, None)
    except Exception as err:  # noqa: BLE001 — ImportError, or the user's module failing on import
        reason = " ".join(str(err).split())[:400]
        raise ConfigError(
            field, f"{path!r}: cannot import {module_name} ({type(err).__name__}: {reason}); {valid}"
        ) from None
    if target is None:
        raise ConfigError(field, f"{path!r}: {module_name} has no callable {name!r} (AttributeError); {valid}")
    if not callable(target):
        raise ConfigError(field, f"{path!r} is a {type(target).__name__}, not a callable; {valid}")
    return target


def _plain(args: Any) -> dict:
    return OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args or {})


def call(target: Callable, args: Any, context: dict, field: str) -> Any:
    """target(**args, **the context names target accepts)."""
    args = _plain(args)
    if clash := sorted(set(args) & set(context)):
        raise ValueError(f"{field}.args: {clash} are supplied by hsgd ({', '.join(sorted(context))}); remove them")
    params = inspect.signature(target).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        context = {k: v for k, v in context.items() if k in names}
    return target(**args, **context)


def build_dataset(cfg: Any) -> Dataset:
    data = cfg.data
    dataset = call(
        resolve(data._target_, "data._target_"),
        data.args,
        {"data_cfg": data, "block_size": cfg.model.block_size, "batch_size": data.batch_size, "seed": cfg.seed},
        "data",
    )
    if not callable(getattr(dataset, "batch", None)):
        raise ValueError(
            f"data._target_={data._target_!r} returned {type(dataset).__name__}, which has no "
            f"batch(split, *, seed, replica_index, step, micro)"
        )
    return dataset


def build_model(cfg: Any, vocab_size: int | None) -> torch.nn.Module:
    """The model. Call torch.manual_seed(seed) first for identical initial params everywhere."""
    model = call(
        resolve(cfg.model._target_, "model._target_"),
        cfg.model.args,
        {"model_cfg": cfg.model, "vocab_size": vocab_size},
        "model",
    )
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model._target_={cfg.model._target_!r} returned {type(model).__name__}, not an nn.Module")
    return model


def build_loss(cfg: Any) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """loss_fn(model, batch) -> scalar tensor, with loss.args bound."""
    return functools.partial(resolve(cfg.loss._target_, "loss._target_"), **_plain(cfg.loss.args))


def to_device(batch: Any, device: str) -> Any:
    """Move a batch (a tensor, or a tuple/list/dict of them) to `device`. On CUDA through pinned
    memory without blocking the host: the copy is ordered on the stream before the step's kernels."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory().to(device, non_blocking=True) if device.startswith("cuda") else batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
