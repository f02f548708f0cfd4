"""hsgd.train.buckets: overlapped, bucketed gradient all-reduce for inner `ddp`.

No processes: bucket assignment; buckets launched from backward hooks, in bucket order, before
backward returns; failures (issue, wait, a wait returning False) come out of `finish` as
CollectiveError and release the one-collective guard; a group of one does nothing.
Two real gloo processes (ONE spawned session): parity with the non-overlapped `allreduce_mean`
path over 30 AdamW steps of a small GPT, then a peer killed mid-backward -> the survivor's
`finish` raises CollectiveError within the timeout, and its group stays unusable until re-formed.
"""

import os
import time
import traceback

import pytest
import torch

from hsgd.train import comm
from hsgd.train.buckets import GradBuckets, assign_buckets
from hsgd.train.comm import CollectiveError, LevelGroup, WrongLevelError
from tests.fakes.deadlines import HANG_S
from tests.fakes.gloo_world import run_ranks
from tests.fakes.process_group import FakePG, FakeWork

TIMEOUT_S = 5.0


# -- bucket assignment ----------------------------------------------------------------------------
def _p(n, dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(n, dtype=dtype))


def test_buckets_hold_parameters_in_reverse_order_up_to_the_size():
    params = [_p(10), _p(10), _p(10), _p(10), _p(10)]  # 40 bytes each
    assert assign_buckets(params, bucket_bytes=80) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(params, bucket_bytes=10**6) == [[4, 3, 2, 1, 0]]


def test_a_parameter_larger_than_a_bucket_is_a_bucket_of_its_own():
    params = [_p(1), _p(100), _p(1), _p(1)]
    assert assign_buckets(params, bucket_bytes=16) == [[3, 2], [1], [0]]


def test_a_bucket_holds_one_dtype():
    params = [_p(2), _p(2, torch.float64), _p(2)]
    assert assign_buckets(params, bucket_bytes=10**6) == [[2], [1], [0]]


def test_every_parameter_is_in_exactly_one_bucket():
    params = [_p(n) for n in (3, 700, 5, 5, 64, 1, 250)]
    buckets = assign_buckets(params, bucket_bytes=1024)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(params))) and flat == sorted(flat, reverse=True)
    assert all(sum(params[i].numel() * 4 for i in b) <= 1024 or len(b) == 1 for b in buckets)


# -- fake groups: an all-reduce sums as if a second member held the same gradient (the mean is the local grad)
def _group(pg, level="inner", world_size=2):
    g = LevelGroup(level, timeout_s=1.0)
    g._pg, g.world_size, g._usable, g.prefix = pg, world_size, True, "run/epoch1/inner/c0"
    return g


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def _backward(model, log=None):
    loss = model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).square().mean()
    loss.backward()
    if log is not None:
        log.append(("backward_returned",))


def test_buckets_are_launched_from_hooks_during_backward_in_bucket_order():
    model = _model()
    params = list(model.parameters())
    log = []
    buckets = GradBuckets(params, bucket_mb=300 / 2**20)  # ~300 bytes: several buckets
    expected = [sum(params[i].numel() for i in b) for b in assign_buckets(params, buckets.bucket_bytes)]
    assert len(expected) >= 3
    group = _group(FakePG(members=2, calls=log))
    buckets.arm(group)
    _backward(model, log)
    launched_in_backward = [e for e in log[: log.index(("backward_returned",))] if e[0] == "allreduce"]
    assert len(launched_in_backward) == len(expected), "every bucket fills during backward and is launched there"
    ref = [p.grad.clone() for p in params]
    buckets.finish()
    assert [e[1] for e in log if e[0] == "allreduce"] == expected, "buckets launch in bucket order"
    for p, r in zip(params, ref, strict=True):
        assert torch.equal(p.grad, r), "the mean (sum of two equal grads / 2) is written back into p.grad"
    with comm.one_collective("after"):  # the guard was released by finish
        pass


def test_the_guard_is_held_from_the_first_launch_to_finish():
    model = _model()
    buckets = GradBuckets(list(model.parameters()), bucket_mb=300 / 2**20)
    group = _group(FakePG(members=2))
    buckets.arm(group)
    _backward(model)
    with pytest.raises(comm.OverlappingCollectiveError):
        group.allreduce_mean([torch.ones(1)], level="inner")
    buckets.finish()
    group.allreduce_mean([torch.ones(1)], level="inner")


@pytest.mark.parametrize(
    "pg,kind",
    [
        (FakePG(members=2, work=FakeWork(result=False)), "timeout"),
        (FakePG(members=2, work=FakeWork(wait=RuntimeError("Connection closed by peer"))), "peer_gone"),
        (FakePG(members=2, issue=torch.distributed.DistBackendError("lazy NCCL init")), "issue"),
        (FakePG(members=2, errored=RuntimeError("aborted")), "aborted"),
    ],
    ids=["wait_returns_false", "wait_raises", "issue_raises", "group_errored_after_wait"],
)
def test_a_failed_bucket_comes_out_of_finish_as_collective_error(pg, kind):
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_mb=300 / 2**20)
    group = _group(pg)
    buckets.arm(group)
    _backward(model)  # hooks never raise, whatever the group does
    before = [p.grad.clone() for p in params]
    with pytest.raises(CollectiveError) as info:
        buckets.finish()
    assert info.value.kind == kind
    assert buckets._group is None  # disarmed
    with pytest.raises(CollectiveError):
        group.allreduce_mean([torch.ones(1)], level="inner")  # unusable (not OverlappingCollectiveError)
    if kind != "issue":
        assert pg.aborted == 1, "in-flight buckets are dropped by aborting the group"
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True)), "no partial mean is written"


def test_disarm_drops_in_flight_work_and_never_raises():
    model = _model()
    pg = FakePG(members=2)
    buckets = GradBuckets(list(model.parameters()), bucket_mb=300 / 2**20)
    group = _group(pg)
    buckets.arm(group)
    _backward(model)
    pg.abort = lambda errored=True: (_ for _ in ()).throw(RuntimeError("abort fails too"))
    buckets.disarm()
    buckets.disarm()
    buckets.finish()  # not armed: nothing to do
    with comm.one_collective("after"):
        pass


def test_a_group_of_one_does_nothing():
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_mb=300 / 2**20)
    group = LevelGroup("inner")
    group.configure(None, "solo", rank=0, world_size=1, epoch=0)
    buckets.arm(group)
    _backward(model)
    ref = [p.grad.clone() for p in params]
    buckets.finish()
    assert all(torch.equal(p.grad, r) for p, r in zip(params, ref, strict=True)) and group.bytes_sent == 0


def test_arming_on_the_outer_group_is_refused():
    buckets = GradBuckets(list(_model().parameters()), bucket_mb=1)
    with pytest.raises(WrongLevelError):
        buckets.arm(_group(FakePG(members=2), level="outer"))
    with pytest.raises(WrongLevelError):
        buckets.arm(_group(FakePG(members=2), level="outer", world_size=1))


def test_unarmed_hooks_do_nothing():
    model = _model()
    pg = FakePG(members=2)
    GradBuckets(list(model.parameters()), bucket_mb=1)
    _backward(model)
    assert pg.calls == []


# -- two real gloo processes ----------------------------------------------------------------------
STEPS = 30


def _gpt():
    from hsgd.train.model import GPT, GPTConfig

    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 32, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _worker(rank, port, results):
    out = {"rank": rank}
    try:
        torch.set_num_threads(1)
        group = LevelGroup("inner", "gloo", timeout_s=TIMEOUT_S, configure_timeout_s=10.0)
        group.configure(f"127.0.0.1:{port}/{'0' * 32}", "test/epoch1/inner/c0", rank=rank, world_size=2, epoch=1)
        plain, overlapped = _gpt(), _gpt()
        opt_a = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
        opt_b = torch.optim.AdamW(overlapped.parameters(), lr=1e-2, foreach=False)
        buckets = GradBuckets(list(overlapped.parameters()), bucket_mb=0.02)  # ~20 KB: several buckets
        out["n_buckets"] = len(buckets.buckets)
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt_a.zero_grad(set_to_none=False)
            plain(x, y)[1].backward()
            group.allreduce_mean([p.grad for p in plain.parameters()], level="inner")
            opt_a.step()
            opt_b.zero_grad(set_to_none=False)
            buckets.arm(group)
            overlapped(x, y)[1].backward()
            buckets.finish()
            opt_b.step()
        out["max_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(plain.parameters(), overlapped.parameters(), strict=True)
        )
        out["params"] = [
            p.detach().reshape(-1).tolist() for p in overlapped.parameters()
        ]  # no tensors in a queue: shared memory dies with the sender
        out["moved"] = max(
            (a - b).abs().max().item() for a, b in zip(_gpt().parameters(), overlapped.parameters(), strict=True)
        )
        # a peer killed mid-backward: rank 1 dies from a hook halfway through its backward, after
        # it launched some buckets; rank 0 must get CollectiveError from finish, within the timeout
        params = list(overlapped.parameters())
        if rank == 1:
            half = buckets.buckets[len(buckets.buckets) // 2].members[0]

            def die(p):
                results.put(out)
                results.close()
                results.join_thread()
                os._exit(0)

            params[half].register_post_accumulate_grad_hook(die)
        x, y = _batch(rank, STEPS)
        opt_b.zero_grad(set_to_none=False)
        buckets.arm(group)
        start = time.monotonic()
        overlapped(x, y)[1].backward()
        try:
            buckets.finish()
            out["after_death"] = "no error"
        except CollectiveError as err:
            out["after_death"] = f"CollectiveError:{err.kind}"
        out["detect_s"] = time.monotonic() - start
        try:
            group.allreduce_mean([torch.ones(2)], level="inner")
            out["reuse"] = "no error"
        except CollectiveError as err:
            out["reuse"] = f"CollectiveError:{err.kind}"
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def gloo_pair():
    return run_ranks(_worker, 2, timeout_s=120, store_timeout_s=30, join_s=10)


def test_overlapped_buckets_match_the_plain_allreduce_over_many_steps(gloo_pair):
    for rank, o in gloo_pair.items():
        assert o["n_buckets"] >= 3, "the parity run must use several buckets"
        assert o["moved"] > 1e-3, "the model must actually train"
        assert o["max_diff"] <= 1e-6, (
            f"rank {rank}: overlapped vs plain differ by {o['max_diff']:.2e} after {STEPS} steps"
        )
    assert gloo_pair[0]["params"] == gloo_pair[1]["params"], "both members hold the same params after every step"


def test_a_peer_killed_mid_backward_is_a_collective_error_on_the_survivor(gloo_pair):
    o = gloo_pair[0]
    assert o["after_death"].startswith("CollectiveError"), f"survivor: {o['after_death']}"
    assert o["detect_s"] < HANG_S, f"survivor took {o['detect_s']:.1f}s to see the death (a hang)"
    assert o["reuse"] == "CollectiveError:aborted", "the group is unusable until re-formed"


def test_a_parameter_without_a_gradient_gets_the_mean_and_a_frozen_one_is_left_alone():
    """An unused parameter counts as zeros in its bucket, so every member launches the same buckets
    and ends with the same gradient; a frozen parameter is not synced at all."""
    model = _model()
    params = list(model.parameters())
    params[0].requires_grad_(False)
    unused = torch.nn.Parameter(torch.ones(3))
    buckets = GradBuckets(params + [unused], bucket_mb=1)
    assert all(p is not params[0] for p in buckets.params)
    buckets.arm(_group(FakePG(members=2)))
    _backward(model)
    buckets.finish()
    assert params[0].grad is None and torch.equal(unused.grad, torch.zeros(3))
