"""``python -m asyncside``: the ``asyncside`` command (:mod:`asyncside.cli`)."""

import sys

from .cli import main

sys.exit(main())
