"""`python -m ladder.cli ...`: the `ladder` command."""

import sys

from ladder.cli import main

sys.exit(main())
