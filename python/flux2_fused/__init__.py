"""flux2-fused: the lossless fast path for FLUX.2 transformers.

Each gated residual update of FLUX.2's residual streams and the LayerNorm + adaLN modulation that
reads the stream next run as one CUDA kernel whose outputs equal PyTorch eager bit for bit.
"""

__version__ = "0.1.0"
