"""``python -m kvbridge``: the same as the ``kvbridge`` console script."""

import sys

from .cli import main

sys.exit(main())
