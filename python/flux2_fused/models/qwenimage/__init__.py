"""The Qwen-Image family: diffusers' `QwenImageTransformer2DModel` on the block code (`blocks`), bound
to diffusers by `diffusers.BINDING`. Like FLUX.1 it has no model of the package's own."""
