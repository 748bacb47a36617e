"""`python -m sluice.engine.native [--background] SOURCE...`: build the given kernels (build.main), as
extension.py asks."""

import sys

from .build import main

sys.exit(main(sys.argv[1:]))
