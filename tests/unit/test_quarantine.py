"""The quarantine rule (issue 32): a replica that died `after` times within the window is set aside."""

from hsgd.core.quarantine import quarantine_due, recent_deaths


def test_three_deaths_within_the_window_quarantine_and_older_ones_do_not_count():
    assert not quarantine_due([100.0, 200.0], 250.0, after=3, window_s=600)
    assert quarantine_due([100.0, 200.0, 250.0], 250.0, after=3, window_s=600)
    assert not quarantine_due([0.0, 200.0, 650.0], 650.0, after=3, window_s=600), "the first death left the window"
    assert recent_deaths([650.0, 0.0, 200.0], 650.0, 600) == [200.0, 650.0]


def test_zero_turns_it_off():
    assert not quarantine_due([1.0] * 50, 2.0, after=0, window_s=600)
