"""python -m normbook.lab.bench: see kernels/normbook/lab/bench/__init__.py."""

import sys

from .cli import cli

if __name__ == "__main__":
    sys.exit(cli())
