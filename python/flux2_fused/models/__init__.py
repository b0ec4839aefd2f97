"""Model families, one folder each (`flux2/`), and what every family shares: the pending residual
streams between blocks (`deferral`) and diffusers-format weight folders (`weights`)."""
