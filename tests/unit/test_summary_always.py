"""summary.json is always there, or on the console: the driver's fallback summary has the
supervisor's keys, is written when the supervisor could not write it, and is printed as one JSON
line when the folder cannot hold it."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from hsgd.config import HsgdConfig
from hsgd.config.layout import layout_of
from hsgd.record.metrics import fallback_summary, run_summary
from hsgd.record.run_end import driver_summary as _driver_summary
from hsgd.record.run_end import ensure_summary as _ensure_summary

CFG = OmegaConf.merge(OmegaConf.structured(HsgdConfig), {"sync": {"outer_every": 5}})


def _full() -> dict:
    durable = {"committed_round": 3, "epoch": 2, "supervisor_starts": 1, "started_at": 0.0, "checkpoints_failed": 2}
    return run_summary(
        status="completed",
        reason=None,
        durable=durable,
        steps_per_round=5,
        digests={},
        metrics=[{"round": 2, "eval_loss": 1.5}],
        fired=[],
        events=[],
        not_fired=[],
        committed_steps=0,
        attempted_steps=0,
        participation=[],
        supervisor_started=0.0,
        now=1.0,
        run_dir="/r",
    )


def test_the_fallback_summary_has_every_key_of_the_full_one():
    fallback = fallback_summary(
        status="failed", reason="x", durable={}, metrics=[], steps_per_round=5, now=1.0, run_dir="/r"
    )
    assert set(fallback) == set(_full()), set(fallback) ^ set(_full())
    assert _full()["checkpoints_failed"] == 2


def test_the_driver_summarizes_from_the_durable_state_and_metrics(tmp_path):
    (tmp_path / "supervisor_state.json").write_text(
        json.dumps(
            {
                "committed_round": 4,
                "epoch": 3,
                "supervisor_starts": 2,
                "started_at": 1.0,
                "checkpoints_failed": 1,
                "initial_eval_loss": 4.0,
            }
        )
    )
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 3, "eval_loss": 2.5}) + "\n")
    s = _driver_summary(str(tmp_path), layout_of(CFG), "supervisor lost")
    assert s["status"] == "failed" and s["reason"] == "supervisor lost"
    assert (s["rounds_committed"], s["inner_steps_committed"], s["final_eval_loss"]) == (4, 20, 2.5)
    assert s["checkpoints_failed"] == 1 and s["supervisor_starts"] == 2


def test_the_driver_writes_a_summary_the_supervisor_could_not(tmp_path, capsys):
    s = _driver_summary(str(tmp_path), layout_of(CFG), "the supervisor's run call failed: ValueError: boom")
    _ensure_summary(str(tmp_path), s)
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert capsys.readouterr().out == "", "written, so not printed"


def test_a_summary_the_folder_cannot_hold_is_printed_as_one_json_line(tmp_path, capsys):
    gone = tmp_path / "run"
    gone.write_text("a file where the run folder was")
    s = _driver_summary(str(gone), layout_of(CFG), "run folder unwritable")
    _ensure_summary(str(gone), s)
    lines = capsys.readouterr().out.splitlines()
    assert "summary.json could not be written" in lines[-2] and "NotADirectoryError" in lines[-2]
    assert json.loads(lines[-1]) == s, "the last line is the whole summary as JSON"
