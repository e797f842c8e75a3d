from array import array

def stand_back(clock: array[float], period: float, fd: int, /) -> bool:
    """Wait without the GIL until `period` s after the time in `clock` (re-read) has
    passed (False), or until `fd` is readable (True)."""
