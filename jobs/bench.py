"""`python -m jobs.bench <suite> [args]`: an alias of `python -m benchmarks <suite> [args]` (the
benchmarks live in the top-level `benchmarks` package; other issues and users name this one)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
