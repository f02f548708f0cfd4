"""The outer reduce behind the inner steps (sync.fragment_delay) on real gloo groups, 2 clusters x 2
replicas, one process per replica: the reduce really runs while inner steps do (a slow simulated
outer link keeps it in flight past the round's last step, with per-level collective guards), what
is committed is the mean of the clusters' params at the snapshot step, a fragment not synced this
round keeps its local progress, and cluster members stay bitwise equal. Plus the guards alone:
per level with overlap, per process without. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from tests.fakes.configs import tiny_cfg as _cfg
from tests.fakes.gloo_world import run_ranks

SIZES = (2, 2)
H, DELAY = 4, 2  # steps per round (outer_every / fragments), inner steps behind the reduce


def _host(tensors):
    """By value across the process boundary (numpy): torch's queue sharing runs out of descriptors."""
    return [t.detach().numpy().copy() for t in tensors]


def _overlap_worker(overrides, rounds, rank, port, results) -> None:
    out = {"rank": rank}
    try:
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup, allow_level_overlap
        from hsgd.train.overlap import BackgroundReduce
        from hsgd.train.simulate import LinkModel
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        allow_level_overlap(True)
        c, i = divmod(rank, 2)
        topo = Topology(2, 2)
        rid = topo.cluster_members(c)[i]
        addr = f"127.0.0.1:{port}"
        inner = LevelGroup("inner", "gloo", timeout_s=30, configure_timeout_s=60)
        inner.configure(addr, f"t/inner/c{c}", rank=i, world_size=2, epoch=1)
        leader = i == 0
        outer = None
        if leader:  # a slow outer link: the reduce lasts at least 1.5 s, far longer than DELAY tiny steps
            outer = LevelGroup("outer", "gloo", timeout_s=30, configure_timeout_s=60, link=LinkModel(10.0, 1500.0))
            outer.configure(addr, "t/outer", rank=c, world_size=2, epoch=1)
        trainer = ReplicaTrainer(_cfg(overrides), rid, topo)
        background = BackgroundReduce(trainer, outer) if leader else None
        out["rounds"] = []
        for r in range(rounds):
            seen: dict = {}

            def at_snapshot(r=r, seen=seen):
                seen["step"] = trainer.step
                seen["params"] = _host(trainer.params)
                if background is not None:
                    background.start((r, 1, 0, 1))

            trainer.run_inner(r, inner, at_snapshot=at_snapshot)
            end_params = _host(trainer.params)
            in_flight = background is not None and not background._reduce.done.is_set()
            spent = None
            if background is not None:
                spent = background.settle((r, 1, 0, 1), timeout_s=60)
                trainer.outer_reduce(r, 1, outer, 0, 1)  # the buffer is there: returns at once
            trainer.outer_commit(r, inner, (0,))
            out["rounds"].append(
                {
                    "snapshot_step": seen["step"],
                    "snapshot": seen["params"],
                    "end": end_params,
                    "in_flight_at_end": in_flight,
                    "spent": spent,
                    "fragment": trainer.fragment_params(r),
                    "global": _host(trainer.outer_opt.global_params),
                    "params": _host(trainer.params),
                    "digest": trainer.param_digest(),
                }
            )
    except BaseException:  # noqa: BLE001 — reported to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


def _run(overrides, rounds):
    return run_ranks(functools.partial(_overlap_worker, overrides, rounds), 4, timeout_s=240)


def test_the_reduce_runs_behind_the_last_inner_steps_and_commits_the_snapshot_mean():
    outs = _run(["sync.outer=average", f"sync.outer_every={H}", f"sync.fragment_delay={DELAY}"], rounds=3)
    for r in range(3):
        leaders = [outs[0]["rounds"][r], outs[2]["rounds"][r]]
        for o in leaders:
            # the reduce was still in flight on the outer level when the round's last inner step was done
            assert o["in_flight_at_end"], f"round {r}: the outer reduce did not overlap the inner steps"
            assert o["spent"]["outer_bytes"] > 0 and o["spent"]["outer_link_s"] >= 1.5
            assert o["snapshot_step"] == r * H + H - DELAY
        expected = [
            torch.from_numpy((a + b) / 2) for a, b in zip(leaders[0]["snapshot"], leaders[1]["snapshot"], strict=True)
        ]
        for rank in range(4):
            o = outs[rank]["rounds"][r]
            for g, e, p in zip(o["global"], expected, o["params"], strict=True):
                torch.testing.assert_close(torch.from_numpy(g), e, rtol=0, atol=1e-6)  # the mean at the snapshot step
                assert (p == g).all()  # alpha 0: params are the global params after the commit
            assert o["snapshot_step"] == r * H + H - DELAY
        # the DELAY steps after the snapshot changed the params, and the commit dropped that change
        assert any((a != b).any() for a, b in zip(leaders[0]["snapshot"], leaders[0]["end"], strict=True))
        for c in (0, 1):  # cluster members bitwise equal
            assert outs[2 * c]["rounds"][r]["digest"] == outs[2 * c + 1]["rounds"][r]["digest"]


def test_with_fragments_the_unsynced_fragment_keeps_its_local_progress_past_the_snapshot():
    outs = _run(
        ["sync.outer=diloco", f"sync.outer_every={2 * H}", "sync.fragments=2", f"sync.fragment_delay={DELAY}"], rounds=2
    )
    for r in range(2):
        o = outs[0]["rounds"][r]
        synced = set(o["fragment"])
        assert synced and len(synced) < len(o["params"])
        for k, (p, end, g) in enumerate(zip(o["params"], o["end"], o["global"], strict=True)):
            if k in synced:
                assert (p == g).all()  # merged: alpha 0 takes the new global fragment
            else:
                assert (p == end).all()  # untouched by this round's commit, local steps kept
        for c in (0, 1):
            assert outs[2 * c]["rounds"][r]["digest"] == outs[2 * c + 1]["rounds"][r]["digest"]


def _late_cluster_worker(arrival_s, rank, port, results) -> None:
    """2 clusters x 1 replica, outer timeout 2 s: cluster 1 reaches its snapshot step 4 s after
    cluster 0 (a slower cluster); cluster 0's reduce has started already and must wait for it."""
    out = {"rank": rank}
    try:
        import time

        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup, allow_level_overlap
        from hsgd.train.overlap import BackgroundReduce
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        allow_level_overlap(True)
        topo = Topology(2, 1)
        rid = topo.cluster_members(rank)[0]
        inner = LevelGroup("inner", "gloo")
        outer = LevelGroup("outer", "gloo", timeout_s=2, configure_timeout_s=60)
        outer.configure(f"127.0.0.1:{port}", "t/outer", rank=rank, world_size=2, epoch=1)
        trainer = ReplicaTrainer(
            _cfg(["sync.outer=average", f"sync.outer_every={H}", f"sync.fragment_delay={DELAY}"]), rid, topo
        )
        background = BackgroundReduce(trainer, outer, arrival_s=arrival_s)

        def at_snapshot():
            if rank == 1:
                time.sleep(4.0)
            background.start((0, 1, 0, 1))

        trainer.run_inner(0, inner, at_snapshot=at_snapshot)
        try:
            background.settle((0, 1, 0, 1), timeout_s=60)
            out["reduced"] = True
        except Exception as err:  # noqa: BLE001 — reported: the test reads the kind
            out["reduced"], out["kind"] = False, getattr(err, "kind", type(err).__name__)
    except BaseException:  # noqa: BLE001 — reported to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.mark.parametrize("arrival_s,reduced", [(30.0, True), (0.0, False)])
def test_a_reduce_behind_the_steps_waits_for_a_cluster_that_reaches_its_snapshot_late(arrival_s, reduced):
    outs = run_ranks(functools.partial(_late_cluster_worker, arrival_s), 2, timeout_s=120)
    assert [outs[r]["reduced"] for r in (0, 1)] == [reduced, reduced], outs
    if not reduced:  # the 2-s collective deadline alone: the early holder gives up (the supervisor then retries)
        assert outs[0]["kind"] == "timeout", outs


def test_collective_guards_are_per_level_with_overlap_and_per_process_without():
    from hsgd.train import comm

    try:
        comm.allow_level_overlap(True)
        with comm.one_collective("outer reduce", "outer"):
            with comm.one_collective("inner step", "inner"):  # another level: allowed
                pass
            with (
                pytest.raises(comm.OverlappingCollectiveError, match="on the outer level"),
                comm.one_collective("second outer", "outer"),  # one group's collectives never interleave
            ):
                pass
        comm.allow_level_overlap(False)
        with (
            comm.one_collective("outer reduce", "outer"),
            pytest.raises(comm.OverlappingCollectiveError, match="in this process"),
            comm.one_collective("inner step", "inner"),
        ):
            pass
    finally:
        comm.allow_level_overlap(False)
