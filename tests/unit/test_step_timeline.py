"""`logging.step_times` (the per-step timeline the benchmarks read) and `train.straggle_p` (the
simulated stragglers of `python -m benchmarks straggler`), on one replica's trainer."""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks.peers.common import Kill, read_steps, recovery
from hsgd.record.steps import StepLog
from tests.fakes.trainer import _solo, _trainer, dataset  # noqa: F401 — the module's fixture


def test_each_committed_step_is_one_line_with_its_step_time_and_pid(dataset, tmp_path):  # noqa: F811
    trainer = _trainer(dataset)
    trainer.step_log = StepLog(tmp_path, "c0r0")
    trainer.run_inner(0, _solo("inner"))
    rows = read_steps(tmp_path)["c0r0"]
    assert [r["step"] for r in rows] == [1, 2, 3]  # sync.outer_every=3 steps, counted after each
    assert all(r["pid"] == os.getpid() and r["replica"] == "c0r0" for r in rows)
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)


def test_a_torn_last_line_from_a_kill_is_skipped(tmp_path):
    log = StepLog(tmp_path, "r0")
    log.committed(1)
    log.close()
    with open(tmp_path / "r0.jsonl", "a") as f:
        f.write('{"replica": "r0", "st')  # the process died mid-write
    assert [r["step"] for r in read_steps(tmp_path)["r0"]] == [1]


def test_an_unwritable_step_log_never_stops_training(dataset, tmp_path):  # noqa: F811
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    trainer = _trainer(dataset)
    trainer.step_log = StepLog(blocker / "steps", "c0r0")  # mkdir fails: no timeline
    assert trainer.run_inner(0, _solo("inner")).steps_done == 3


def test_stall_and_rejoin_are_read_from_the_logs_around_the_kill(tmp_path):
    rows = {
        "r0": [(1, 10.0, 1), (2, 11.0, 1), (3, 15.5, 1)],  # survivor: stalled from 11.0 to 15.5
        "r1": [(1, 10.0, 2), (2, 11.0, 2), (2, 19.0, 3)],
    }  # killed at 12.0, its new pid commits at 19.0
    for name, steps in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"replica": name, "step": s, "t": t, "pid": pid}) + "\n" for s, t, pid in steps)
        )
    figures = recovery(read_steps(tmp_path), Kill("r1", 2, 12.0)).as_dict()
    assert figures["survivors_stall_s"] == {"r0": 4.5}
    assert figures["rejoin_s"] == 7.0


def test_a_step_committed_after_the_kill_and_rolled_back_is_not_the_survivors_next_step(tmp_path):
    # r0 commits step 3 just after r1's death (its group has not noticed yet), then the group
    # restarts from the checkpoint at step 2 and commits 3 again at 20.0: it went on at 20.0
    rows = {
        "r0": [(1, 10.0, 1), (2, 11.0, 1), (3, 12.2, 1), (3, 20.0, 5), (4, 20.3, 5)],
        "r1": [(1, 10.0, 2), (2, 11.0, 2), (3, 20.1, 6)],
    }
    for name, steps in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"replica": name, "step": s, "t": t, "pid": pid}) + "\n" for s, t, pid in steps)
        )
    figures = recovery(read_steps(tmp_path), Kill("r1", 2, 12.0)).as_dict()
    assert figures["survivors_stall_s"] == {"r0": 20.0 - 11.0}
    assert figures["rejoin_s"] == pytest.approx(8.1)


def test_stragglers_sleep_a_multiple_of_the_step_at_the_drawn_steps_and_replay_alike(dataset):  # noqa: F811
    def straggling_steps(p):
        trainer = _trainer(dataset, "c0r0", f"train.straggle_p={p}", "train.straggle_factor=0", "train.min_step_s=0.0")
        pacer = trainer.pacer  # hsgd.train.simulate.StepPacer: None when nothing is simulated
        return [pacer is not None and pacer.straggles(trainer.global_index, step) for step in range(400)]

    drawn = straggling_steps(0.25)
    assert drawn == straggling_steps(0.25)  # the same steps on a replay
    assert 60 < sum(drawn) < 140  # ~ p of the steps
    assert not any(straggling_steps(0.0))

    trainer = _trainer(dataset, "c0r0", "train.straggle_p=0.999", "train.straggle_factor=4", "train.min_step_s=0.05")
    start = time.perf_counter()
    trainer.run_inner(0, _solo("inner"))  # 3 steps of >= 0.05 s, each followed by >= 4 x its time
    assert time.perf_counter() - start >= 3 * 0.05 * 5
