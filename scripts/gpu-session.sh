#!/usr/bin/env bash
# One device-machine session: install the carried wheels, then run the named steps, logging to $OUT.
#   scripts/gpu-session.sh [ops-tests] [kernel-bench] [model-tests] [step-bench] [pytest:ARGS]
# Run from the repository root with .whl carried (see shared/tools/gpu-wheels.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 FLUX2_FUSED_CACHE_DIR=/tmp/flux2-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__)"
rc=0
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    ops-tests) python3 -m pytest -q -x test/ops -m gpu 2>&1 | tee "$OUT/ops-tests.log" | tail -15 || rc=1 ;;
    kernel-bench) python3 -m flux2_fused.bench.kernel --json "$OUT/kernel.json" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/kernel-bench.log" || rc=1 ;;
    model-tests) python3 -m pytest -q test/models test/integrations -m gpu 2>&1 | tee "$OUT/model-tests.log" | tail -15 || rc=1 ;;
    step-bench) python3 -m flux2_fused.bench.step --json "$OUT/step.json" ${STEP_BENCH_ARGS:-} 2>&1 | tee "$OUT/step-bench.log" || rc=1 ;;
    pytest:*) python3 -m pytest -q ${step#pytest:} 2>&1 | tee -a "$OUT/pytest.log" | tail -15 || rc=1 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
