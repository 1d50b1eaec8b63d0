"""``python -m fcoll.sim``: see :mod:`fcoll.sim.cli`."""

import sys

from fcoll.sim.cli import main

sys.exit(main())
