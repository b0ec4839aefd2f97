"""flux2-fused: the lossless fast path for FLUX transformers (FLUX.2 and FLUX.1).

The eager elementwise chains of each block (a gated residual update and the LayerNorm + adaLN that
reads the stream next, the QK RMSNorm + RoPE prologue, the MLP activation) run as CUDA kernels whose
outputs equal PyTorch eager bit for bit.
"""

__version__ = "0.1.0"
