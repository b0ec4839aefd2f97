"""`flux2-fused ARGS` with comfy-kitchen's CUDA backend disabled, so ComfyUI's RoPE runs its eager
(torch) backend: ComfyUI "without comfy-kitchen" kernels, for the step benchmark's comparison. (Without
comfy-kitchen installed at all ComfyUI 0.30's FLUX RoPE has nothing to call.)"""

import sys

import comfy_kitchen

from flux2_fused.cli import main

comfy_kitchen.registry.disable("cuda")
sys.exit(main(sys.argv[1:]))
