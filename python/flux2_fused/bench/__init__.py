"""Benchmarks: `denoise` (flux2-fused bench), `step` (flux2-fused step), `kernel` (flux2-fused kernel);
`report` holds what they report and how it is printed, `plot` draws the bench report, and `options`
declares their command-line options without importing torch (so `flux2-fused --help` is instant).
None of them imports `flux2_fused.cli` or `flux2_fused.commands`, which import them."""
