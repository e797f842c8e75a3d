"""N ranks in one process: ``async with mate.local.worlds(n) as worlds:``.

A group has at most `MAX_RANKS` (2**20) ranks; each costs about 2 KB of memory.
"""

from mate.transports.local import DEFAULT_EAGER_LIMIT, MAX_RANKS, open_worlds, worlds

__all__ = ["DEFAULT_EAGER_LIMIT", "MAX_RANKS", "open_worlds", "worlds"]
