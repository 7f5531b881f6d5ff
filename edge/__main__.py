"""`python -m triode.edge`: the `triode` command."""

import sys

from .entry import main

sys.exit(main())
