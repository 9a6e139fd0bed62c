"""``python -m asyncside.distributed STORE ...``: one rank of a pipelined generation job."""

import sys

from .rank import main

sys.exit(main())
