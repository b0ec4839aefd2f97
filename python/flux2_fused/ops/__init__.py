"""Fused CUDA ops: the gated-residual + LayerNorm + adaLN kernel, its guards and eager references."""

from .gated_resnorm import (
    DISABLE_ENV,
    MAX_DIM,
    Segment,
    bits_equal,
    can_defer_flux2_gated_residual,
    can_use_flux2_gated_resnorm,
    can_use_flux2_modnorm,
    defer_decline_reason,
    enabled,
    flux2_gated_resnorm_raw,
    flux2_modnorm_raw,
    gated_resnorm_decline_reason,
    gated_resnorm_reference,
    modnorm_decline_reason,
    modnorm_reference,
    self_check_records,
)

__all__ = [
    "DISABLE_ENV",
    "MAX_DIM",
    "Segment",
    "bits_equal",
    "can_defer_flux2_gated_residual",
    "can_use_flux2_gated_resnorm",
    "can_use_flux2_modnorm",
    "defer_decline_reason",
    "enabled",
    "flux2_gated_resnorm_raw",
    "flux2_modnorm_raw",
    "gated_resnorm_decline_reason",
    "gated_resnorm_reference",
    "modnorm_decline_reason",
    "modnorm_reference",
    "self_check_records",
]
