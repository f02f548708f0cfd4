"""hsgd.record.runlock: a run owns its folder (an O_EXCL lock, refreshed while the run lives)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hsgd.record import runlock
from hsgd.record.runlock import LOCK_NAME, RunLock, RunLocked


def _dead_pid() -> int:
    """The pid of a process that has exited (reaped), so nothing answers to it."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(run_dir, **fields):
    info = {
        "run_id": "old-run",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.time(),
        "refreshed_at": time.time(),
        **fields,
    }
    (run_dir / LOCK_NAME).write_text(json.dumps(info))
    return info


def test_acquire_writes_run_id_host_pid_and_release_removes_it(tmp_path):
    lock = RunLock(tmp_path, "run-1").acquire(takeover=False)
    info = runlock.read_lock(tmp_path)
    assert info["run_id"] == "run-1" and info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert abs(info["refreshed_at"] - time.time()) < 30
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists(), "the lock must be removed at the run's end"


@pytest.mark.parametrize("takeover", [False, True])
def test_a_live_lock_is_refused_even_with_takeover(tmp_path, takeover):
    before = _write_lock(tmp_path)  # this very process: alive, just refreshed
    with pytest.raises(RunLocked, match="in use by run old-run"):
        RunLock(tmp_path, "run-2").acquire(takeover=takeover)
    with pytest.raises(RunLocked, match="in use"):
        runlock.check(tmp_path, takeover=takeover)
    assert runlock.read_lock(tmp_path) == before, "a refused run must leave the live lock as it was"


def test_a_lock_whose_process_is_gone_is_stale_and_taken_over_only_when_asked(tmp_path):
    _write_lock(tmp_path, pid=_dead_pid())
    with pytest.raises(RunLocked, match="stale.*train.resume=true"):
        RunLock(tmp_path, "run-2").acquire(takeover=False)
    runlock.check(tmp_path, takeover=True)  # the pre-check lets a takeover through
    lock = RunLock(tmp_path, "run-2").acquire(takeover=True)
    try:
        assert lock.taken_over["run_id"] == "old-run" and "is gone" in lock.taken_over["reason"]
        assert runlock.read_lock(tmp_path)["run_id"] == "run-2"
    finally:
        lock.release()


def test_a_lock_not_refreshed_for_a_minute_is_stale_even_on_another_host(tmp_path):
    _write_lock(tmp_path, host="elsewhere", pid=1, refreshed_at=time.time() - runlock.STALE_AFTER_S - 5)
    lock = RunLock(tmp_path, "run-2").acquire(takeover=True)
    try:
        assert "not refreshed" in lock.taken_over["reason"]
    finally:
        lock.release()


def test_a_fresh_lock_on_another_host_is_live(tmp_path):
    _write_lock(tmp_path, host="elsewhere", pid=_dead_pid())  # that pid means nothing here
    with pytest.raises(RunLocked, match="in use"):
        RunLock(tmp_path, "run-2").acquire(takeover=True)


def test_only_one_of_two_runs_gets_the_lock(tmp_path):
    first = RunLock(tmp_path, "run-1").acquire(takeover=True)
    try:
        with pytest.raises(RunLocked):
            RunLock(tmp_path, "run-2").acquire(takeover=True)
        assert runlock.read_lock(tmp_path)["run_id"] == "run-1"
    finally:
        first.release()


def test_the_refresher_keeps_the_lock_fresh_through_renames(tmp_path):
    lock = RunLock(tmp_path, "run-1", refresh_s=0.05).acquire(takeover=False)
    try:
        first = runlock.read_lock(tmp_path)["refreshed_at"]
        time.sleep(0.4)
        assert runlock.read_lock(tmp_path)["refreshed_at"] > first, "the lock was not refreshed"
        in_flight = set(os.listdir(tmp_path)) - {LOCK_NAME}  # a refresh may be writing its temp file now
        time.sleep(0.3)
        assert not in_flight & set(os.listdir(tmp_path)), "a refresh left a temp file behind"
    finally:
        lock.release()
    assert os.listdir(tmp_path) == [], "release left a file behind"


def test_a_run_whose_lock_was_taken_over_stops_refreshing_and_never_removes_the_new_lock(tmp_path):
    lock = RunLock(tmp_path, "run-1", refresh_s=0.05).acquire(takeover=False)
    _write_lock(tmp_path, run_id="run-2")  # another run took it over (this one looked stale)
    time.sleep(0.3)
    assert lock.lost and "run-2" in lock.lost
    lock.release()
    assert runlock.read_lock(tmp_path)["run_id"] == "run-2", "release removed another run's lock"


def test_an_unreadable_lock_is_live_until_it_is_old(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text("")  # a lock being created right now
    with pytest.raises(RunLocked, match="being written"):
        RunLock(tmp_path, "run-2").acquire(takeover=True)
    old = time.time() - runlock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lock = RunLock(tmp_path, "run-2").acquire(takeover=True)
    lock.release()


def test_the_default_run_folder_has_a_random_suffix_and_hydra_names_the_same_folder():
    """Two jobs started in the same second get different folders; Hydra's run dir (where it writes
    .hydra/) and cfg.run.dir resolve to one folder although the resolver runs for each."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from hsgd.config import register_schema
    from hsgd.config.compose import CONF_DIR
    from hsgd.config.paths import output_path, run_suffix

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        run_dir, hydra_dir = str(cfg.run.dir), str(cfg.hydra.run.dir)
    GlobalHydra.instance().clear()
    suffix = run_suffix()
    assert len(suffix) == 6 and int(suffix, 16) >= 0
    assert run_dir.endswith(f"-hsgd-{suffix}") and hydra_dir == output_path(run_dir), (run_dir, hydra_dir)
    other = subprocess.run(
        [sys.executable, "-c", "from hsgd.config.paths import run_suffix; print(run_suffix())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert len(other) == 6 and other != suffix, "another process must draw its own suffix"
