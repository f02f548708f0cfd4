"""A fake torchft process group and its work handles: the surface hsgd.train.comm.LevelGroup uses,
each failure point a switch and every op recorded; no processes."""

from __future__ import annotations


class FakeWork:
    """An op's handle: wait(timeout) records the timeout, then raises `wait` or returns `result`."""

    def __init__(self, wait: BaseException | None = None, result=True):
        self._wait, self.result, self.waited = wait, result, None

    def wait(self, timeout=None):
        self.waited = timeout
        if self._wait is not None:
            raise self._wait
        return self.result


class FakePG:
    """torchft's ProcessGroupWrapper as LevelGroup uses it. Switches: the error configure,
    set_timeout, issuing an op (`issue`) or abort raises; the handle every op returns (`work`); what
    errored() answers. `calls`: (op, numel of its first tensor) in order (pass a list to share it
    with the test's own log). An all-reduce sums as if `members` members held the same tensor; an
    all-gather hands every member the input."""

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
        self.aborted = 0

    def configure(self, **kwargs):
        self.configured = kwargs
        if self.fail_configure:
            raise self.fail_configure

    def set_timeout(self, timeout):
        if self.fail_set_timeout:
            raise self.fail_set_timeout

    def _issue(self, op: str, numel: int) -> FakeWork:
        if self.fail_issue:
            raise self.fail_issue
        self.calls.append((op, numel))
        return self.work

    def allreduce(self, tensors, opts):
        work = self._issue("allreduce", tensors[0].numel())
        if self.members != 1:
            tensors[0].mul_(self.members)
        return work

    def broadcast(self, tensors, opts):
        return self._issue("broadcast", tensors[0].numel())

    def allgather(self, outputs, inputs, opts):
        work = self._issue("allgather", inputs[0].numel())
        for out in outputs[0]:
            out.copy_(inputs[0])
        return work

    def errored(self):
        return self._errored

    def abort(self, errored=True):
        self.aborted += 1
        if self.fail_abort:
            raise self.fail_abort
