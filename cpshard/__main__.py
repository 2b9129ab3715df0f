"""``python -m cpshard``: the same as the ``cpshard`` command."""

import sys

from cpshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
