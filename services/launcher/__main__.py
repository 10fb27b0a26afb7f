"""``python -m services.launcher SPEC``: see :mod:`services.launcher.processes`."""

import sys

from services.launcher.processes import main

if __name__ == "__main__":
    sys.exit(main())
