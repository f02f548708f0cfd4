"""Issue 20, acceptance 1 and 3: a user's model, data and loss from a module outside hsgd/
(examples/regression.py: an MLP forecasting a synthetic signal, not a GPT) train through the
plug-in config, through a kill and a heal, with every replica bitwise equal after every commit;
bf16 on the CPU trains the built-in GPT with the same guarantees. Both write the final global
model as model.safetensors."""

from __future__ import annotations

import shutil

import pytest
from safetensors import safe_open

from tests.integration.invariants import check_run
from tests.integration.runs import REPO, events, metrics, summary, train, train_cli

ROUNDS, SPR = 4, 6
EXAMPLE = [
    "model._target_=examples.regression.build_mlp",
    "data._target_=examples.regression.build_dataset",
    "loss._target_=examples.regression.mse_loss",
    "+model.args.hidden=32",
    "+data.args.noise=0.02",
    "model.block_size=16",
    "data.batch_size=16",
    "optim.inner.lr=0.001",
    # the rates these tests' thresholds were set with (24 steps: a constant inner rate, DiLoCo's outer step)
    "optim.inner.schedule=constant",
    "optim.inner.warmup_steps=0",
    "optim.outer.lr=0.7",
    "optim.outer.momentum=0.9",
]
BASE = [
    f"sync.outer_every={SPR}",
    f"train.rounds={ROUNDS}",
    "checkpoint.every=0",
    "comm.timeout_s=4",
    "supervisor.rejoin=boundary",
    "supervisor.rejoin_wait_s=30",
    "train.eval_batches=4",
]


def _saved_model(run_dir) -> dict:
    with safe_open(run_dir / "model.safetensors", "pt") as f:
        return {"names": sorted(f.keys()), **f.metadata()}


def test_a_user_model_from_outside_hsgd_trains_through_a_kill_and_a_heal(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, EXAMPLE + BASE + ["faults.schedule=[{kind:kill,target:c0r1,round:1,phase:inner,step:2}]"])
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)  # digests agree after every commit, and the rest
    assert s["status"] == "completed" and len(s["faults"]) == 1
    heals = [e for e in events(run_dir) if e["event"] == "heal_end"]
    assert any(h["target"] == "c0r1" for h in heals), f"the killed replica was never healed: {heals}"
    assert s["final_eval_loss"] < s["initial_eval_loss"] * 0.5, (s["initial_eval_loss"], s["final_eval_loss"])
    saved = _saved_model(run_dir)
    assert saved["names"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight", "net.4.bias", "net.4.weight"]
    assert saved["model_target"] == "examples.regression.build_mlp" and saved["round"] == str(ROUNDS)
    assert saved["global_digest"] == s["global_param_digest"], "model.safetensors is not the committed global model"


def test_bf16_on_the_cpu_trains_and_every_replica_agrees_after_every_commit(tmp_path):
    run_dir = tmp_path / "run"
    s = train(run_dir, BASE + ["train.precision=bf16", "optim.inner.lr=0.01"])
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)
    losses = [m["loss"] for m in metrics(run_dir)]
    assert losses[-1] < losses[0] and s["final_eval_loss"] < s["initial_eval_loss"], (losses, s)
    assert "transformer.wte.weight" in _saved_model(run_dir)["names"]


@pytest.mark.long  # a whole `python -m jobs.train` from another directory
def test_a_module_in_the_launch_directory_is_importable_on_every_replica(tmp_path):
    """`python -m jobs.train` from a user's folder, the module beside them: the embedded cluster's
    replicas import it (none of it is in hsgd/ or on the PYTHONPATH)."""
    shutil.copy(REPO / "examples" / "regression.py", tmp_path / "my_forecast.py")
    run_dir = tmp_path / "run"
    overrides = [o.replace("examples.regression", "my_forecast") for o in EXAMPLE]
    proc = train_cli(
        overrides
        + [
            "topology.clusters=1",
            "sync.outer_every=3",
            "train.rounds=2",
            "checkpoint.every=0",
            "logging.wandb.mode=disabled",
            "logging.progress=false",
            f"run.dir={run_dir}",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed"
    assert _saved_model(run_dir)["model_target"] == "my_forecast.build_mlp"
