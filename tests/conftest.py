"""Root conftest: settings every test directory shares. Keep it small and generic."""

from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from faults import totals as fault_totals

# Shared CI machines are slow and noisy: no per-example deadlines (each test sets its own
# max_examples and is bounded by pytest-timeout instead).
settings.register_profile("kvbridge", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvbridge")

_FAULTS_KEY = "kvbridge_fault_totals"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A parallel worker hands its lifecycle fault tally to the controller."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out[_FAULTS_KEY] = dict(fault_totals.TOTALS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The controller of a parallel run (pytest-xdist) sums its workers' tallies."""
    got = getattr(node, "workeroutput", {}).get(_FAULTS_KEY)
    for k, v in (got or {}).items():
        fault_totals.TOTALS[k] += v


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if fault_totals.TOTALS["scenarios"]:
        terminalreporter.write_sep("=", "kvbridge lifecycle faults")
        terminalreporter.write_line(fault_totals.summary())
