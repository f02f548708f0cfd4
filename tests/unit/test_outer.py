"""hsgd.train.outer: the outer optimizer (average / DiLoCo Nesterov), pseudo-gradients, commit rule."""

import io

import pytest
import torch

from hsgd.train.outer import OuterOptimizer, outer_hyperparameters

SHAPES = [(4, 3), (5,), (2, 2, 2)]


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _mean(lists):
    return [torch.stack(ts).mean(0) for ts in zip(*lists, strict=True)]


def test_average_hyperparameters_ignore_outer_optim_settings():
    assert outer_hyperparameters("average", 0.7, 0.9, True) == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert outer_hyperparameters("diloco", 0.7, 0.9, True) == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert outer_hyperparameters("diloco", 0.5, 0.0, True)["nesterov"] is False, (
        "torch SGD refuses nesterov without momentum"
    )


def test_average_makes_global_params_the_exact_mean_of_the_clusters():
    start = _params(0)
    clusters = [_params(s) for s in (1, 2, 3)]
    opts = [OuterOptimizer(start, **outer_hyperparameters("average", 0.7, 0.9, True)) for _ in clusters]
    mean_pg = _mean([opt.pseudo_gradient(p) for opt, p in zip(opts, clusters, strict=True)])
    for opt in opts:
        opt.step(mean_pg)
    want = _mean(clusters)
    for opt in opts:
        for got, w in zip(opt.global_params, want, strict=True):
            assert torch.allclose(got, w, atol=1e-6), "`average` must yield the mean of the clusters' params"
    assert all(torch.equal(a, b) for a, b in zip(opts[0].global_params, opts[1].global_params, strict=True)), (
        "every replica applying the same reduced pseudo-gradient must hold bitwise-equal global params"
    )


def test_diloco_matches_hand_written_nesterov_over_three_outer_steps():
    lr, mom = 0.7, 0.9
    start = _params(0)
    opt = OuterOptimizer(start, **outer_hyperparameters("diloco", lr, mom, True))
    theta = [p.clone().double() for p in start]
    buf = None
    for step in range(3):
        local = [
            t.float() - 0.1 * (step + 1) * torch.randn(t.shape, generator=torch.Generator().manual_seed(step))
            for t in theta
        ]
        pg = opt.pseudo_gradient(local)
        opt.step(pg)
        d = [t - lp.double() for t, lp in zip(theta, local, strict=True)]  # global - local
        buf = d if buf is None else [mom * b + g for b, g in zip(buf, d, strict=True)]
        theta = [t - lr * (g + mom * b) for t, g, b in zip(theta, d, buf, strict=True)]
        for got, want in zip(opt.global_params, theta, strict=True):
            assert torch.allclose(got.double(), want, atol=1e-6), f"outer step {step} differs from Nesterov SGD"


def test_pseudo_gradient_is_global_minus_local_without_autograd_history():
    start = [torch.nn.Parameter(p) for p in _params(0)]
    opt = OuterOptimizer(start, lr=0.7, momentum=0.9, nesterov=True)
    local = [torch.nn.Parameter(p) for p in _params(1)]
    with_history = [p * 2 for p in local]  # tensors with a grad_fn
    for src in (local, with_history):
        pg = opt.pseudo_gradient(src)
        for g, p, d in zip(opt.global_params, src, pg, strict=True):
            assert d.requires_grad is False and d.grad_fn is None, "pseudo-gradients must carry no autograd history"
            assert torch.equal(d, g.detach() - p.detach())
            assert d.device.type == "cpu"


def test_global_params_are_a_copy_not_the_model_params():
    params = _params(0)
    opt = OuterOptimizer(params, lr=1.0, momentum=0.0, nesterov=False)
    params[0].add_(1.0)
    assert not torch.equal(opt.global_params[0], params[0]), "round-start params must not alias live params"


def test_copy_global_into_and_reset_global():
    opt = OuterOptimizer(_params(0), lr=1.0, momentum=0.0, nesterov=False)
    target = _params(5)
    opt.copy_global_into(target)
    assert all(torch.equal(a, b) for a, b in zip(target, opt.global_params, strict=True))
    other = _params(6)
    opt.reset_global(other)
    assert all(torch.equal(a, b) for a, b in zip(other, opt.global_params, strict=True))


def _stepped(seed=0, steps=2):
    opt = OuterOptimizer(_params(seed), lr=0.7, momentum=0.9, nesterov=True)
    for i in range(steps):
        opt.step(_params(100 + i))
    return opt


def _serialized(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("transfer", [_serialized, lambda state: state], ids=["serialized", "in-process"])
def test_state_dict_round_trip_gives_identical_next_steps(transfer):
    a = _stepped()
    b = OuterOptimizer(_params(9), lr=0.7, momentum=0.9, nesterov=True)
    b.load_state_dict(transfer(a.state_dict()))
    for i in range(3):
        d = _params(200 + i)
        a.step(d)
        b.step(d)
        assert all(torch.equal(x, y) for x, y in zip(a.global_params, b.global_params, strict=True)), (
            f"after loading the state, outer step {i} must be bitwise identical (invariant 1)"
        )
