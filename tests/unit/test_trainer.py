"""hsgd.train.trainer: the promises one replica keeps when phases are retried or it is healed."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from hsgd.train import task
from hsgd.train.comm import CollectiveError
from hsgd.train.trainer import Behind, param_digest
from tests.fakes.trainer import _cfg, _solo, _trainer, dataset  # noqa: F401 — (dataset: the module's fixture)


class PeerMeanGroup:
    """An inner group whose other member holds `peer` params: allreduce_mean averages with them.
    `fail_after_apply` models a member that got the result while its peer's call failed."""

    level, rank, world_size, bytes_sent = "inner", 0, 2, 0

    def __init__(self, peer: list[torch.Tensor], fail_after_apply: bool = False):
        self.peer, self.fail_after_apply = peer, fail_after_apply

    def allreduce_mean(self, tensors, *, level):
        for t, p in zip(tensors, self.peer, strict=True):
            t.copy_((t + p) / 2)
        if self.fail_after_apply:
            raise CollectiveError("inner: peer died after the reduction")


class OuterOf:
    level, rank, world_size, bytes_sent = "outer", 0, 2, 0

    def __init__(self):
        self.calls = 0

    def allreduce_mean(self, tensors, *, level):
        self.calls += 1


def test_phase_call_for_a_round_not_reached_answers_behind_never_done(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset)
    with pytest.raises(Behind):
        t.run_inner(1, OuterOf())
    with pytest.raises(Behind):
        t.outer_reduce(2, 0, OuterOf())
    assert (t.round, t.step) == (0, 0)


def test_retried_cluster_average_never_averages_an_averaged_replica_again(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, inner="none")
    mine = [p.detach().clone() for p in t.params]
    peer = [torch.full_like(p, 1.0) for p in t.params]
    with pytest.raises(CollectiveError):  # averaged here, but the peer failed: the call is retried
        t.cluster_average(0, 5, PeerMeanGroup(peer, fail_after_apply=True))
    t.cluster_average(0, 6, PeerMeanGroup(peer))  # retry under a new epoch
    for p, m, q in zip(t.params, mine, peer, strict=True):
        assert torch.equal(p.detach(), (m + q) / 2), "the retry averaged the already-averaged params"
    before = [p.detach().clone() for p in t.params]
    t.cluster_average(0, 6, PeerMeanGroup(peer))  # re-issued for the same (round, epoch): a no-op
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, t.params, strict=True))


def test_outer_buffer_is_keyed_by_round_and_epoch(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset)
    outer = OuterOf()
    t.outer_reduce(0, 3, outer)
    t.outer_reduce(0, 3, outer)  # the same (round, epoch): idempotent
    assert outer.calls == 1
    t.outer_reduce(0, 4, outer)  # a new epoch never reuses the old buffer
    assert outer.calls == 2 and t._outer_buffer[0][:2] == (0, 4)


def test_global_heal_gives_every_cluster_member_the_same_inner_optimizer_state(dataset):  # noqa: F811 — the module's dataset fixture
    donor = _trainer(dataset, "c1r0")
    a, b = _trainer(dataset, "c0r0"), _trainer(dataset, "c0r1")
    group = _solo("inner")
    a.run_inner(0, group)  # a has AdamW moments, b is fresh (as if restarted)
    state = donor.global_state()
    a.load_state_dict(state, scope="global")
    b.load_state_dict(state, scope="global")
    sa, sb = a.inner_opt.state_dict(), b.inner_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, value in sa["state"][k].items():
            assert torch.equal(value, sb["state"][k][name]), f"inner optimizer state {k}.{name} differs"
    assert (a.round, a.step) == (b.round, b.step) == (0, 0)
    assert a.param_digest() == b.param_digest() == donor.global_digest()


def test_global_state_is_a_snapshot(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0")
    t.outer_opt.step([torch.ones_like(g) for g in t.outer_opt.global_params])
    state = t.global_state()
    saved = [g.clone() for g in state["outer"]["global_params"]]
    saved_momentum = [v["momentum_buffer"].clone() for v in state["outer"]["sgd"]["state"].values()]
    t.outer_opt.step([torch.ones_like(g) for g in t.outer_opt.global_params])
    now_momentum = [v["momentum_buffer"] for v in state["outer"]["sgd"]["state"].values()]
    assert saved_momentum and all(torch.equal(x, y) for x, y in zip(saved_momentum, now_momentum, strict=True)), (
        "a saved state must not change after later steps"
    )
    assert all(torch.equal(x, y) for x, y in zip(saved, state["outer"]["global_params"], strict=True))


# -- issue 19 Build 6: a failed localsgd average never leaves a step applied twice ------------------
class FlakyPeerGroup:
    """A localsgd inner group of two whose other member holds params of 0.5 everywhere; the
    `fail_at`-th call raises CollectiveError, before or after it changed the tensors."""

    level, rank, world_size, bytes_sent = "inner", 0, 2, 0

    def __init__(self, fail_at: int | None = None, after_apply: bool = False):
        self.calls, self.fail_at, self.after_apply = 0, fail_at, after_apply

    def allreduce_mean(self, tensors, *, level):
        self.calls += 1
        failing = self.calls == self.fail_at
        if failing and not self.after_apply:
            raise CollectiveError("inner: peer died")
        for t in tensors:
            t.mul_(0.5).add_(0.25)  # (t + 0.5) / 2
        if failing:
            raise CollectiveError("inner: peer died after the reduction")


def _opt_state(t):
    return {k: {n: v.clone() for n, v in s.items()} for k, s in t.inner_opt.state_dict()["state"].items()}


@pytest.mark.parametrize("after_apply", [False, True], ids=["fails_before_reducing", "fails_after_reducing"])
def test_a_failed_localsgd_average_is_retried_exactly(dataset, after_apply):  # noqa: F811 — the module's dataset fixture
    clean = _trainer(dataset, "c0r0", inner="localsgd", inner_every=1)
    clean.run_inner(0, FlakyPeerGroup())
    faulty = _trainer(dataset, "c0r0", inner="localsgd", inner_every=1)
    with pytest.raises(CollectiveError):
        faulty.run_inner(0, FlakyPeerGroup(fail_at=2, after_apply=after_apply))
    assert faulty.step == 1, "the step whose average failed is not counted"
    faulty.run_inner(0, FlakyPeerGroup())  # the retry after re-planning
    assert faulty.step == clean.step == 3
    assert faulty.param_digest() == clean.param_digest(), "the retried step was applied twice"
    a, b = _opt_state(faulty), _opt_state(clean)
    assert all(torch.equal(a[k][n], b[k][n]) for k in b for n in b[k]), "inner optimizer state differs after the retry"
    assert faulty.round_losses == clean.round_losses


# -- the inner learning-rate schedule ---------------------------------------------------------------
def test_inner_lr_warms_up_then_decays_by_cosine_to_the_floor_at_the_runs_end():
    from hsgd.train.inner import inner_lr

    o = OmegaConf.create({"lr": 1.0, "warmup_steps": 4, "schedule": "cosine", "min_lr_ratio": 0.1})
    assert [inner_lr(o, s, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert inner_lr(o, 4, 20) == pytest.approx(1.0) and inner_lr(o, 19, 20) == pytest.approx(0.1)
    values = [inner_lr(o, s, 20) for s in range(4, 20)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), "cosine decay is monotone"
    assert inner_lr(o, 11, 20) == pytest.approx(0.55, abs=0.05)  # about halfway
    constant = OmegaConf.create({"lr": 0.3, "warmup_steps": 0, "schedule": "constant", "min_lr_ratio": 0.1})
    assert {inner_lr(constant, s, 20) for s in range(20)} == {0.3}


def test_a_replica_healed_mid_round_lands_on_the_same_learning_rate(dataset):  # noqa: F811 — the module's dataset fixture
    """The rate is a function of the global step: a replica that took a peer's state at step 1
    steps on exactly as the peer does (a rate kept in a scheduler object would restart at step 0)."""
    from hsgd.train.trainer import YieldNow

    sched = ["optim.inner.warmup_steps=1", "optim.inner.schedule=cosine", "train.rounds=2"]
    source, target = _trainer(dataset, "c0r0", *sched), _trainer(dataset, "c0r1", *sched)

    def stop_at_1(phase, r, s):
        if phase == "inner" and s == 1:
            raise YieldNow()

    assert source.run_inner(0, _solo("inner"), stop_at_1).yielded
    target.load_state_dict(source.state_dict(), scope="full")
    target.assume_identity("c0r0")  # the same data stream: only the rate could still differ
    source.run_inner(0, _solo("inner"))
    target.run_inner(0, _solo("inner"))
    assert target.param_digest() == source.param_digest()
    assert target.inner_opt.param_groups[0]["lr"] == pytest.approx(source.inner_opt.param_groups[0]["lr"])
    from hsgd.train.inner import inner_lr

    assert source.inner_opt.param_groups[0]["lr"] == inner_lr(source.cfg.optim.inner, 2, 6) < source.cfg.optim.inner.lr


# -- optimizer implementations ----------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_each_optimizer_implementation_keeps_healed_replicas_bitwise_equal(dataset, impl):  # noqa: F811 — the module's dataset fixture
    from hsgd.train.trainer import YieldNow

    def stop_at_2(phase, r, s):
        if phase == "inner" and s == 2:
            raise YieldNow()

    a = _trainer(dataset, "c0r0", f"optim.inner.implementation={impl}")
    b = _trainer(dataset, "c0r0", f"optim.inner.implementation={impl}")
    a.run_inner(0, _solo("inner"), stop_at_2)
    b.load_state_dict(a.state_dict(), scope="full")  # a heal mid-round carries the optimizer state
    a.run_inner(0, _solo("inner"))
    b.run_inner(0, _solo("inner"))
    assert a.param_digest() == b.param_digest(), f"{impl}: a healed replica diverged from its source"
    again = _trainer(dataset, "c0r0", f"optim.inner.implementation={impl}")
    again.run_inner(0, _solo("inner"))
    assert again.param_digest() == a.param_digest(), f"{impl}: the same steps gave other bits"
    single = _trainer(dataset, "c0r0", "optim.inner.implementation=single")
    single.run_inner(0, _solo("inner"))
    for p, q in zip(a.params, single.params, strict=True):  # the same math, up to rounding
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# -- non-finite numbers ------------------------------------------------------------------------------
def _count_host_reads(monkeypatch):
    """Count tensor -> host reads made by hsgd's own code (the optimizer's internals are torch's)."""
    import sys

    reads = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name):
            caller = sys._getframe(1).f_code.co_filename
            if "/hsgd/" in caller:
                reads.append((_name, caller))
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return reads


def test_losses_and_the_non_finite_flags_are_read_once_per_phase_not_per_step(dataset, monkeypatch):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", "sync.outer_every=8", "optim.inner.implementation=fused")
    t.steps_per_round = 8
    reads = _count_host_reads(monkeypatch)
    report = t.run_inner(0, _solo("inner"))
    monkeypatch.undo()
    assert report.steps_done == 8 and len(report.losses) == 8 and all(x > 0 for x in report.losses)
    assert len(reads) <= 2, f"{len(reads)} host reads in one inner phase of 8 steps: {reads}"


def test_a_poisoned_replica_raises_non_finite_loss_at_the_phase_end(dataset):  # noqa: F811 — the module's dataset fixture
    from hsgd.train.trainer import NonFiniteError

    t = _trainer(dataset)
    t.poison()
    with pytest.raises(NonFiniteError) as info:
        t.run_inner(0, _solo("inner"))
    assert info.value.what == "loss"
    assert t.step == 3, "the flag is read at the phase's end, not at the step"
    assert len(t.round_losses) == 3 and torch.isnan(torch.tensor(t.round_losses[0]))
    outer = OuterOf()
    with pytest.raises(NonFiniteError) as info:  # the poisoned params: nothing is sent
        t.outer_reduce(0, 1, outer)
    assert info.value.what == "pseudo_gradient" and outer.calls == 0
    donor = _trainer(dataset, "c1r0")
    t.load_state_dict(donor.global_state(), scope="global")  # healed from the committed global params
    t.run_inner(0, _solo("inner"))  # the flag is clear again
    t.outer_reduce(0, 2, outer)
    assert outer.calls == 1


def sqrt_at_zero_loss(model, batch):
    """A finite loss whose gradient is not: d/dx sqrt(x) at 0 is infinite."""
    x, y = batch
    _, loss = model(x, y)
    p = next(model.parameters())
    return loss + torch.sqrt(p.flatten()[0] * 0.0)


def test_a_non_finite_gradient_norm_with_a_finite_loss_is_caught(dataset):  # noqa: F811 — the module's dataset fixture
    from hsgd.train.trainer import NonFiniteError

    t = _trainer(dataset, "c0r0", "loss._target_=tests.unit.test_trainer.sqrt_at_zero_loss")
    t.steps_per_round = 1  # one step: the next one's loss would be NaN (the params are)
    with pytest.raises(NonFiniteError) as info:
        t.run_inner(0, _solo("inner"))
    assert info.value.what == "grad_norm"
    assert all(torch.isfinite(torch.tensor(t.round_losses)))


def test_non_finite_error_keeps_what_across_pickling():
    import pickle

    from hsgd.train.trainer import NonFiniteError

    err = pickle.loads(pickle.dumps(NonFiniteError("grad_norm", "c0r1: non-finite")))
    assert err.what == "grad_norm" and str(err) == "c0r1: non-finite"


# -- precision, accumulation, compile ----------------------------------------------------------------
def test_bf16_trains_with_fp32_master_weights_and_pseudo_gradients(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", "train.precision=bf16", "sync.outer_every=12", "optim.inner.lr=0.01")
    t.steps_per_round = 12
    report = t.run_inner(0, _solo("inner"))
    assert sum(report.losses[-3:]) < sum(report.losses[:3]), f"bf16 loss did not decrease: {report.losses}"
    assert all(p.dtype == torch.float32 for p in t.params)
    assert all(g.dtype == torch.float32 for g in t.outer_opt.pseudo_gradient(t.params))
    fp32 = _trainer(dataset, "c0r0", "sync.outer_every=12", "optim.inner.lr=0.01")
    fp32.steps_per_round = 12
    fp32.run_inner(0, _solo("inner"))
    assert fp32.param_digest() != t.param_digest(), "bf16 autocast was not applied"


def test_grad_accum_steps_on_the_mean_gradient_of_its_micro_batches(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", "data.grad_accum=2")
    t.steps_per_round = 1
    report = t.run_inner(0, _solo("inner"))
    # the same step written out by hand
    torch.manual_seed(t.cfg.seed)
    model = task.build_model(t.cfg, dataset.vocab_size)
    params = list(model.parameters())
    from hsgd.train.inner import build_inner_optimizer

    opt = build_inner_optimizer(t.cfg, params)
    opt.zero_grad(set_to_none=False)
    losses = []
    for micro in range(2):
        loss = task.build_loss(t.cfg)(model, dataset.batch("train", seed=0, replica_index=0, step=0, micro=micro)) / 2
        loss.backward()
        losses.append(loss.detach())
    torch.nn.utils.clip_grad_norm_(params, t.cfg.optim.inner.grad_clip, foreach=False)
    opt.step()
    assert report.losses == [float(losses[0] + losses[1])]
    assert t.param_digest() == param_digest(params)
    assert report.tokens == 2 * t.cfg.data.batch_size * t.cfg.model.block_size


def test_a_compiled_model_trains_the_modules_own_params_and_heals_to_an_uncompiled_one(dataset, monkeypatch):  # noqa: F811 — the module's dataset fixture
    import functools

    from hsgd.train import trainer as trainer_module

    # the eager backend: dynamo captures the graphs, no C++ toolchain, the same bits as uncompiled
    monkeypatch.setattr(trainer_module.torch, "compile", functools.partial(torch.compile, backend="eager"))
    compiled = _trainer(dataset, "c0r0", "train.compile=true")
    assert compiled.step_model is not compiled.model
    assert [id(p) for p in compiled.step_model.parameters()] == [id(p) for p in compiled.params]
    plain = _trainer(dataset, "c0r0")
    compiled.run_inner(0, _solo("inner"))
    plain.run_inner(0, _solo("inner"))
    assert compiled.param_digest() == plain.param_digest()
    healed = _trainer(dataset, "c0r1")
    healed.load_state_dict(compiled.state_dict(), scope="full")
    assert healed.param_digest() == compiled.param_digest()
    torch._dynamo.reset()


# -- state and the final model -----------------------------------------------------------------------
def test_state_dict_is_a_snapshot_that_training_on_does_not_change(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", "sync.outer_every=6")
    t.steps_per_round = 6
    from hsgd.train.trainer import YieldNow

    def stop_at_2(phase, r, s):
        if phase == "inner" and s == 2:
            raise YieldNow()

    t.run_inner(0, _solo("inner"), stop_at_2)
    state = t.state_dict()
    before = (
        param_digest(state["params"]),
        param_digest([v for s in state["inner_opt"]["state"].values() for v in s.values()]),
    )
    t.run_inner(0, _solo("inner"))
    after = (
        param_digest(state["params"]),
        param_digest([v for s in state["inner_opt"]["state"].values() for v in s.values()]),
    )
    assert before == after, "the state handed to a heal changed while the source trained on"


def test_the_final_model_is_the_committed_global_model_in_safetensors(dataset, tmp_path):  # noqa: F811 — the module's dataset fixture
    from safetensors import safe_open
    from safetensors.torch import load_file

    t = _trainer(dataset)
    t.run_inner(0, _solo("inner"))
    t.outer_reduce(0, 1, _solo("outer"))
    t.outer_commit(0, _solo("inner"), roots=(0,))
    t.run_inner(1, _solo("inner"))  # params move on; the file holds the committed round's model
    saved = t.save_model(str(tmp_path / "model.safetensors"))
    assert saved["round"] == 1 and saved["bytes"] > t.param_bytes
    model = task.build_model(t.cfg, dataset.vocab_size)
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to transformer.wte.weight
    assert param_digest(list(model.parameters())) == t.global_digest() != t.param_digest()
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["round"] == "1" and meta["global_digest"] == t.global_digest()
    assert meta["model_target"] == "hsgd.train.model.build_gpt"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"], "no temporary file left behind"
