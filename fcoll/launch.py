"""``python -m fcoll.launch --nproc-per-node N script.py ARGS``: see :mod:`fcoll.runtime.launch`."""

from __future__ import annotations

import sys

from fcoll.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
