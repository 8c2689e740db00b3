"""`python -m rljax ...` runs the `rljax` command line (see `rljax.cli`)."""

import sys

from rljax.cli import main

if __name__ == "__main__":
    sys.exit(main())
