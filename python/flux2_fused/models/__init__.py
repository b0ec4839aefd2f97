"""FLUX.2 transformer models."""
