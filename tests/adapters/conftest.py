"""Fixtures for the Hugging Face adapter tests (skipped when transformers is not installed)."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:        # `adapters/` is a folder of the repository, not an installed package
    sys.path.insert(0, ROOT)

pytest.importorskip("transformers")


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
