"""The constants of the MATE API (thesis Table 5.1)."""

from __future__ import annotations

import enum
from typing import Final, Literal


class _Unset(enum.Enum):
    # An enum member, so that type checkers can narrow `timeout: float | None | _Unset`.
    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "mate.UNSET"


UNSET: Final = _Unset.UNSET
UnsetType = Literal[_Unset.UNSET]

ANY_SOURCE: Final = -1  # MATE_ANYSRC: a recv that accepts any sender
ANY_TAG: Final = -1  # MATE_ANYTAG: a recv that accepts any tag
PROC_MAX: Final = 2**31 - 1  # MATE_PROCMAX: no world has more processes
