"""`python -m ladder ...` is `nanoqwen ...` from a plain checkout (the same `main`, engine/cli.py)."""

import sys

from engine.cli import main

sys.exit(main())
