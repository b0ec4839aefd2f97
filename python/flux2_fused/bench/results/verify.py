"""`flux2-fused verify`: each op's self-check on this GPU, and the verdict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tables import markdown_table, yes_no


@dataclass
class VerifyRow:
    """One self-check of `flux2-fused verify` (printed, not written as JSON).

    - op: the fused operation checked
    - config: the configuration checked, e.g. "D=3072 bf16"
    - passed: the kernel's outputs equal live eager bit for bit
    - detail: what was compared, or why it failed
    - seconds: wall time of the check
    - module: where the op's module came from, "bundled (file)" (prebuilt in the wheel), "cache",
      "built now" (a JIT build with the local CUDA toolkit) or "unavailable", and the GPU
      architecture it runs on
    """

    op: str
    config: str
    passed: bool
    detail: str
    seconds: float
    module: str = "-"


def format_verify(rows: Sequence[VerifyRow], device: str, torch_version: str) -> str:
    """The verify table and its verdict."""
    table = markdown_table(
        ["op", "module", "config", "passed", "detail", "seconds"],
        [[r.op, r.module, r.config, yes_no(r.passed), r.detail, f"{r.seconds:.3f}"] for r in rows],
    )
    failed = sum(not r.passed for r in rows)
    verdict = "all bit-exact" if not failed else f"{failed} of {len(rows)} FAILED"
    return f"flux2-fused verify on {device}, torch {torch_version}\n{table}\n{verdict}"
