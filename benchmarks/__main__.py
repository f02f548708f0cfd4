"""`python -m benchmarks <suite> [args]`: see the package's docstring."""

import sys

from benchmarks.cli import main

sys.exit(main())
