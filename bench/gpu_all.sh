#!/usr/bin/env bash
# Every GPU check kvbridge has, in one command, in order of worth, each step bounded in time
# (about 8 minutes in all on one H200) so that a step that hangs cannot take the others down:
#   0. installs the wheels in .whl/ (bench/gpu_prepare.sh fetched them) into /tmp/site when there
#      are any, builds the C extension, and says what the machine has;
#   1. the GPU tests: nvlink:// and CUDA staging, the conformance suite's nvlink column, the fused
#      codec kernels against their torch twins, device frames under the codec defenses, and a
#      CUDA pool served by the reference engine (pytest -rs: every skip says why);
#   2. python -m bench.gpu --no-tests --quick (nvlink fetch, staging, device vs host pools over tcp,
#      device checksums; each against a ceiling measured in the same run);
#   3. python -m bench.codecs --gpu --quick (fused gather+quantize / dequantize+scatter against a
#      device-to-device copy and the torch.compile'd twin);
#   4. python -m bench.gpucopy (the batched copy kernel taken apart: plan, upload, launch, against
#      one device-to-device copy and torch's own gathers).
# Usage: bash bench/gpu_all.sh [OUT_DIR]. Writes gpu.log (everything), gpu.json, gpu.md and
# codecs_gpu.json and gpucopy.json there. Exits non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${TMPDIR:-/tmp}/kvbridge-gpu}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || echo "STEP 0: installing .whl/ failed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== 0. machine $(date -u +%FT%TZ)"
nvidia-smi -L || true
(python3 setup.py -q build_ext --inplace 2>&1 | tail -5) || true
python3 - <<'PY' || true
import torch, kvbridge.blockcopy as b
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("native C extension", b.NATIVE)
try:
    import cupy; print("cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as e:
    print("cupy unavailable:", e)
PY
rcs=()
echo "== 1. GPU tests"
timeout 200 python3 -m pytest -n 0 -rs --tb=short -p no:cacheprovider --timeout 90 \
  tests/core/test_nvlink_cuda.py tests/core/test_gpucopy.py tests/core/test_staging.py tests/core/test_nvlink.py \
  tests/codecs/test_codecs_native.py tests/security/test_codec_defenses.py \
  "tests/workers/test_workers_engine.py::test_cuda_pool_and_model_match_cpu"
rcs+=("tests=$?")
timeout 110 python3 -m pytest -n 0 -rs --tb=short -p no:cacheprovider --timeout 60 tests/core/test_conformance.py -k nvlink
rcs+=("conformance-nvlink=$?")
echo "== 2. bench.gpu"
timeout 190 python3 -m bench.gpu --no-tests --quick --out "$OUT"
rcs+=("bench.gpu=$?")
echo "== 3. bench.codecs --gpu"
timeout 70 python3 -m bench.codecs --gpu --quick --out "$OUT/codecs_gpu.json"
rcs+=("bench.codecs=$?")
echo "== 4. bench.gpucopy"
timeout 90 python3 -m bench.gpucopy --out "$OUT/gpucopy.json"
rcs+=("bench.gpucopy=$?")
echo "== done $(date -u +%FT%TZ): ${rcs[*]}"
for r in "${rcs[@]}"; do [[ "$r" == *=0 ]] || exit 1; done
