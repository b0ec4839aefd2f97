"""The installed bundled wheel with the toolkit hidden and an empty cache: where each op's module came
from, enable() plus the first fused klein-4B step (time, equal to diffusers), the fused launches, a CUDA
graph of the fused step, and `flux2-fused verify`."""

import subprocess
import sys
import time

import torch

from flux2_fused.bench import hosts
from flux2_fused.bench.step import kernel_breakdown, step_inputs
from flux2_fused.integrations.diffusers import enable
from flux2_fused.models.flux2 import Flux2Config
from flux2_fused.ops import OPS, jit

jit.DEFAULT_CUDA_HOMES = ()
jit.pip_cuda_homes = list
print("package:", jit.__file__, "| toolkit:", jit.toolchain_reason())
config = Flux2Config.preset("klein-4b")
model = hosts.diffusers_host(config, torch.device("cuda"), torch.bfloat16)
inputs = step_inputs(config, 1, 4096, 512, torch.bfloat16)
with torch.inference_mode():
    expected = model(**inputs, return_dict=False)[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    enable(model)
    fused = model(**inputs, return_dict=False)[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"enable() + first fused step: {seconds:.2f} s, equal: {torch.equal(fused, expected)}")
    for op in OPS:
        print(op.name, jit.module_origin(op.spec, jit.device_arch(0)))
    print("fused launches:", kernel_breakdown(lambda: model(**inputs)).launches["fused"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(**inputs, return_dict=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(**inputs, return_dict=False)[0]
    graph.replay()
    torch.cuda.synchronize()
    print("graph replay equal:", torch.equal(captured, expected))
verify = subprocess.run([sys.executable, "-m", "flux2_fused", "verify"], capture_output=True, text=True)
print(verify.stdout[-3000:])
