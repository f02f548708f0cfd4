"""The fault-free path end to end: jobs.train on real Ray actors and gloo groups."""

from __future__ import annotations

import json

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, summary, train, train_cli


@pytest.mark.parametrize(
    "inner,outer,extra",
    [
        ("ddp", "diloco", []),
        ("localsgd", "average", ["sync.inner_every=2"]),
        ("none", "diloco", []),
    ],
)
def test_digests_agree_after_every_outer_sync(tmp_path, inner, outer, extra):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        [
            f"sync.inner={inner}",
            f"sync.outer={outer}",
            "sync.outer_every=4",
            "train.rounds=3",
            "checkpoint.every=0",
            *extra,
        ],
    )
    assert s["status"] == "completed"
    assert s["rounds_committed"] == 3 and s["inner_steps_committed"] == 12
    assert len(metrics(run_dir)) == 3
    check_run(run_dir, rounds=3, steps_per_round=4, victims=set())
    assert len(set(s["replica_param_digests"].values())) == 1, s["replica_param_digests"]
    assert set(s["replica_param_digests"]) == {"c0r0", "c0r1", "c1r0", "c1r1"}


def test_outputs_are_written_and_complete(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, ["sync.outer_every=4", "train.rounds=2", "checkpoint.every=1"])
    for name in ("config.yaml", "events.jsonl", "metrics.jsonl", "summary.json", "loss.png"):
        assert (run_dir / name).is_file(), f"{name} missing from run.dir"
    for key in (
        "status",
        "rounds_committed",
        "inner_steps_committed",
        "initial_eval_loss",
        "final_eval_loss",
        "wall_s",
        "replica_param_digests",
        "global_param_digest",
    ):
        assert key in s, f"summary.json lacks {key}"
    m = metrics(run_dir)[-1]
    for key in (
        "round",
        "inner_step",
        "loss",
        "eval_loss",
        "tokens_per_s",
        "inner_bytes",
        "outer_bytes",
        "live_replicas",
        "epoch",
        "phase_s",
    ):
        assert key in m, f"metrics.jsonl lacks {key}"
    assert m["outer_bytes"] > 0 and m["inner_bytes"] > 0
    kinds = {e["event"] for e in events(run_dir)}
    assert {"phase_begin", "phase_end", "membership", "commit", "checkpoint"} <= kinds, kinds
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["round_000001", "round_000002"], ckpts  # keep=2, no temp dirs left
    # summary floats are full precision: json round-trips them exactly
    raw = json.loads((run_dir / "summary.json").read_text())
    assert raw["final_eval_loss"] == s["final_eval_loss"]


@pytest.mark.long
def test_resume_continues_to_the_uninterrupted_digest(tmp_path):
    # a constant rate: a cosine decay's horizon is the run's train.rounds, so a resume that extends the run
    # moves it (as it should); what is checked here is that the state resumes bitwise
    rate = ["sync.outer_every=3", "checkpoint.every=2", "optim.inner.schedule=constant"]
    whole = train(tmp_path / "whole", rate + ["train.rounds=4"])
    part = tmp_path / "part"
    first = train(part, rate + ["train.rounds=2"])
    assert first["rounds_committed"] == 2
    resumed = train(part, rate + ["train.rounds=4", "train.resume=true"])
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 4
    assert resumed["global_param_digest"] == whole["global_param_digest"], (
        "resume after round 2 must end bitwise where the uninterrupted run ends"
    )
    assert [m["round"] for m in metrics(part)] == [0, 1, 2, 3]


BAD_CONFIGS = [
    (["sync.inner=bogus"], "sync.inner"),
    (["sync.outer=fedavg"], "sync.outer"),
    (["sync.outer_every=0"], "sync.outer_every"),
    (["sync.inner_every=-3"], "sync.inner_every"),
    (["sync.inner=localsgd", "sync.inner_every=3", "sync.outer_every=10"], "sync.outer_every"),
    (["optim.inner.name=lamb"], "optim.inner.name"),
    (["data.path=/does/not/exist"], "data.path"),
    (["topology.clusters=two"], "topology.clusters"),
    (["comm.backend=mpi"], "comm.backend"),
    (["logging.wandb.mode=loud"], "logging.wandb.mode"),
    (["faults.schedule=[{kind:zap,target:c0r1,round:1}]"], "faults.schedule[0].kind"),
    (["faults.schedule=[{kind:kill,target:c9r0,round:1}]"], "faults.schedule[0].target"),
    (["ray.num_cpus=2", "topology.clusters=4"], "topology.replicas_per_cluster"),
]


@pytest.mark.parametrize("overrides,field", BAD_CONFIGS, ids=[b[1] + "-" + b[0][0] for b in BAD_CONFIGS])
def test_bad_config_is_one_clear_line_and_exit_2(tmp_path, overrides, field):
    run_dir = tmp_path / "run"
    proc = train_cli([f"run.dir={run_dir}", "logging.wandb.mode=disabled", *overrides], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, f"exit code {proc.returncode}; stderr: {proc.stderr[-2000:]}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hsgd: config error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert f"config error: {field}" in errors[0], errors[0]
    # no actor started, nothing written into the run dir
    assert not (run_dir / "events.jsonl").exists() and not (run_dir / "config.yaml").exists()
    assert "Replica pid=" not in proc.stdout + proc.stderr


@pytest.mark.long
def test_default_job_trains_the_model(tmp_path):
    """`python -m jobs.train` with no arguments: 2x2, ddp + diloco, eval loss clearly drops."""
    proc = train_cli([], cwd=tmp_path, env={"WANDB_MODE": "offline"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1
    s = summary(runs[0])
    assert s["status"] == "completed"
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 1.0, (s["initial_eval_loss"], s["final_eval_loss"])
    assert len(set(s["replica_param_digests"].values())) == 1
    wandb_dirs = list((runs[0] / "wandb").glob("offline-run-*"))
    assert len(wandb_dirs) == 1, "one offline wandb run directory per job"
    # its run-*.wandb log (LevelDB-style: 7-byte header, 32 KiB blocks of crc/len/type chunks)
    # holds the resolved config, the group and one history row per committed round
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, pos, records, part = next(wandb_dirs[0].glob("run-*.wandb")).read_bytes(), 7, [], b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        part = (part if kind in (3, 4) else b"") + raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(part))
    run = next(r.run for r in records if r.HasField("run"))
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert run.run_group == "hsgd" and config["sync"]["outer_every"] == 20 and config["train"]["rounds"] == 15
    history = [
        {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    rounds = [h for h in history if "eval_loss" in h]
    assert [(h["round"], h["loss"], h["eval_loss"]) for h in rounds] == [
        (m["round"], m["loss"], m["eval_loss"]) for m in metrics(runs[0])
    ]
    assert (runs[0] / "loss.png").stat().st_size > 10_000
