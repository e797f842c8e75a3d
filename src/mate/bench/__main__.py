"""``python -m mate.bench``: the same as ``mate-bench``."""

from mate.bench.cli import main

if __name__ == "__main__":
    main()
