"""The embedded Ray is started again when Ray's own start-up wait runs out (found by CI: the drill
notebook's `ray.init` on a busy 2-core machine raised "The current node timed out during startup",
Ray's hard-coded 30 s for its raylet to register). What the failed start spawned is killed first;
any other error, and the last start's, is raised as it came."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import ray

from actors import ray_start as launch

TIMED_OUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet failed "
    "to startup or the GCS has become overloaded."
)


def _ray_that_fails(monkeypatch, errors: list[BaseException]) -> list[subprocess.Popen]:
    """ray.init raises each of `errors` in turn (leaving a process behind, as Ray does), then succeeds;
    returns the processes each failed start left."""
    left: list[subprocess.Popen] = []

    def init(**kwargs):
        if len(left) < len(errors):
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise errors[len(left) - 1]

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return left


def _running(proc: subprocess.Popen) -> bool:
    """Still there (the launcher reaps what it kills: Popen's own returncode then says nothing)."""
    return psutil.pid_exists(proc.pid) and psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE


def test_a_start_that_timed_out_is_cleaned_up_and_started_again(monkeypatch, capsys):
    left = _ray_that_fails(monkeypatch, [TIMED_OUT, TIMED_OUT])
    launch.start_embedded_ray(address="local")
    assert len(left) == 2, "started three times: two timed out, the third came up"
    assert not any(_running(proc) for proc in left), "what each failed start left was killed"
    out = capsys.readouterr().out
    assert "starting it again (2/3)" in out and "starting it again (3/3)" in out


def test_the_last_start_that_timed_out_is_raised(monkeypatch):
    left = _ray_that_fails(monkeypatch, [TIMED_OUT] * launch.EMBEDDED_STARTS)
    with pytest.raises(Exception, match="timed out during startup"):
        launch.start_embedded_ray(address="local")
    assert len(left) == launch.EMBEDDED_STARTS
    assert not any(_running(proc) for proc in left), "what each failed start left was killed, the last one's too"


def test_any_other_error_is_raised_at_once(monkeypatch):
    left = _ray_that_fails(monkeypatch, [ValueError("num_cpus must not be provided")])
    with pytest.raises(ValueError, match="num_cpus"):
        launch.start_embedded_ray(address="local")
    assert len(left) == 1
    left[0].kill()
