"""Engines and adapters use kvbridge's public API only.

Public: a name listed in ``__all__`` of one of the public modules below, never a name that
starts with an underscore, never an underscore attribute of a kvbridge object. This test
reads the source of ``adapters/`` and of this suite and fails on any other import.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLIC_MODULES = {"kvbridge", "kvbridge.errors", "kvbridge.layout", "kvbridge.policy", "kvbridge.lease",
                  "kvbridge.transports", "kvbridge.workers.model", "kvbridge.workers.engine",
                  "kvbridge.workers.http"}   # guarded HTTP serving, for an adapter's own endpoint


def _sources() -> list[pathlib.Path]:
    files = sorted((ROOT / "adapters").rglob("*.py")) + sorted((ROOT / "tests" / "engine_api").glob("*.py"))
    assert files, "nothing to check"
    return files


def private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    bad: list[str] = []
    kv_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvbridge":
            if node.module not in PUBLIC_MODULES:
                bad.append(f"{path.name}:{node.lineno}: from {node.module} import ... (not a public module)")
                continue
            exported = set(getattr(importlib.import_module(node.module), "__all__", ()))
            for a in node.names:
                if a.name.startswith("_") or a.name not in exported:
                    bad.append(f"{path.name}:{node.lineno}: {node.module}.{a.name} is not public")
                kv_names.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kvbridge":
                    if a.name not in PUBLIC_MODULES:
                        bad.append(f"{path.name}:{node.lineno}: import {a.name} (not a public module)")
                    kv_names.add((a.asname or a.name).split(".")[0])
    for node in ast.walk(tree):   # kvbridge._x, or SomeKvbridgeName._y
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in kv_names):
            bad.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr} is private")
    return bad


def test_adapters_and_engine_suite_use_public_names_only() -> None:
    bad = [b for p in _sources() for b in private_uses(p)]
    assert bad == [], "\n".join(bad)


def test_the_check_catches_private_imports(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "sneaky.py"
    f.write_text("from kvbridge.transports.wire import pack\nfrom kvbridge import KVPool, _errors_all\n"
                 "import kvbridge\nkvbridge._secret\nKVPool._check_ids\n")
    bad = private_uses(f)
    assert len(bad) == 4, bad
