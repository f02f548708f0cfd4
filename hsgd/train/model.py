"""A character-level GPT in the style of nanoGPT's model.py.

Contract:
- `GPT(GPTConfig(...))` is initialised entirely from torch's default generator: a caller
  that sets `torch.manual_seed(s)` right before construction gets bit-identical weights.
- `forward(idx, targets=None)` takes idx (B, T) int64 with T <= block_size and returns
  logits (B, T, vocab_size) and, when targets (B, T) are given, the mean cross-entropy.
- dropout defaults to 0.0, so a training step is a deterministic function of weights and batch.
- Linears and LayerNorms have no bias (a little better and faster).
- Model sizes are config groups, conf/model/{tiny,small,gpt-30m,gpt-86m}.yaml.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        # q, k, v: 3 x (B, T, C) -> 3 x (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):  # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MLP(config)

    def forward(self, x):  # (B, T, C), pre-norm residual
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=False),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        # nanoGPT init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layer)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        assert self.config.block_size >= T, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss


def build_gpt(model_cfg, vocab_size: int | None) -> GPT:
    """The built-in model plug-in: a GPT of cfg.model's shape over the dataset's vocabulary."""
    if not vocab_size:
        raise ValueError(
            "model._target_=hsgd.train.model.build_gpt needs a token vocabulary, but the dataset "
            "has none (vocab_size=None); set data.vocab_size or use a token dataset"
        )
    return GPT(
        GPTConfig(
            vocab_size=int(vocab_size),
            block_size=model_cfg.block_size,
            n_layer=model_cfg.n_layer,
            n_head=model_cfg.n_head,
            n_embd=model_cfg.n_embd,
            dropout=model_cfg.dropout,
        )
    )


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """The built-in loss plug-in: next-token cross-entropy of a batch (x, y), each (B, T) int64."""
    x, y = batch
    _, loss = model(x, y)
    return loss
