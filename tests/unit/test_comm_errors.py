"""hsgd.train.comm's error model: every call into torch.distributed / torchft that fails — building
the group, configure, set_timeout, issuing an op, a device copy, the wait, a wait that returns
False, a group left errored — is a CollectiveError with a kind, never torch's own error type; the
group is unusable afterwards; abort never raises. Fake process groups and works, no processes."""

import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hsgd.core.round import ErrorKind
from hsgd.train import comm
from hsgd.train.comm import CollectiveError, LevelGroup
from tests.fakes.process_group import FakePG, FakeWork

# torch's own distributed error types, as NCCL and gloo raise them
DIST_BACKEND = dist.DistBackendError("NCCL error: invalid usage, Duplicate GPU detected")
DIST_NETWORK = dist.DistNetworkError("connect() timed out")


def _configured(monkeypatch, pg, world_size=2):
    monkeypatch.setattr(comm, "_make_torchft_group", lambda backend, timeout_s: pg)
    monkeypatch.setattr(comm, "_await_members", lambda *args: None)  # every member arrived (no store here)
    group = LevelGroup("inner", timeout_s=1.0, configure_timeout_s=2.0)
    group.configure("127.0.0.1:1/secret", "run/epoch1/inner/c0", rank=0, world_size=world_size, epoch=1)
    return group


def _ops(group):
    return [
        lambda: group.allreduce_mean([torch.ones(3)], level="inner"),
        lambda: group.broadcast([torch.ones(3)], root=1, level="inner"),
    ]


def test_a_group_that_cannot_be_built_raises_collective_error(monkeypatch):
    def boom(backend, timeout_s):
        raise RuntimeError("NCCL needs CUDA")  # e.g. torch.cuda.nccl.version() on a CPU build

    monkeypatch.setattr(comm, "_make_torchft_group", boom)
    group = LevelGroup("inner")
    with pytest.raises(CollectiveError) as info:
        group.configure("h:1/s", "run/epoch1/inner/c0", rank=0, world_size=2, epoch=1)
    assert info.value.kind == "configure"
    with pytest.raises(CollectiveError) as again:
        group.allreduce_mean([torch.ones(1)], level="inner")
    assert again.value.kind == "aborted", "a group whose join failed must stay unusable"


@pytest.mark.parametrize("where", ["configure", "set_timeout"])
@pytest.mark.parametrize("error", [DIST_NETWORK, DIST_BACKEND, TimeoutError("store"), ValueError("x")])
def test_configure_and_set_timeout_failures_are_collective_errors(monkeypatch, where, error):
    pg = FakePG(**{where: error})
    with pytest.raises(CollectiveError) as info:
        _configured(monkeypatch, pg)
    assert info.value.kind == "configure" and info.value.__cause__ is error
    assert pg.aborted == 1, "a half-joined group is aborted"


@pytest.mark.parametrize("op", [0, 1], ids=["allreduce", "broadcast"])
@pytest.mark.parametrize("error", [DIST_BACKEND, RuntimeError("lazy init failed")])
def test_an_error_raised_when_the_op_is_issued_is_a_collective_error(monkeypatch, op, error):
    group = _configured(monkeypatch, FakePG(issue=error))
    with pytest.raises(CollectiveError) as info:
        _ops(group)[op]()
    assert info.value.kind == "issue" and "run/epoch1/inner/c0" in str(info.value)
    with pytest.raises(CollectiveError) as again:
        _ops(group)[op]()
    assert again.value.kind == "aborted", "the group is unusable after an error until re-configured"


@pytest.mark.parametrize("op", [0, 1], ids=["allreduce", "broadcast"])
@pytest.mark.parametrize(
    "error,kind",
    [
        (RuntimeError("[pair.cc:534] Connection closed by peer [1.2.3.4]:5"), "peer_gone"),
        (RuntimeError("Timed out waiting 1000ms for recv operation"), "timeout"),
        (DIST_BACKEND, "wait"),
    ],
)
def test_an_error_raised_by_the_wait_is_a_collective_error_with_its_kind(monkeypatch, op, error, kind):
    group = _configured(monkeypatch, FakePG(work=FakeWork(wait=error)))
    with pytest.raises(CollectiveError) as info:
        _ops(group)[op]()
    assert info.value.kind == kind


@pytest.mark.parametrize("op", [0, 1], ids=["allreduce", "broadcast"])
def test_a_wait_that_returns_false_is_a_timeout_not_a_silent_return(monkeypatch, op):
    t = torch.ones(3)
    group = _configured(monkeypatch, FakePG(work=FakeWork(result=False)))
    with pytest.raises(CollectiveError) as info:
        [lambda: group.allreduce_mean([t], level="inner"), lambda: group.broadcast([t], root=1, level="inner")][op]()
    assert info.value.kind == "timeout"
    assert torch.equal(t, torch.ones(3)), "a collective that did not complete must not write its result"


@pytest.mark.parametrize("op", [0, 1], ids=["allreduce", "broadcast"])
def test_a_wait_that_leaves_the_group_errored_is_aborted(monkeypatch, op):
    """torchft's NCCL group aborts itself at the deadline and records it in `errored()`; the wait
    may then return normally — that is still an error."""
    group = _configured(monkeypatch, FakePG(errored=RuntimeError("aborted")))
    with pytest.raises(CollectiveError) as info:
        _ops(group)[op]()
    assert info.value.kind == "aborted"


def test_a_wait_that_runs_to_its_deadline_is_a_timeout_whatever_the_text(monkeypatch):
    import time

    class SlowWork(FakeWork):
        def wait(self, timeout=None):
            time.sleep(timeout.total_seconds())
            raise RuntimeError("some backend text")

    group = _configured(monkeypatch, FakePG(work=SlowWork()))
    group.timeout_s = 0.05
    with pytest.raises(CollectiveError) as info:
        group.allreduce_mean([torch.ones(1)], level="inner")
    assert info.value.kind == "timeout"


def test_a_device_copy_that_fails_is_a_collective_error(monkeypatch):
    group = _configured(monkeypatch, FakePG())
    group.backend = "nccl"  # a CPU tensor is copied to the GPU first; this torch has no CUDA
    with pytest.raises(CollectiveError) as info:
        group.allreduce_mean([torch.ones(2)], level="inner")
    assert info.value.kind == "issue"


def test_abort_never_raises(monkeypatch):
    pg = FakePG(abort=DIST_BACKEND)
    group = _configured(monkeypatch, pg)
    group.abort()
    assert pg.aborted == 1
    group.abort()  # nothing left to abort


def test_after_a_failure_the_collective_guard_is_released(monkeypatch):
    group = _configured(monkeypatch, FakePG(issue=DIST_BACKEND))
    with pytest.raises(CollectiveError):
        group.allreduce_mean([torch.ones(1)], level="inner")
    with comm.one_collective("next"):  # would raise OverlappingCollectiveError if still held
        pass


def test_a_healthy_fake_collective_completes_and_waits_with_its_deadline(monkeypatch):
    """The checks above are not simply always raising: a work that completes, on a group that is
    not errored, gives the mean."""
    work = FakeWork()
    group = _configured(monkeypatch, FakePG(work=work))
    t = [torch.full((2,), 4.0)]
    group.allreduce_mean(t, level="inner")  # the fake does not sum: the mean of "4 summed" is 2
    assert torch.equal(t[0], torch.full((2,), 2.0))
    assert work.waited == timedelta(seconds=comm.collective_timeout_s(1.0, 8, group.min_gbps))


def test_collective_error_keeps_its_kind_across_pickling():
    err = pickle.loads(pickle.dumps(CollectiveError("inner: x", "peer_gone")))
    assert isinstance(err, CollectiveError) and err.kind == "peer_gone" and str(err) == "inner: x"
    assert CollectiveError("legacy").kind == "wait"
    assert err.kind is ErrorKind.PEER_GONE and f"{err.kind}" == "peer_gone", "the kind is hsgd.core's one ErrorKind"
    with pytest.raises(ValueError):
        CollectiveError("x", "nonsense")


def test_nccl_environment_follows_comm_settings(monkeypatch):
    import os

    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        monkeypatch.setenv(key, "stale")  # restored after the test
    env = comm.apply_nccl_environment(45.0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", "an NCCL error must fail the op, not kill the process"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "45"
    assert all(os.environ[k] == v for k, v in env.items())


def test_the_replica_sets_the_nccl_environment_before_it_makes_a_group():
    """actors/replica.py applies comm's NCCL settings in __init__, before the level groups exist."""
    import inspect

    from actors import replica

    src = inspect.getsource(replica.Replica.__ray_actor_class__.__init__)
    assert "apply_nccl_environment(" in src
    assert src.index("apply_nccl_environment(") < src.index("_level_group(")
