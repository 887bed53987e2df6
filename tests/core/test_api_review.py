"""The engine-facing API as a hurried engine author calls it, and the handle as a peer forges it:
every wrong argument is a kvbridge error that says what to fix, refused before anything is taken."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvbridge import KVHandle, KVLayout
from kvbridge.errors import BadHandle, ConfigError

pytestmark = pytest.mark.timeout(30)

L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")


def _kvb_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kvb")}


# -- handles ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", ["KVH\x01\x00", None, 1 << 40, 3.5, [1, 2, 3], {"a": 1}])
def test_handle_bytes_of_the_wrong_type_are_a_bad_handle(data: Any) -> None:
    """from_bytes(str or None) raised a raw TypeError, and from_bytes(int n) built n zero bytes
    first (a terabyte for 1 << 40) before calling them a bad magic."""
    with pytest.raises(BadHandle, match="bytes"):
        KVHandle.from_bytes(data)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_handle_dict_version_must_be_the_integer(version: Any) -> None:
    key = b"k" * 32
    h = KVHandle(b"\1" * 16, "r", "00" * 8, ("tcp://x:1",), (1,), (0,), (), 3).signed(key)
    d = h.to_dict()
    d["kvbridge_handle"] = version
    with pytest.raises(BadHandle, match="kvbridge_handle"):
        KVHandle.from_dict(d, key)


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [{}, {"num_layers": 2}, None, [("num_layers", 2)], "num_layers"])
def test_a_layout_dict_missing_fields_or_not_a_dict_is_a_config_error(d: Any) -> None:
    with pytest.raises(ConfigError):
        KVLayout.from_dict(d)


@pytest.mark.parametrize("dtype", [["float16"], {"x": 1}, 16])
def test_a_layout_dtype_of_the_wrong_type_is_a_config_error(dtype: Any) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(2, 2, 8, 4, dtype=dtype)


def test_a_layout_whose_block_bytes_overflow_is_refused() -> None:
    """Dims whose product no tensor can hold (torch's sizes are int64) were accepted and failed
    later, in allocate, as a raw TypeError."""
    with pytest.raises(ConfigError, match="bytes"):
        KVLayout(2, 2, 1 << 62, 4)
