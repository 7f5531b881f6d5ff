"""`python -m triode.actors ...`: the entry of every child actor process."""

import sys

from .child import main

sys.exit(main(sys.argv[1:]))
