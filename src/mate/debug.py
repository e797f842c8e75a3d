"""A debug hook in the transports' hot spots, for testers who perturb timing.

A transport reads `hot_spot_hook()` when it is opened and, if a hook is set,
calls it with the name of the spot at each of its hot spots: where a post
meets the wire, where a progress pass hands what it found to the core, where
a cancel is carried out. `mate.litmus` sets a hook that sometimes spins or
yields there, so that rare interleavings become common. Off (the default) a
hot spot costs one test of an attribute for None.
"""

from __future__ import annotations

from collections.abc import Callable

HotSpotHook = Callable[[str], None]

_hook: HotSpotHook | None = None


def set_hot_spot_hook(hook: HotSpotHook | None) -> None:
    """Call `hook(spot)` at the hot spots of transports opened from now on (None: off)."""
    global _hook
    _hook = hook


def hot_spot_hook() -> HotSpotHook | None:
    """The hook a transport being opened now should call, or None."""
    return _hook
