"""Build of kvbridge's one C extension, ``kvbridge._kvcopy`` (native/cpu/kvcopy.c): block
copies and xxh3-64 checksums in one pass, and the BLAKE2b keys of shm's handle table.
Everything else is in pyproject.toml. Where it
cannot be built, kvbridge runs the same operations in Python (``KVBRIDGE_NO_NATIVE=1``
chooses that path on purpose)."""

import platform
import sysconfig

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
SOURCES = ["native/cpu/kvcopy.c", "native/cpu/copyhash.c", "native/cpu/blake2b.c", "native/cpu/dstids.c",
           "native/cpu/helper.c",
           "native/cpu/xxhash/xxhash.c"]
MACROS = [("XXH_NAMESPACE", "kvb_")]
if X86:   # xxHash's runtime dispatch (SSE2/AVX2/AVX-512) needs baseline flags, no -march
    SOURCES.append("native/cpu/xxhash/xxh_x86dispatch.c")
    MACROS.append(("KVB_X86_DISPATCH", "1"))

setup(ext_modules=[Extension(
    "kvbridge._kvcopy", SOURCES, include_dirs=["native/cpu/xxhash"], define_macros=MACROS,
    optional=True,   # no compiler: install anyway, and the Python twin runs (blockcopy.NATIVE is False)
    extra_compile_args=["-O3", "-std=gnu11"] if sysconfig.get_platform().startswith("linux") else [],
)])
