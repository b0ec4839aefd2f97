"""Benchmarks: `denoise` (flux2-fused bench), `step` (flux2-fused step), `kernel` (flux2-fused kernel);
`results` holds what each reports and how it is printed (a module a command), `plot` draws the bench
report, and `options`
declares their command-line options without importing torch (so `flux2-fused --help` is instant).
None of them imports `flux2_fused.cli` or `flux2_fused.commands`, which import them."""
