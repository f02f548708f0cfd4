#!/usr/bin/env bash
# The whole test suite, as README "Set-up" command 2 and .ci/run run it, in four parts:
#   1. tests/unit on two workers (pytest-xdist, a file per worker so a module's fixture is built
#      once): pure hsgd, mostly one busy process per test, nothing shared between files;
#   2. the default integration tests one at a time: real Ray, gloo groups and kills keep both
#      cores busy, and their deadlines (hang detection, phase timeouts) assume nothing else runs;
#   3. the long end-to-end runs one at a time, for the same reason;
#   4. the realistic tests two at a time: their 30-s rounds are padded steps (train.min_step_s)
#      that leave the cores mostly idle, so two runs side by side halve the wall time without
#      stretching a step.
# Parts 1 and 2 are "the default suite" (under 20 minutes on 2 cores); all four under 45.
set -euo pipefail
cd "$(dirname "$0")/.."
pytest() { python -m pytest -q -p no:cacheprovider "$@"; }
pytest -n 2 --dist loadfile tests/unit -m "not realistic and not long" --durations=10
pytest tests/integration tests/gpu -m "not realistic and not long" --durations=15
pytest -m "long and not realistic and not paced" --durations=15
pytest -n 2 --dist loadgroup -m "realistic or paced" --durations=15
