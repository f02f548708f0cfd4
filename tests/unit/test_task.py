"""hsgd.train.task: plug-in model, data and loss named by `_target_`, and the example user task in
examples/ (a module outside hsgd/) that follows the dataset contract."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from hsgd.config.schema import HsgdConfig
from hsgd.train import task

EXAMPLE = [
    "model._target_=examples.regression.build_mlp",
    "data._target_=examples.regression.build_dataset",
    "loss._target_=examples.regression.mse_loss",
    "model.block_size=12",
    "data.batch_size=4",
]


def _cfg(*overrides: str):
    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(list(overrides)))


def named_only(model_cfg, width: int = 3):
    return ("named_only", model_cfg.n_embd, width)


def takes_kwargs(**kwargs):
    return kwargs


@pytest.mark.parametrize(
    "path,message",
    [
        ("nodots", "not a dotted path"),
        ("no_such_module_xyz.build", "cannot import no_such_module_xyz"),
        ("hsgd.train.model.NOT_THERE", "has no callable 'NOT_THERE'"),
    ],
)
def test_a_target_that_cannot_be_resolved_is_one_line_naming_the_field(path, message):
    with pytest.raises(ValueError) as info:  # a ConfigError, hsgd.config.validate's before the run starts
        task.resolve(path, "model._target_")
    assert str(info.value).startswith(f"model._target_: {path!r}") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_factory_gets_only_the_context_names_it_accepts_plus_its_args():
    context = {"model_cfg": OmegaConf.create({"n_embd": 7}), "vocab_size": 65}
    assert task.call(named_only, OmegaConf.create({"width": 5}), context, "model") == ("named_only", 7, 5)
    assert task.call(takes_kwargs, {"a": 1}, context, "model") == {"a": 1, **context}


def test_args_that_name_a_context_value_are_refused():
    with pytest.raises(ValueError, match=r"model.args: \['vocab_size'\] are supplied by hsgd"):
        task.call(takes_kwargs, {"vocab_size": 3}, {"vocab_size": 65}, "model")


def test_the_builtin_plugins_are_the_default_gpt_on_shakespeare():
    cfg = _cfg("model.block_size=16", "data.batch_size=2")
    dataset = task.build_dataset(cfg)
    assert dataset.source == "builtin:shakespeare" and dataset.vocab_size > 60
    torch.manual_seed(0)
    model = task.build_model(cfg, dataset.vocab_size)
    assert type(model).__name__ == "GPT"
    batch = dataset.batch("train", seed=0, replica_index=0, step=0, micro=0)
    loss = task.build_loss(cfg)(model, batch)
    assert loss.dim() == 0 and abs(loss.item() - torch.log(torch.tensor(float(dataset.vocab_size)))) < 0.5


def test_the_example_user_task_trains_an_mlp_on_its_own_data():
    cfg = _cfg(*EXAMPLE, "model.args.hidden=8")
    dataset = task.build_dataset(cfg)
    assert dataset.vocab_size is None and dataset.tokens_per_batch == 4
    torch.manual_seed(0)
    model = task.build_model(cfg, dataset.vocab_size)
    assert type(model).__name__ == "MLP" and model.net[0].out_features == 8
    x, y = dataset.batch("train", seed=0, replica_index=1, step=5, micro=0)
    assert x.shape == (4, 12) and y.shape == (4,) and x.dtype == torch.float32
    loss = task.build_loss(cfg)(model, (x, y))
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_the_example_dataset_is_pure_in_its_arguments():
    dataset = task.build_dataset(_cfg(*EXAMPLE))
    kw = dict(seed=3, replica_index=1, step=7, micro=1)
    a, b = dataset.batch("train", **kw), task.build_dataset(_cfg(*EXAMPLE)).batch("train", **kw)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), "the same arguments gave another batch"
    for other in ({"seed": 4}, {"replica_index": 2}, {"step": 8}, {"micro": 0}):
        c = dataset.batch("train", **{**kw, **other})
        assert not torch.equal(a[0], c[0]), f"{other} gave the same batch"
    assert not torch.equal(dataset.batch("val", **kw)[0], a[0])


def test_batches_reach_the_device_in_their_own_structure():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)])}
    moved = task.to_device(batch, "cpu")
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert torch.equal(moved["x"], batch["x"])
