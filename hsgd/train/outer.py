"""Outer sync: what crosses the slow link once per round.

DiLoCo (arXiv 2311.08105, Algorithm 1), per round:
    pseudo_grad = global_params_at_round_start - local_params        (per cluster, by its leader)
    pseudo_grad = mean over clusters (outer all-reduce among leaders)
    global_params = OuterOpt(global_params, pseudo_grad)               (Nesterov SGD, lr 0.7, mom 0.9)
    local_params = global_params                                       (inner optimizer state kept)

`average` (hierarchical local SGD) is the same with plain SGD, lr 1 and no momentum: the new global
params are the mean of the clusters' params. `none` never crosses clusters.

Every replica keeps the global params and the outer optimizer state — not only the leader — so
any replica can become leader, and a commit is applied by every replica from the same reduced
pseudo-gradient (bitwise-identical results on every replica, without shipping parameters).
"""

from __future__ import annotations

from copy import deepcopy

import torch


def outer_hyperparameters(algorithm: str, lr: float, momentum: float, nesterov: bool) -> dict:
    """`average` ignores optim.outer: it is exactly parameter averaging."""
    if algorithm == "average":
        return {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    return {"lr": lr, "momentum": momentum, "nesterov": nesterov and momentum > 0}


class OuterOptimizer:
    """Owns the round-start global params (on CPU) and the outer SGD state that updates them."""

    def __init__(
        self, params: list[torch.Tensor], *, lr: float, momentum: float, nesterov: bool, pin_memory: bool = False
    ):
        self.global_params = [p.detach().to("cpu", copy=True) for p in params]
        if pin_memory:  # GPU runs: faster host<->device copies at every round boundary
            self.global_params = [g.pin_memory() for g in self.global_params]
        for g in self.global_params:
            g.requires_grad_(True)
        self._sgd = torch.optim.SGD(self.global_params, lr=lr, momentum=momentum, nesterov=nesterov)

    def pseudo_gradient(self, params: list[torch.Tensor], index: list[int] | None = None) -> list[torch.Tensor]:
        """global - local, on CPU; detached copies (never tensors with autograd history).
        `index`: which global params `params` are (a fragment); None = all of them, in order."""
        chosen = self.global_params if index is None else [self.global_params[i] for i in index]
        return [g.detach() - p.detach().to("cpu") for g, p in zip(chosen, params, strict=True)]

    @torch.no_grad()
    def step(self, mean_pseudo_gradient: list[torch.Tensor], index: list[int] | None = None) -> None:
        """Apply the averaged pseudo-gradient to the global params (`index`: only those, a
        fragment; the others get no gradient, so SGD leaves them and their momentum untouched)."""
        chosen = self.global_params if index is None else [self.global_params[i] for i in index]
        for g, d in zip(chosen, mean_pseudo_gradient, strict=True):
            g.grad = d.to(g.dtype).clone()
        self._sgd.step()
        for g in self.global_params:
            g.grad = None

    @torch.no_grad()
    def reset_global(self, params: list[torch.Tensor]) -> None:
        """Used by `outer=none`: each cluster's own params become its round-start params."""
        for g, p in zip(self.global_params, params, strict=True):
            g.copy_(p.detach().to("cpu"))

    @torch.no_grad()
    def copy_global_into(self, params: list[torch.Tensor]) -> None:
        for p, g in zip(params, self.global_params, strict=True):
            p.copy_(g.to(p.device))

    def state_dict(self) -> dict:
        """This optimizer's own tensors: read them at once, never keep or modify them (deepcopy to keep)."""
        return {"global_params": [g.detach() for g in self.global_params], "sgd": self._sgd.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for g, src in zip(self.global_params, state["global_params"], strict=True):
            g.copy_(src)
        self._sgd.load_state_dict(deepcopy(state["sgd"]))
