"""The one deadline a test may put on elapsed time: long enough to catch only a hang (issue 49).

A test asserts behaviour, never how fast it went (timings belong in benchmarks/); where a wait
must end, it ends within HANG_S, at least 10x the longest wait a test in this suite expects
(a drill's recovery on 2 busy cores: up to ~30 s). tests/unit/test_house_rules_tests.py flags any
other upper bound on an elapsed time."""

HANG_S = 300.0
