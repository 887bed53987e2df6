"""Every Python snippet in the adapters' READMEs runs as pasted.

Each ```python block of ``adapters/*/README.md`` is written to a file and run with a fresh
interpreter (so an ``if __name__ == "__main__":`` guard behaves as it does for a user).
A snippet that needs an engine which is not installed is skipped, naming the extra to
install. The vLLM README's ``python -m kvbridge_vllm.pd_demo`` command is run by
``test_vllm_pd.py`` (marker ``vllm``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINES = {"vllm": ("vllm", "kvbridge[vllm]"), "sglang": ("sglang", "kvbridge[sglang]"),
           "transformers": ("transformers", "kvbridge[hf]")}


def snippets() -> list[tuple[str, str]]:
    out = []
    for readme in sorted((ROOT / "adapters").glob("*/README.md")):
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)):
            out.append((f"{readme.parent.name}-{i}", code))
    return out


def _needs(code: str) -> list[str]:
    names = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, re.M))
    if "kvbridge_vllm" in names:
        names.add("vllm")
    if {"kvbridge_hf"} & names:
        names.add("transformers")
    if "kvbridge_sglang" in names:
        names.add("sglang")
    return sorted(n for n in ENGINES if n in names)


def _params() -> list[object]:
    ps = []
    for name, code in snippets():
        needs = _needs(code)
        marks: list[object] = []
        missing = [n for n in needs if importlib.util.find_spec(ENGINES[n][0]) is None]
        if missing:
            marks.append(pytest.mark.skip(reason=f"needs {', '.join(missing)}: pip install "
                                                 + " ".join(f"'{ENGINES[n][1]}'" for n in missing)))
        if "vllm" in needs:
            marks += [pytest.mark.vllm, pytest.mark.timeout(600)]
        ps.append(pytest.param(code, needs, id=name, marks=marks))
    return ps


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if importlib.util.find_spec("kvbridge_hf") is None:   # an editable install that predates the adapters
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "adapters"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_there_are_snippets() -> None:
    names = [n for n, _ in snippets()]
    assert any(n.startswith("kvbridge_hf") for n in names) and any(n.startswith("kvbridge_vllm") for n in names)


@pytest.mark.parametrize("code,needs", _params())
def test_readme_snippet_runs(code: str, needs: list[str], tmp_path: pathlib.Path) -> None:
    f = tmp_path / "snippet.py"
    f.write_text(code)
    limit = 540 if "vllm" in needs else 100
    p = subprocess.run([sys.executable, str(f)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=limit)
    assert p.returncode == 0, f"snippet failed:\n{code}\n--- stderr (tail) ---\n{p.stderr[-4000:]}"
