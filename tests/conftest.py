"""Root conftest: settings every test directory shares. Keep it small and generic."""

from hypothesis import HealthCheck, settings

# Shared CI machines are slow and noisy: no per-example deadlines (each test sets its own
# max_examples and is bounded by pytest-timeout instead).
settings.register_profile("kvbridge", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvbridge")
