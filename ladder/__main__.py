"""`python -m ladder ...` is `nanoqwen ...` from a plain checkout."""

import sys

from ladder.cli import main

sys.exit(main())
