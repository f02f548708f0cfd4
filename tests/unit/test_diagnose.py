"""jobs.diagnose trusts nothing in run.json (it may sit in a shared, writable folder) with the
local Ray token or a signal: the attach and signal decisions (pure; no Ray)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs.diagnose import attach_address, verified_replica_pid

REPO = Path(__file__).resolve().parents[2]
HERE, ME = "n" * 56, 1000
NAME = "hsgd-run-abc-c0r1"


def _actor(**kw):
    return {
        "Name": NAME,
        "ActorClassName": "Replica",
        "State": "ALIVE",
        "Pid": 4242,
        "Address": {"NodeID": HERE, "IPAddress": "10.0.0.1"},
        **kw,
    }


def _verify(actor, answered=4242, uid=ME):
    return verified_replica_pid(
        actor, expected_name=NAME, here_node=HERE, answered_pid=answered, process_uid=uid, my_uid=ME
    )


def test_attaches_to_this_users_local_cluster_named_in_run_json():
    assert attach_address("10.0.0.1:6379", None, {"10.0.0.1:6379", "127.0.0.1:555"}) == ("10.0.0.1:6379", None)
    assert attach_address("10.0.0.1:6379", "auto", {"10.0.0.1:6379"}) == ("10.0.0.1:6379", None)


def test_a_run_json_naming_another_address_is_refused_in_one_line():
    address, refusal = attach_address("203.0.113.9:6379", None, {"10.0.0.1:6379"})
    assert address is None and "203.0.113.9:6379" in refusal and "\n" not in refusal
    address, refusal = attach_address("203.0.113.9:6379", None, set())
    assert address is None and "local: none" in refusal
    assert attach_address(None, None, {"10.0.0.1:6379"})[0] is None


def test_ray_address_is_the_users_choice_and_run_json_must_agree_with_it():
    assert attach_address("head:6379", "head:6379", set()) == ("head:6379", None)
    address, refusal = attach_address("evil:6379", "head:6379", {"evil:6379"})
    assert address is None and "RAY_ADDRESS is head:6379" in refusal


def test_only_this_runs_live_replica_on_this_node_owned_by_this_user_is_signalled():
    assert _verify(_actor()) == (4242, "")
    assert _verify(_actor(), answered=None) == (4242, ""), "a hung replica: Ray's table alone"
    refused = {
        "another actor's name": _verify(_actor(Name="hsgd-other-c0r1")),
        "not a replica": _verify(_actor(ActorClassName="Supervisor")),
        "dead": _verify(_actor(State="DEAD")),
        "restarting": _verify(_actor(State="RESTARTING")),
        "no pid": _verify(_actor(Pid=0)),
        "another node": _verify(_actor(Address={"NodeID": "m" * 56})),
        "pid disagrees": _verify(_actor(), answered=1),
        "no such process": _verify(_actor(), uid=None),
        "another user's process": _verify(_actor(), uid=0),
        "no table entry": _verify(None),
    }
    for case, (pid, why) in refused.items():
        assert pid is None and why, case


def test_a_run_json_pointing_elsewhere_exits_2_without_connecting(tmp_path):
    """The old diagnose set RAY_AUTH_MODE=token and ray.init(address=<run.json's>): the local token
    went to whatever address the folder named."""
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "run_id": "x",
                "namespace": "hsgd",
                "ray_address": "203.0.113.9:6379",
                "replicas": ["c0r0"],
                "auth_mode": "token",
                "pids": {"c0r0": {"pid": 1}},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-m", "jobs.diagnose", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "203.0.113.9:6379" in lines[0], out.stderr
    assert "supervisor view" not in out.stdout
