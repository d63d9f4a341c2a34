"""`python -m blockpress.cli`: the `blockpress` command, as `python -m blockpress` runs it."""

import sys

from blockpress.cli import main

if __name__ == "__main__":
    sys.exit(main())
