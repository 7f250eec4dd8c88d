"""``python -m offloadkit`` is the ``offloadkit`` command."""

import sys

from offloadkit.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
