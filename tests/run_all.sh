#!/usr/bin/env bash
# The whole test suite, as README "Set-up" command 2 and .ci/run run it, in three parts:
#   1. tests/unit on two pytest-xdist workers (2:53 against 4:03 on one, now that the gloo worlds
#      start their ranks from a fork server: tests/fakes/gloo_world.py);
#   2. the default integration tests, one at a time: real Ray, gloo groups and kills keep both
#      cores busy, and their deadlines (hang detection, phase timeouts) assume nothing else runs;
#   3. the long and the realistic runs on three pytest-xdist workers: the long runs that keep the
#      cores busy one after another on one worker (group `one_at_a_time`, tests/integration/
#      conftest.py), and beside them, two at a time, the realistic and other `paced` runs, whose
#      steps are padded (train.min_step_s) so their processes sleep most of the time.
# Parts 1 and 2 are "the default suite" (under 20 minutes on 2 cores); all three under 60.
set -euo pipefail
cd "$(dirname "$0")/.."
pytest() { python -m pytest -q -p no:cacheprovider "$@"; }
pytest tests/unit -m "not realistic and not long" -n 2 --durations=10
pytest tests/integration tests/gpu -m "not realistic and not long" --durations=30
pytest -n 3 --dist loadgroup -m "long or realistic" --durations=60
