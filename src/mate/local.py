"""N ranks in one process: ``async with mate.local.worlds(n) as worlds:``."""

from mate.transports.local import DEFAULT_EAGER_LIMIT, open_worlds, worlds

__all__ = ["DEFAULT_EAGER_LIMIT", "open_worlds", "worlds"]
