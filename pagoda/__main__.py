"""`python -m pagoda ...` runs the `pagoda` command (`pagoda.cli`)."""

import sys

from pagoda.cli import main

if __name__ == "__main__":
    sys.exit(main())
