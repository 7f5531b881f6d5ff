"""`python -m triode.wire.bench`: the benchmark, or with `--peer` the echo peer process that its
transport case starts."""

from .cli import main

if __name__ == "__main__":
    main()
