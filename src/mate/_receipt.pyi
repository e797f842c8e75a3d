from typing import Any

def bind(cls: type, names: tuple[str, ...], /) -> None:
    """build() makes instances of `cls`, filling its slots `names` in this order."""

def build(*values: Any) -> Any:
    """An instance of the bound class, its slots set to `values`."""
