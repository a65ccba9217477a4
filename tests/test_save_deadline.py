"""A save slower than the grace a preempted job gets is warned about once, with both numbers and the fixes."""

import pytest

from lightning_hpz.lifecycle.save_deadline import GRACE_ENV_VAR, SaveDeadline, grace_seconds


def test_the_first_save_over_the_grace_warns_once():
    deadline = SaveDeadline(grace=30)
    assert not deadline.observe(12.0)
    with pytest.warns(UserWarning, match=r"took 48 s, longer than the 30 s a preempted job gets.*--signal=USR1@"):
        assert deadline.observe(48.0)
    assert not deadline.observe(90.0)  # once is enough


def test_the_grace_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(GRACE_ENV_VAR, raising=False)
    assert grace_seconds() == 30.0
    monkeypatch.setenv(GRACE_ENV_VAR, "120")
    assert grace_seconds() == 120.0
    monkeypatch.setenv(GRACE_ENV_VAR, "two minutes")
    with pytest.raises(ValueError, match="is not a number of seconds"):
        grace_seconds()
