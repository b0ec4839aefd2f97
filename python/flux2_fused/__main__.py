"""`python -m flux2_fused`: the `flux2-fused` command, for environments without the console script."""

import sys

from .cli import main

sys.exit(main())
