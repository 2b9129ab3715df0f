"""``python -m cpshard``: the same as the ``cpshard`` command."""

import sys

from cpshard.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
