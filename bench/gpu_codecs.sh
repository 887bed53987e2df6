#!/usr/bin/env bash
# The codecs' GPU checks in one command, for a machine with a CUDA device:
#   1. the fused kernels in native/ against their torch twins (tests/codecs/test_codecs_native.py),
#      plus the whole codec suite with the device present;
#   2. python -m bench.codecs --gpu: fused gather+quantize and dequantize+scatter against a
#      device-to-device copy and the torch.compile'd twin, measured in the same run.
# Needs CuPy for the kernels (pip install 'kvbridge[cupy]', or cupy-cuda13x for CUDA 13); without it
# the kernel tests skip with that reason and the benchmark measures the torch twin on the device.
# Usage: bench/gpu_codecs.sh [OUT_DIR]   (default: a scratch directory; results are not committed)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${TMPDIR:-/tmp}/kvbridge-gpu-codecs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
python3 -c "import cupy; print('cupy', cupy.__version__)" || echo "CuPy missing: the fused kernels will be skipped"
timeout 400 python3 -m pytest -q -rs tests/codecs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
timeout 300 python3 -m bench.codecs --gpu --quick --out "$OUT/codecs_gpu.json" 2>&1 | tee "$OUT/bench.txt"
brc=${PIPESTATUS[0]}
echo "pytest rc=$rc bench rc=$brc; results in $OUT"
exit $(( rc != 0 || brc != 0 ))
