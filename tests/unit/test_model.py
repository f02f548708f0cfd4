import math
from pathlib import Path

import pytest
import torch
import yaml

from hsgd.train.model import GPT, GPTConfig

VOCAB = 84
CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"


def _gpt(preset="tiny", seed=0):
    """A GPT of the shape conf/model/<preset>.yaml names (the config groups are the presets)."""
    shape = yaml.safe_load((CONF_MODEL / f"{preset}.yaml").read_text())
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, **{k: shape[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}))


@pytest.mark.parametrize("preset,lo,hi", [("tiny", 0.8e6, 1.2e6), ("small", 9e6, 12e6)])
def test_preset_param_counts_in_range(preset, lo, hi):
    assert lo <= sum(p.numel() for p in _gpt(preset).parameters()) <= hi  # the tied embedding / lm_head once


def test_embedding_and_lm_head_are_tied():
    m = _gpt()
    assert m.transformer.wte.weight is m.lm_head.weight


def test_same_seed_gives_identical_init_and_other_seed_differs():
    a, b, c = _gpt(seed=3).state_dict(), _gpt(seed=3).state_dict(), _gpt(seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_forward_shapes_and_loss_at_init_near_ln_vocab():
    m = _gpt()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (2, 2, 64), generator=g)
    logits, loss = m(x, y)
    assert logits.shape == (2, 64, VOCAB)
    assert abs(loss.item() - math.log(VOCAB)) < 0.3
    assert m(x)[1] is None


def test_adamw_steps_on_one_batch_drive_loss_down():
    m = _gpt()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4, 33), generator=g)
    x, y = x[:, :-1], x[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        _, loss = m(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m(x, y)[1].item() < first - 1.0
