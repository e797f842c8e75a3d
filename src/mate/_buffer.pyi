def address_of(view: memoryview, /) -> int:
    """The virtual address of the first byte of `view` (read-only views included)."""
