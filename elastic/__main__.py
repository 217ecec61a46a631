"""``python -m elastic ...`` is the ``elastic`` command."""

import sys

from .cli import main

sys.exit(main())
