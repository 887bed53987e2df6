"""The lifecycle fault suite's tally, one per process (each parallel worker has its own: the
root conftest sums them on the controller and prints the line)."""

TOTALS = {"tests": 0, "scenarios": 0, "leaked": 0, "stale": 0, "unsafe_frees": 0, "hangs": 0}


def summary() -> str:
    t = TOTALS
    return (f"kvbridge lifecycle faults: leaked={t['leaked']} stale={t['stale']} "
            f"unsafe_frees={t['unsafe_frees']} hangs={t['hangs']} over {t['scenarios']} scenarios "
            f"({t['tests']} tests; a claim race counts as one scenario)")
