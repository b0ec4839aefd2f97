"""The Z-Image family: diffusers' `ZImageTransformer2DModel` (Tongyi-MAI's single-stream DiT) with its
blocks on the block code (`blocks`), bound to diffusers by `diffusers.BINDING`. Like Qwen-Image it has
no model of the package's own."""
