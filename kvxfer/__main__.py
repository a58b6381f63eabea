"""``python -m kvxfer``: the ``kvxfer`` command, for when the script is not on ``PATH``."""

import sys

from kvxfer.cli import main

sys.exit(main())
