"""Numerical parity of the real system (Ray actors, gloo process groups, supervisor) with pure-torch
references of the same algorithms (tests/fakes/references.py).

Each test runs one tiny training job through `jobs.train.run_training` (the two localsgd tests share
their fault-free one), loads the final checkpoint of every replica, and compares its parameters with
the reference's. Every run also checks invariant 1 of ARCHITECTURE.md: after every committed outer
sync all replicas hold bitwise-identical parameters (the "replica_digests" of every metrics.jsonl
record agree).

Why a wrong-level collective fails these tests is spelled out in each test's docstring; the
guard itself (a collective naming the other level raises WrongLevelError) is in tests/unit/test_comm.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hsgd.core.topology import Topology
from hsgd.train.checkpoint import load_replica_state
from tests.fakes import references as ref
from tests.integration.invariants import check_run

REPO = Path(__file__).resolve().parents[2]

TOL = 1e-6
TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=4",
    "logging.wandb.mode=disabled",
    "logging.progress=false",
    "train.eval_every=1000",
    "train.eval_batches=1",
    "optim.inner.schedule=constant",
    "optim.inner.warmup_steps=0",
]  # the references step at a constant rate
# Inner optimizer of the DDP test: SGD with momentum is linear in the gradient, so the ulp-level
# differences between hsgd's all-reduce (sum, then divide) and torch DDP's (divide, then sum in
# buckets) stay ~1e-7 after 30 steps. AdamW (the default) reached 8.6e-7 there: too close to 1e-6.
SGD = ["optim.inner.name=sgd", "optim.inner.lr=0.05", "optim.inner.momentum=0.9"]
# The other tests compare against references that reduce in the same order: default AdamW is safe.
ADAMW = ["optim.inner.name=adamw"]


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module's runs (run_training keeps a Ray it did not start): ~15 s saved per run."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(
        address="local",
        num_cpus=6,
        namespace="hsgd",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        },
    )
    try:
        yield
    finally:
        ray.shutdown()


# 2 clusters x 2 replicas, inner `localsgd` every 2 steps, outer `average` every 6 steps, 2 rounds
LOCALSGD_2X2 = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=2",
    "sync.inner=localsgd",
    "sync.inner_every=2",
    "sync.outer=average",
    "sync.outer_every=6",
    "train.rounds=2",
    *ADAMW,
]


@pytest.fixture(scope="module")
def localsgd_run(ray_session, tmp_path_factory):
    """run_hsgd of LOCALSGD_2X2, fault-free: compared with the references, and the clean twin of the
    comm-fault run (same seed and config: one run serves both tests)."""
    return run_hsgd(tmp_path_factory.mktemp("localsgd") / "run", LOCALSGD_2X2)


def run_hsgd(run_dir: Path, overrides: list[str]):
    """Run the real job; returns (cfg, summary, final per-replica states, metrics records)."""
    from actors.launch import compose_config, run_training

    cfg = compose_config(TINY + overrides + [f"checkpoint.every={_value(overrides, 'train.rounds')}"])
    summary = run_training(cfg, str(run_dir))
    assert summary["status"] == "completed", summary
    assert summary["rounds_committed"] == cfg.train.rounds
    assert summary["inner_steps_committed"] == cfg.train.rounds * cfg.sync.outer_every
    ckpt = run_dir / "checkpoints" / f"round_{cfg.train.rounds:06d}"
    topo = Topology(cfg.topology.clusters, cfg.topology.replicas_per_cluster)
    states = {rid: load_replica_state(ckpt, rid) for rid in topo.replica_ids()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["round"] for m in metrics] == list(range(cfg.train.rounds))
    return cfg, summary, states, metrics


def _value(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def assert_digests_agree(metrics: list[dict], n_replicas: int) -> None:
    """Invariant 1: after every committed outer sync every replica holds bitwise-identical params."""
    for m in metrics:
        assert len(m["replica_digests"]) == n_replicas, m["replica_digests"]
        assert len(set(m["replica_digests"].values())) == 1, f"round {m['round']}: {m['replica_digests']}"
        assert len(set(m["global_digests"].values())) == 1, f"round {m['round']}: {m['global_digests']}"


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b, strict=True))
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def report(name: str, **diffs: float) -> None:
    print(f"[numerics] {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in diffs.items()))


# ----------------------------------------------------------------------------------------------------


def test_ddp_inner_matches_torch_distributed_ddp(ray_session, tmp_path):
    """1 cluster x 3 replicas, inner `ddp`, 3 rounds of 10 steps == torch DDP over 3 gloo processes.

    Wrong level: with one cluster the outer group has a single member, so a gradient all-reduce
    issued on it would average nothing: each replica would train on its own gradients and differ
    from DDP by ~0.15 (measured by running this test against a copy of hsgd with that mutation; the
    digests still agree there, because the commit broadcasts the leader's params to the others).

    One cluster makes the outer sync `average` a near no-op: new global = global - (global - params),
    which equals params up to one rounding of the subtraction (<= 1 ulp of the global params), so the
    comparison needs the tolerance, not bitwise equality. Torch DDP also divides gradients by the
    world size before its all-reduce where hsgd divides after, another ulp-level difference.
    """
    cfg, _, states, metrics = run_hsgd(
        tmp_path / "run",
        [
            "topology.clusters=1",
            "topology.replicas_per_cluster=3",
            "sync.inner=ddp",
            "sync.outer=average",
            "sync.outer_every=10",
            "train.rounds=3",
            *SGD,
        ],
    )
    assert_digests_agree(metrics, 3)
    assert all(m["outer_bytes"] == 0 for m in metrics), "one cluster: nothing may cross the outer level"
    assert all(m["inner_bytes"] > 0 for m in metrics), "ddp: gradients must cross the inner level"

    work = tmp_path / "ddp"
    work.mkdir()
    expected = ref.torch_ddp_reference(
        cfg, world=3, total_steps=cfg.train.rounds * cfg.sync.outer_every, workdir=str(work)
    )
    diffs = {rid: max_abs_diff(s["params"], expected) for rid, s in states.items()}
    global_diff = max_abs_diff(states["c0r0"]["outer"]["global_params"], expected)
    report("ddp_1x3", **diffs, global_vs_ddp=global_diff)
    assert max(diffs.values()) < TOL, diffs
    assert global_diff < TOL
    # after the commit every replica copied the global params: bitwise equal to them
    assert max_abs_diff(states["c0r0"]["params"], states["c0r0"]["outer"]["global_params"]) == 0.0
    # and the replicas did train: far from the initial params
    initial = ref.snapshot(ref.fresh_model(cfg, ref.corpus_for(cfg).vocab_size).parameters())
    assert max_abs_diff(expected, initial) > 1e-2


def test_localsgd_average_matches_reference_schedule(localsgd_run, tmp_path):
    """2 clusters x 2 replicas, inner `localsgd` every 2 steps, outer `average` every 6 steps, 2 rounds
    == a single-process simulation of the same schedule, and == PyTorch's HierarchicalModelAverager
    (periods {2: groups of 2, 6: all 4}) in 4 gloo processes.

    Wrong level: the inner averaging issued on the outer group would average the two clusters'
    leaders with each other and leave the non-leaders alone (measured with that mutation: 0.06 off);
    an outer averaging that does not reach the other cluster leaves the clusters' params different
    after the commit, so the digests disagree.
    """
    cfg, _, states, metrics = localsgd_run
    assert_digests_agree(metrics, 4)
    assert all(m["outer_bytes"] > 0 for m in metrics)
    total = cfg.train.rounds * cfg.sync.outer_every
    rids = Topology(2, 2).replica_ids()  # global-index order

    expected = ref.localsgd_average_reference(cfg, total)
    diffs = {rid: max_abs_diff(states[rid]["params"], expected[g]) for g, rid in enumerate(rids)}
    global_diff = max_abs_diff(states["c0r0"]["outer"]["global_params"], expected[0])

    work = tmp_path / "hma"
    work.mkdir()
    hma = ref.hierarchical_model_averager_reference(cfg, total, str(work))
    hma_diffs = {rid: max_abs_diff(states[rid]["params"], hma[g]) for g, rid in enumerate(rids)}
    report(
        "localsgd_average_2x2",
        **diffs,
        global_vs_ref=global_diff,
        **{f"{rid}_vs_hma": d for rid, d in hma_diffs.items()},
    )
    assert max(diffs.values()) < TOL, diffs
    assert global_diff < TOL
    assert max(hma_diffs.values()) < TOL, hma_diffs


def test_diloco_matches_reference_algorithm1(ray_session, tmp_path):
    """2 clusters x 2 replicas, inner `ddp`, outer `diloco` (Nesterov SGD lr 0.7 momentum 0.9) every 5
    steps, 3 rounds == a single-process DiLoCo Algorithm 1 with one model per cluster trained on the
    mean of its replicas' gradients.

    Wrong level: the gradient all-reduce issued on the outer group would mix the two leaders'
    gradients across clusters and leave the non-leaders unsynchronised; the pseudo-gradient
    all-reduce issued on the inner group would average a leader's pseudo-gradient with its own
    cluster's (identical) one instead of the other cluster's, so each cluster would step its global
    params on its own delta. Measured with these mutations: 0.10 off, and disagreeing digests.
    """
    outer = ["optim.outer.lr=0.7", "optim.outer.momentum=0.9", "optim.outer.nesterov=true"]
    cfg, _, states, metrics = run_hsgd(
        tmp_path / "run",
        [
            "topology.clusters=2",
            "topology.replicas_per_cluster=2",
            "sync.inner=ddp",
            "sync.outer=diloco",
            "sync.outer_every=5",
            "train.rounds=3",
            *ADAMW,
            *outer,
        ],
    )
    assert_digests_agree(metrics, 4)

    expected_global, expected_clusters, expected_momentum = ref.diloco_reference(cfg, cfg.train.rounds)
    diffs = {
        rid: max_abs_diff(s["params"], expected_clusters[Topology(2, 2).cluster_of(rid)]) for rid, s in states.items()
    }
    global_diffs = {
        f"{rid}_global": max_abs_diff(s["outer"]["global_params"], expected_global) for rid, s in states.items()
    }
    momentum = [states["c0r0"]["outer"]["sgd"]["state"][k]["momentum_buffer"] for k in range(len(expected_momentum))]
    momentum_diff = max_abs_diff(momentum, expected_momentum)
    report("diloco_2x2", **diffs, **global_diffs, outer_momentum=momentum_diff)
    assert max(diffs.values()) < TOL, diffs
    assert max(global_diffs.values()) < TOL, global_diffs
    assert momentum_diff < TOL


def test_a_comm_fault_at_a_localsgd_average_leaves_the_digest_of_the_fault_free_run(localsgd_run, tmp_path):
    """Issue 19, Build 6: the parameter average of `localsgd` runs after the step's optimizer update.
    When it fails (a `comm` fault aborts c0r1's group right before the average of step 1, so both
    members of c0 see a failed collective), the step is not counted and is redone after c0 re-forms:
    it must be redone from the state before it, never applied on top of itself. Same seed, same
    schedule as a fault-free run → bitwise the same final params on every replica."""
    _, _, clean, _ = localsgd_run
    fault = "faults.schedule=[{kind:comm,target:c0r1,round:0,phase:inner_sync,step:1}]"
    _, summary, faulted, metrics = run_hsgd(tmp_path / "faulted", LOCALSGD_2X2 + [fault])
    assert_digests_agree(metrics, 4)
    fired = [
        json.loads(line)
        for line in (tmp_path / "faulted" / "faults_fired.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [(f["kind"], f["rid"]) for f in fired] == [("comm", "c0r1")], "the comm fault must have fired, once"
    events = [json.loads(line) for line in (tmp_path / "faulted" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "cluster_reform" and e.get("cluster") == 0 for e in events), (
        "c0 must have re-formed after its failed average"
    )
    diffs = {rid: max_abs_diff(faulted[rid]["params"], clean[rid]["params"]) for rid in clean}
    report("localsgd_comm_fault_vs_clean", **diffs)
    assert all(d == 0.0 for d in diffs.values()), f"a retried localsgd step differs from the fault-free run: {diffs}"
    check_run(tmp_path / "faulted", rounds=2, steps_per_round=6)
