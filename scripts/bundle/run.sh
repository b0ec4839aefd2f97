#!/usr/bin/env bash
# The bundled wheel on a GPU machine: install .whl/bundle/*.whl (built here with
# `FLUX2_FUSED_BUNDLE_KERNELS=1 pip wheel --no-deps --no-build-isolation -w .whl/bundle .`) into a fresh
# folder, hide the CUDA toolkit, empty the kernel cache, then: every op's module bundled, enable() plus
# the first fused klein-4B step timed and compared with diffusers, a CUDA graph of the step, `verify`;
# then one bundled module deleted: eager with one warning without a toolkit, a JIT build with one.
# Expects the carried wheels of gpu-session.sh installed in /tmp/site (it runs this as `bundle-check`).
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/wheel .whl/bundle/*.whl || exit 1
cd /tmp
unset CUDA_HOME CUDA_PATH
PATH=$(echo "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd:)
export PATH PYTHONPATH=/tmp/wheel:/tmp/site FLUX2_FUSED_CACHE_DIR=/tmp/empty-cache
python3 "$R/scripts/bundle/check.py" 2>&1 | grep -v -i "torchao\|Configuration class\|warn("
rm /tmp/wheel/flux2_fused/ops/prebuilt/flux2_fused_swiglu.so
HIDE=1 python3 "$R/scripts/bundle/fallback.py" 2>&1 | tail -2
PATH=$PATH:/usr/local/cuda/bin HIDE=0 python3 "$R/scripts/bundle/fallback.py" 2>&1 | tail -2
