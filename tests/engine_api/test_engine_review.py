"""Findings of an engine-integration review: what an engine author gets wrong without an error."""

from __future__ import annotations

import math

import pytest

from kvbridge import Backoff, ConfigError, Retry, Timeout


@pytest.mark.parametrize("kw", [{"transfer": -1}, {"connect": -1}, {"connect": 0}, {"transfer": math.nan},
                                {"transfer": math.inf}, {"lease": 0}, {"transfer": "30"}, {"connect": True}])
def test_timeout_refuses_durations_that_are_not_positive_seconds(kw: dict) -> None:
    # Timeout(connect=-1) reached the socket as a raw ValueError, Timeout(transfer=nan) as one from
    # int(nan), Timeout(transfer=-1) was taken (fetches ran with no bound), connect=0 failed every
    # connect with "Operation now in progress": all refused where the policy is built
    with pytest.raises(ConfigError, match=f"Timeout.{next(iter(kw))}"):
        Timeout(**kw)


def test_retry_and_backoff_refuse_values_that_cannot_mean_anything() -> None:
    with pytest.raises(ConfigError, match="attempts"):
        Retry(attempts=0)             # ran the call once anyway
    with pytest.raises(ConfigError, match="attempts"):
        Retry(attempts=-5)
    with pytest.raises(ConfigError, match="deadline"):
        Retry(deadline=-1)
    with pytest.raises(ConfigError, match="Backoff.base"):
        Backoff(base=-1)              # Retry.call raised a raw ValueError from time.sleep on the first retry
    with pytest.raises(ConfigError, match="Backoff.cap"):
        Backoff(cap=-1)               # delay() returned -1
    with pytest.raises(ConfigError, match="retry_on"):
        Retry(retry_on=ValueError)    # type: ignore[arg-type]   # not a tuple: isinstance() failed late


def test_policies_that_make_sense_are_kept() -> None:
    assert Backoff(base=0.0, cap=0.0).delay(5) == 0.0          # "retry at once" stays allowed
    assert Retry(attempts=1, deadline=None).attempts == 1
    assert Timeout(connect=0.5, transfer=2, lease=1).transfer == 2
