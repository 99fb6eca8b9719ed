"""``python -m spchain bench [--quick] ...``: see ``spchain.bench``."""

import sys

from .bench import main

if __name__ == "__main__":
    sys.exit(main())
