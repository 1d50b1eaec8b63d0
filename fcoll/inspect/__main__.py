"""``python -m fcoll.inspect SCRIPT --out DIR -- ARGS`` (see :mod:`fcoll.inspect.cli`)."""

import sys

from fcoll.inspect.cli import main

sys.exit(main())
