"""``python -m ckptstore.cli``: the command line, as the ``ckptstore`` script runs it."""

import sys

from . import main

sys.exit(main())
