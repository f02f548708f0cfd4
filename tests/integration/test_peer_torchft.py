"""The torchft peer (benchmarks/peers/torchft_peer.py): hsgd's model under torchft's Manager + Lighthouse,
one replica killed from outside and restarted; it heals from a live peer and commits again."""

import json
import os

import pytest

from benchmarks.peers.common import read_steps
from benchmarks.peers.torchft_peer import SETTINGS, run_torchft
from tests.fakes.deadlines import HANG_S


@pytest.mark.long  # a 40-s run, out of the default suite's 20 minutes
@pytest.mark.paced  # steps padded to 0.2 s, processes mostly asleep: beside the busy long runs (tests/run_all.sh)
def test_killed_torchft_replica_heals_from_a_live_peer_and_ends_with_the_same_params(tmp_path):
    # the victim is killed at step 10; the others go on for 190 steps (38 s) while it restarts, heals
    # and rejoins: ~4 s alone, 10x that on busy cores (a victim back after the first replica finished
    # would have nobody to heal from: the peer's `unfinished`)
    steps = 200
    # patch_ddp_hook: a kill that lands between a quorum and its all-reduce skips the survivors'
    # step instead of crashing them in torchft 0.2.0's comm hook (module docstring, "What can
    # fail"); what this test checks is torchft's heal, through the Manager, from a live peer.
    result = run_torchft(
        model="tiny",
        replicas=3,
        steps=steps,
        min_step_s=0.2,
        settings="fast",
        out=tmp_path,
        kills=[("r1", 10)],
        timeout_s=HANG_S,
        overrides=["model.n_layer=1"],
        digest_every=5,
        patch_ddp_hook=True,
    )
    assert result["peer"] == "torchft" and result["settings"] == "fast"
    assert result["settings_detail"]["lighthouse"]["join_timeout_ms"] == 100
    (kill,) = result["kills"]
    assert kill["replica"] == "r1" and result["restarts"] == 1 and not result["crashes"]
    assert not result["unfinished"] and not result["kills_skipped"]

    (rec,) = result["recoveries"]
    assert rec["victim"] == "r1"
    assert set(rec["survivors_stall_s"]) == {"r0", "r2"}  # both survivors committed before and after the kill
    assert rec["rejoin_s"] is not None and rec["rejoin_s"] > 0

    logs = read_steps(tmp_path / "steps")
    after = [row for row in logs["r1"] if row["t"] > kill["t"]]
    assert after and all(row["pid"] != kill["pid"] for row in after)  # the restarted process committed
    assert after[0]["step"] > 10  # it healed to the quorum's step rather than starting over
    for replica in ("r0", "r1", "r2"):
        assert logs[replica][-1]["step"] == steps, replica
    final = result["final"]
    assert final["r1"]["pid"] != kill["pid"] and final["r1"]["heals"] >= 1

    # every step's params agree across the replicas that committed it together, and the
    # restarted process took part in at least one such step after its heal
    assert result["params_agree"] is True and not result["digest_mismatch_steps"]
    rows = [
        json.loads(line)
        for name in ("r0", "r1", "r2")
        for line in (tmp_path / "digests" / f"{name}.jsonl").read_text().splitlines()
    ]
    shared = [
        (r["step"], r["digest"])
        for r in rows
        if r["replica"] == "r1" and r["pid"] != kill["pid"] and r["quorum_size"] >= 2
    ]
    survivors = {(r["step"], r["digest"]) for r in rows if r["replica"] != "r1"}
    assert shared and set(shared) <= survivors
    assert result["step_time_s"] is not None and result["wall_s"] is not None
    assert result["committed_steps"] >= steps * 2


def test_workers_leave_no_process_behind_when_the_run_fails(tmp_path):
    # a run that cannot finish in time raises, and its finally kills every worker it started
    with pytest.raises(TimeoutError):
        run_torchft(
            model="tiny",
            replicas=2,
            steps=10_000,
            min_step_s=0.2,
            settings="fast",
            out=tmp_path,
            timeout_s=3,
            overrides=["model.n_layer=1"],
        )
    started = [json.loads(line) for line in (tmp_path / "logs" / "processes.jsonl").read_text().splitlines()]
    assert {p["replica"] for p in started} == {"r0", "r1"}
    for p in started:
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)  # gone (and reaped: a zombie would still answer)


def test_settings_name_the_readme_flags_and_bad_arguments_are_refused(tmp_path):
    assert SETTINGS["readme"]["lighthouse"] == {
        "min_replicas": 1,
        "join_timeout_ms": 10000,
        "quorum_tick_ms": 100,
        "heartbeat_timeout_ms": 5000,
    }
    with pytest.raises(ValueError, match="settings"):
        run_torchft(model="tiny", replicas=2, steps=1, min_step_s=0.0, settings="slow", out=tmp_path)
    with pytest.raises(ValueError, match="r7"):
        run_torchft(model="tiny", replicas=2, steps=1, min_step_s=0.0, settings="fast", out=tmp_path, kills=[("r7", 1)])
    assert not (tmp_path / "logs").exists()  # refused before any process started
