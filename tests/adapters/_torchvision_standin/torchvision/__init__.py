"""A stand-in for ``torchvision`` where only CUDA builds of it install (see
adapters/kvbridge_sglang/README.md): SGLang's engine modules and transformers' processors import
it at module level for image preprocessing, which the KV transfer tests never run. Every
``torchvision.*`` module imports; using anything in one raises (``InterpolationMode`` is an enum,
as the importers' default arguments need)."""

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Optional, Sequence

__version__ = "0.0+standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _attr(module: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode

    class Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{module}.{name}: torchvision is a test stand-in here (no image preprocessing)")
    Unavailable.__name__ = Unavailable.__qualname__ = name
    return Unavailable


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []                                              # type: ignore[attr-defined]
        m.__getattr__ = lambda name, _m=spec.name: _attr(_m, name)   # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Finder())


def __getattr__(name: str) -> Any:
    if name in ("transforms", "io", "ops", "models", "datasets", "utils"):
        return importlib.import_module(f"{__name__}.{name}")
    return _attr(__name__, name)
