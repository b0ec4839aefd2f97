"""The bundled swiglu module deleted: a JIT build where a toolkit is in reach, else eager with one
warning; the output equal to eager either way. HIDE=1 hides /usr/local/cuda from the lookup."""

import os
import warnings

import torch

from flux2_fused.ops import jit, swiglu

if os.environ.get("HIDE") == "1":
    jit.DEFAULT_CUDA_HOMES = ()
x = torch.randn(2, 33, 2048, device="cuda", dtype=torch.bfloat16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = swiglu.apply(x)
origin = jit.module_origin(swiglu.OP.spec, jit.device_arch(0))
equal = torch.equal(out, swiglu.reference.swiglu(x))
messages = [str(w.message)[:160] for w in caught]
where = "toolkit hidden" if os.environ.get("HIDE") == "1" else "toolkit"
print(where, origin, "| equal:", equal, "|", messages)
