"""The full fault matrix (issue 3): every kind x every phase it can hit x every target class, one
fault per round, four runs. Slow (several minutes): runs with HSGD_SLOW=1; CI runs the
representative matrix in test_faults.py. Each run must end as the fault-free run does."""
from __future__ import annotations

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import train

SPR = 4
KINDS = ("kill", "crash", "hang", "comm")
PHASES = ("inner", "inner_sync", "outer", "outer_commit", "checkpoint")
TARGETS = {"non_leader": "c0r1", "leader": "leader:c1", "cluster": "cluster:c0", "supervisor": "supervisor"}
BASE = [f"sync.outer_every={SPR}", "supervisor.rejoin=boundary", "checkpoint.every=1", "comm.timeout_s=4", "watchdog.floor_s=5",
        "faults.max_restarts=100"]


def matrix(target: str) -> list[str]:
    kinds = ("kill", "crash") if target == "supervisor" else KINDS
    phases = tuple(p for p in PHASES if not (target == "supervisor" and p == "inner_sync"))
    return [f"kind:{k},target:{target},round:{i},phase:{p},step:1,seconds:300"
            for i, (k, p) in enumerate((k, p) for k in kinds for p in phases)]


@pytest.mark.slow
@pytest.mark.parametrize("target_class", list(TARGETS))
def test_every_kind_in_every_phase(tmp_path, target_class):
    faults = matrix(TARGETS[target_class])
    rounds = len(faults) + 1
    fault_free = train(tmp_path / "fault_free", BASE + [f"train.rounds={rounds}"])
    run_dir = tmp_path / "run"
    s = train(run_dir, BASE + [f"train.rounds={rounds}", "faults.schedule=[" + ",".join("{" + f + "}" for f in faults) + "]"])
    assert s["status"] == "completed", s.get("reason")
    assert s["rounds_committed"] == fault_free["rounds_committed"] == rounds
    assert s["inner_steps_committed"] == fault_free["inner_steps_committed"]
    check_run(run_dir, rounds=rounds, steps_per_round=SPR)  # victims: the replicas the faults hit
    assert len(s["replica_param_digests"]) == 4 and len(set(s["replica_param_digests"].values())) == 1
    # A fault in every round changes the trajectory (a whole cluster restarting from the global
    # params 20 times); it must not make the model worse than 5 % of the fault-free one.
    assert s["final_eval_loss"] < 1.05 * fault_free["final_eval_loss"], \
        (s["final_eval_loss"], fault_free["final_eval_loss"])
    print(f"MATRIX {target_class}: {len(faults)} scheduled, {len(s['faults'])} fired, wall {s['wall_s']:.1f}s, "
          f"eval {s['final_eval_loss']:.4f} vs fault-free {fault_free['final_eval_loss']:.4f}, "
          f"step_eff {s['step_efficiency']:.3f}")
