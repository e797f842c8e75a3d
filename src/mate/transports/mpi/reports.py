"""What a progress pass of the MPI transport tells the core, handed over at once.

Reports are made in the progress context only (a pass, the calls it runs, or a
call made in the context at once: `Engine.call_in_context`) and kept until the
next pass ends; then `hand_over` gives them to the sink in one `report_all`:
with handlers on the loop and a progress thread, one hop to the loop per pass,
however many messages it moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from mate.errors import FailureReason
from mate.machine import Input
from mate.transports.base import Operation, Report, Sink, failure

# Module constants: a read through the enum class is slow on Python 3.11 (mate.message).
_SUBMITTED: Final = Input.SUBMITTED
_COMPLETED: Final = Input.COMPLETED
_FAILED: Final = Input.FAILED
_CANCELLED: Final = Input.CANCELLED


class Reporter:
    def __init__(self, sink: Callable[[], Sink]) -> None:
        self._sink = sink  # the transport's sink now (a layer may have rebound it)
        self._reports: list[Report] = []

    def submitted(self, op: Operation) -> None:
        self._reports.append(Report(_SUBMITTED, op))

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        self._reports.append(Report(_COMPLETED, op, length, peer, tag))

    def failed(self, op: Operation, reason: FailureReason, detail: str,
               cause: BaseException | None = None, *, length: int = 0,
               peer: int | None = None, tag: int | None = None) -> None:
        self._reports.append(Report(_FAILED, op, length, peer, tag,
                                    failure(reason, detail, cause)))

    def cancelled(self, op: Operation) -> None:
        self._reports.append(Report(_CANCELLED, op))

    def hand_over(self) -> None:
        """The pass is over: tell the core what it found."""
        if self._reports:
            reports, self._reports = self._reports, []
            self._sink().report_all(reports)
