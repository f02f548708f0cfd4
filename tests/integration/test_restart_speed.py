"""A restarted replica answers `progress` as soon as its __init__ returns and builds its trainer
behind it (actors/replica.py, issue 36 Build 3): what it then trains is exactly what a replica built
in __init__ trains — the same params from the seed, the same data stream. Behaviour only: how fast
it comes back is the recovery bench's figure (`restart_breakdown`), never asserted here."""

from __future__ import annotations

import os
import signal
import time

import ray
from omegaconf import OmegaConf

from hsgd.core.round import GroupJoin
from tests.integration.runs import FAST

ALONE = GroupJoin(0, None, "solo/inner", 0, 1)  # a group of one needs no store


def _restarted(handle, old_pid: int, timeout_s: float = 120.0) -> dict:
    """The progress answer of the process Ray restarted after `old_pid` was killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = ray.get(handle.progress.remote(), timeout=30)
        except Exception:  # noqa: BLE001 — the dead process's call fails; the restarted one answers
            time.sleep(0.1)
            continue
        if answer["pid"] != old_pid:
            return answer
        time.sleep(0.1)
    raise TimeoutError("the replica did not come back")


def test_a_restarted_replica_answers_up_before_its_build_and_then_trains_as_one_built_in_init(tmp_path):
    from actors.launch import compose_config
    from actors.replica import Replica

    cfg = OmegaConf.to_container(compose_config(FAST), resolve=True)
    backends = {"inner": "gloo", "outer": "gloo"}
    (tmp_path / "fresh").mkdir()
    victim = Replica.options(max_restarts=1, max_task_retries=0).remote(cfg, "c0r1", str(tmp_path), backends)
    fresh = Replica.options(max_restarts=0).remote(cfg, "c0r1", str(tmp_path / "fresh"), backends)
    try:
        first = ray.get(victim.progress.remote(), timeout=120)
        assert first["startup"]["built"] <= first["startup"]["init_end"]  # a first start builds in __init__
        os.kill(first["pid"], signal.SIGKILL)
        back = _restarted(victim, first["pid"])
        assert (back["incarnation"], back["round"], back["step"], back["spare"], back["phase"]) == (
            1,
            0,
            0,
            False,
            "idle",
        )
        assert back["replica_index"] == first["replica_index"]
        # a phase call at once: it waits for the build behind __init__, then runs
        answer = ray.get(victim.run_inner.remote(0, None, ALONE), timeout=300).wire()
        expected = ray.get(fresh.run_inner.remote(0, None, ALONE), timeout=300).wire()
        assert answer["outcome"] == expected["outcome"] == "done"
        assert (answer["round"], answer["step"]) == (expected["round"], expected["step"])
        after = ray.get(victim.progress.remote(), timeout=60)
        assert "built" in after["startup"]
        assert after["startup"]["built"] > after["startup"]["init_end"], (
            "a restart answers up first and builds behind __init__ (its build ends after __init__ returned)"
        )
        assert after["param_bytes"] == first["param_bytes"] and after["tokens_per_step"] == first["tokens_per_step"]
        ours, theirs = (ray.get(h.digests.remote(), timeout=60) for h in (victim, fresh))
        assert ours == theirs, "a restart built behind __init__ trains other params or another data stream"
    finally:
        for h in (victim, fresh):
            ray.kill(h)
