"""Benchmarks: `python -m flux2_fused.bench.kernel` and `python -m flux2_fused.bench.step`."""
