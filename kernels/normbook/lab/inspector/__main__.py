"""``python -m normbook.lab.inspector``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
