"""``python -m orbit_pt``: the ``orbit-pt`` command (see :mod:`orbit_pt.cli`)."""

import sys

from orbit_pt.cli import main

sys.exit(main())
