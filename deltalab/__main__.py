"""`python -m deltalab ...`: the `deltalab` command (how a study launches its runs)."""

import sys

from deltalab.cli import main

sys.exit(main())
