"""Fixtures for the adapter tests. The adapters are installed modules (``kvbridge_hf``,
``kvbridge_vllm``, ``kvbridge_sglang``); a checkout whose editable install predates them
imports them from ``adapters/`` instead (``test_packaging`` checks the wheel ships them)."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import kvbridge_hf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "adapters"))


@pytest.fixture(scope="session")
def hf_model() -> Any:
    from _hf_prefill_child import build_hf_model
    return build_hf_model()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The tiny model gains nothing from threads; torch's spinning workers slow a loaded box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_engine_stubs")


@pytest.fixture(scope="module")
def engine_stubs() -> Iterator[None]:
    """Where vLLM or SGLang is not installed, their base classes from ``_engine_stubs`` (only
    those: the adapters' code and kvbridge are the real ones). Undone after the module, so the
    engine tests' ``find_spec`` skips and imports see the machine as it is."""
    import importlib.util
    missing = [e for e in ("vllm", "sglang") if importlib.util.find_spec(e) is None]
    if not missing:
        yield
        return
    sys.path.insert(0, STUBS)
    try:
        yield
    finally:
        sys.path.remove(STUBS)
        for name in list(sys.modules):
            top = name.split(".")[0]
            if top in missing or (top in ("kvbridge_vllm", "kvbridge_sglang")
                                  and getattr(sys.modules[name], "__file__", None) is not None
                                  and name.split(".")[-1] in ("connector", "metadata", "worker", "scheduler",
                                                              "conn", "plugin")):
                del sys.modules[name]
