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
