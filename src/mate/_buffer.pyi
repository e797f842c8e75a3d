def address_of(view: memoryview, /) -> int:
    """The virtual address of the first byte of `view` (read-only views included)."""

def memmove(dst: int, src: int, count: int, /) -> None:
    """Copy `count` bytes from address `src` to address `dst` (the runs may overlap)."""

def string_at(address: int, count: int, /) -> bytes:
    """The `count` bytes at `address`."""
