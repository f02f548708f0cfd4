"""A fake torchft process group and its work handles: the surface hsgd.train.comm.LevelGroup uses,
each failure point a switch and every op recorded; no processes. And `IdleLevelGroup`, a LevelGroup
that moves nothing, for code that only reads its counters and aborts it."""

from __future__ import annotations


class FakeWork:
    """An op's handle: wait(timeout) records the timeout (`waited`, the last; `waits`, all), then
    raises `wait` or returns `result`."""

    def __init__(self, wait: BaseException | None = None, result=True):
        self._wait, self.result, self.waited = wait, result, None
        self.waits: list = []

    def wait(self, timeout=None):
        self.waited = timeout
        self.waits.append(timeout)
        if self._wait is not None:
            raise self._wait
        return self.result


class FakePG:
    """torchft's ProcessGroupWrapper as LevelGroup uses it. Switches: the error configure,
    set_timeout, issuing an op (`issue`) or abort raises (`configure` may also be a function of
    configure's keyword arguments that returns the exception); the handle every op returns (`work`);
    what errored() answers. `calls`: (op, numel of its first tensor) in order (pass a list to share
    it with the test's own log); `op_timeouts`: each op's own timeout (its options'); `configured`:
    configure's keyword arguments. An all-reduce sums as if `members` members held the same tensor;
    an all-gather hands every member the input."""

    def __init__(
        self,
        configure=None,
        set_timeout=None,
        issue=None,
        work=None,
        errored=None,
        abort=None,
        *,
        members=1,
        calls=None,
    ):
        self.fail_configure, self.fail_set_timeout, self.fail_issue = configure, set_timeout, issue
        self.work, self._errored, self.fail_abort = work or FakeWork(), errored, abort
        self.members, self.calls = members, calls if calls is not None else []
        self.aborted, self.op_timeouts, self.configured = 0, [], None

    def configure(self, **kwargs):
        self.configured = kwargs
        if isinstance(self.fail_configure, BaseException):
            raise self.fail_configure
        if self.fail_configure:
            raise self.fail_configure(kwargs)

    def set_timeout(self, timeout):
        if self.fail_set_timeout:
            raise self.fail_set_timeout

    def _issue(self, op: str, numel: int, opts) -> FakeWork:
        if self.fail_issue:
            raise self.fail_issue
        self.calls.append((op, numel))
        self.op_timeouts.append(getattr(opts, "timeout", None))
        return self.work

    def allreduce(self, tensors, opts):
        work = self._issue("allreduce", tensors[0].numel(), opts)
        if self.members != 1:
            tensors[0].mul_(self.members)
        return work

    def broadcast(self, tensors, opts):
        return self._issue("broadcast", tensors[0].numel(), opts)

    def allgather(self, outputs, inputs, opts):
        work = self._issue("allgather", inputs[0].numel(), opts)
        for out in outputs[0]:
            out.copy_(inputs[0])
        return work

    def errored(self):
        return self._errored

    def abort(self, errored=True):
        self.aborted += 1
        if self.fail_abort:
            raise self.fail_abort


class IdleLevelGroup:
    """hsgd.train.comm.LevelGroup as hsgd.train.overlap.BackgroundReduce reads it: byte and link-time
    counters that stay 0, the arrival allowance it sets, and `aborted`, how many times it was aborted."""

    bytes_sent, bytes_received, link_s, arrival_s, aborted = 0, 0, 0.0, 0.0, 0

    def abort(self):
        self.aborted += 1
