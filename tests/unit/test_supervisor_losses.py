"""The driver counts supervisor deaths, not the errors one death causes (CI saw 4 scheduled
supervisor faults surface as 11 errors on a slow machine and end the run as `max_restarts
exhausted`)."""

import json

from hsgd.core.supervisor_losses import SupervisorLosses
from hsgd.record.run_state import RunState


def supervisor_starts(run_dir: str) -> int:
    """What the driver reads after a supervisor loss: the durable count of its starts."""
    return RunState.read(run_dir).supervisor_starts


def test_one_death_seen_as_several_errors_is_one_loss():
    losses = SupervisorLosses(10, restart_wait_s=60.0)
    verdicts = [losses.on_error(starts=1, now=t) for t in (0.0, 1.0, 2.0)]  # the in-flight call, then 2 re-issues
    assert [v.new_loss for v in verdicts] == [True, False, False]
    assert not any(v.gone for v in verdicts) and losses.count == 1


def test_four_deaths_seen_as_eleven_errors_leave_restarts_to_spare():
    losses = SupervisorLosses(10, restart_wait_s=60.0)
    errors = {1: 3, 2: 1, 3: 4, 4: 3}  # incarnation -> errors its death caused (11 in all, as in CI)
    verdicts = [losses.on_error(starts=k, now=100.0 * k + i) for k, n in errors.items() for i in range(n)]
    assert sum(v.new_loss for v in verdicts) == 4 and losses.count == 4
    assert not any(v.gone for v in verdicts)


def test_more_deaths_than_max_restarts_is_gone_with_the_field_named():
    losses = SupervisorLosses(2, restart_wait_s=60.0)
    assert not losses.on_error(1, 0.0).gone and not losses.on_error(2, 10.0).gone
    verdict = losses.on_error(3, 20.0)
    assert verdict.gone and "supervisor.max_restarts=2" in verdict.reason and "3 times" in verdict.reason


def test_no_new_incarnation_within_the_wait_is_gone():
    losses = SupervisorLosses(10, restart_wait_s=30.0)
    assert losses.on_error(1, 0.0).new_loss
    assert not losses.on_error(1, 29.0).gone  # Ray may still be restarting it
    verdict = losses.on_error(1, 31.0)
    assert verdict.gone and not verdict.new_loss and "supervisor.call_timeout_s" in verdict.reason


def test_a_death_before_the_first_recorded_start_still_counts(tmp_path):
    assert supervisor_starts(str(tmp_path)) == 0  # no state file yet
    losses = SupervisorLosses(10, restart_wait_s=60.0)
    assert losses.on_error(supervisor_starts(str(tmp_path)), 0.0).new_loss


def test_supervisor_starts_reads_the_durable_count(tmp_path):
    (tmp_path / "supervisor_state.json").write_text(json.dumps({"epoch": 3, "supervisor_starts": 4}))
    assert supervisor_starts(str(tmp_path)) == 4
    (tmp_path / "supervisor_state.json").write_text("{half-writ")  # never happens (atomic writes); still no crash
    assert supervisor_starts(str(tmp_path)) == 0
