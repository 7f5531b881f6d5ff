"""`python -m triode.fuzz.live`: the live fuzzer's command line (`triode fuzz`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
