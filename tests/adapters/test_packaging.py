"""The wheel ships the adapters as top-level modules and declares the engine extras."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADAPTERS = ("kvbridge_hf", "kvbridge_vllm", "kvbridge_sglang")


def test_pyproject_declares_extras_and_adapter_packages() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = cfg["project"]["optional-dependencies"]
    assert {"hf", "vllm", "sglang"} <= set(extras)
    assert not any("vllm" in d or "sglang" in d for d in extras["dev"]), "engines stay out of the dev extra"
    find = cfg["tool"]["setuptools"]["packages"]["find"]
    assert "adapters" in find["where"]
    for name in ADAPTERS:
        assert (ROOT / "adapters" / name / "__init__.py").exists()


@pytest.mark.timeout(300)
def test_wheel_contains_the_adapters(tmp_path: pathlib.Path) -> None:
    try:
        import setuptools
        from setuptools.command import bdist_wheel  # noqa: F401  (setuptools >= 70.1 builds wheels itself)
    except ImportError:
        pytest.skip("building the wheel offline needs setuptools >= 70.1 in this environment")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              "tests", "bench", "docs"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(tmp_path / "out")], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = (tmp_path / "out").glob("kvbridge-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for name in ADAPTERS:
        assert f"{name}/__init__.py" in names, sorted(names)
    assert "kvbridge_vllm/connector.py" in names and "kvbridge_hf/cache.py" in names
    assert not any(n.startswith("adapters/") for n in names)
    assert setuptools.__version__
