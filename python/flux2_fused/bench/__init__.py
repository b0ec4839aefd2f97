"""Benchmarks: `denoise` (flux2-fused bench), `step` (flux2-fused step), `kernel` (flux2-fused kernel);
`report` holds what they report and how it is printed, `plot` draws the bench report."""
