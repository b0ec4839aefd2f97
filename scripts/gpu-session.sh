#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, then run the named steps, logging to $OUT.
#   scripts/gpu-session.sh [ops-tests] [model-tests] [verify] [kernel-bench] [step-bench]
#                          [baseline-kernel-bench] [baseline-step-bench] [pytest:ARGS]
# Run from the repository root. .whl/ holds cp312 wheels of what the GPU image lacks (apache-tvm-ffi,
# diffusers), downloaded with `pip download --only-binary=:all: --python-version 3.12 ...`.
# The baseline-* steps run the same benchmark from .baseline/python (an earlier tree, e.g.
# `git archive <commit> python | tar -x -C .baseline`), for before/after numbers in one session.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 FLUX2_FUSED_CACHE_DIR=/tmp/flux2-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__, 'gpus', torch.cuda.device_count())"
baseline() { PYTHONPATH=/tmp/site:$PWD/.baseline/python FLUX2_FUSED_CACHE_DIR=/tmp/flux2-cache-baseline "$@"; }
rc=0
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    ops-tests) python3 -m pytest -q -x test/ops -m gpu 2>&1 | tee "$OUT/ops-tests.log" | tail -15 || rc=1 ;;
    model-tests) python3 -m pytest -q test/models test/integrations test/bench -m gpu 2>&1 | tee "$OUT/model-tests.log" | tail -15 || rc=1 ;;
    verify) python3 -m flux2_fused verify 2>&1 | tee "$OUT/verify.log" | tail -20 || rc=1 ;;
    kernel-bench) python3 -m flux2_fused.bench.kernel --json "$OUT/kernel.json" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/kernel-bench.log" || rc=1 ;;
    step-bench) python3 -m flux2_fused.bench.step --json "$OUT/step.json" ${STEP_BENCH_ARGS:-} 2>&1 | tee "$OUT/step-bench.log" || rc=1 ;;
    baseline-kernel-bench) baseline python3 -m flux2_fused.bench.kernel ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/baseline-kernel-bench.log" || rc=1 ;;
    baseline-step-bench) baseline python3 -m flux2_fused.bench.step ${STEP_BENCH_ARGS:-} 2>&1 | tee "$OUT/baseline-step-bench.log" || rc=1 ;;
    pytest:*) python3 -m pytest -q ${step#pytest:} 2>&1 | tee -a "$OUT/pytest.log" | tail -15 || rc=1 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
