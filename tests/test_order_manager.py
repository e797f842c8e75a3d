"""The order manager demo (examples/order_manager.py): runs on the local and MPI
transports, with and without dropped and delayed acknowledgements, and its check
can fail."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import LAUNCHED
from launch import load_script, run_bounded

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "order_manager.py"
om = load_script(SCRIPT)  # the module is only read, never changed: loaded once
SMALL = ["--orders", "60", "--prices", "200", "--order-timeout", "0.1", "--deadline", "30"]
FAULTS = ["--drop-acks", "0.1", "--delay-acks", "0.1"]
SUMMARY = re.compile(r"order manager: (\d+) orders = (\d+) acknowledged \+ (\d+) executed "
                     r"\+ (\d+) cancelled \((\d+) acks dropped, (\d+) delayed; (\d+) timeouts\)")


def run(command: list[str], timeout: float = 120) -> tuple[int, list[str]]:
    done = run_bounded(command, timeout, "examples/order_manager.py")
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output (exit {done.returncode}):\n{done.stderr}"
    return done.returncode, lines


def check_verified(code: int, lines: list[str], faults: bool) -> None:
    output = "\n".join(lines)
    assert code == 0, output
    assert "verified" in lines[-1] and "NOT" not in lines[-1], output
    match = SUMMARY.search(lines[-1])
    assert match, output
    orders, acked, executed, cancelled, dropped, delayed, timeouts = map(int, match.groups())
    assert orders > 0 and acked + executed + cancelled == orders
    if faults:
        # Every dropped ack ends in a cancellation; delayed ones mostly do as well.
        assert dropped > 0 and delayed > 0, output
        assert cancelled >= dropped and timeouts >= cancelled, output
    else:
        assert cancelled == dropped == delayed == timeouts == 0, output


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
def test_local(ranks: int, faults: bool) -> None:
    command = [sys.executable, str(SCRIPT), "--transport", "local", "--ranks", str(ranks),
               *SMALL, *(FAULTS if faults else [])]
    code, lines = run(command)
    check_verified(code, lines, faults)
    traders = 1 if ranks == 2 else ranks - 2
    assert sum(line.startswith("trader ") for line in lines) == traders


def test_late_reports_race_with_cancels() -> None:
    """Reports delayed by exactly the order timeout: some cancels come after the report."""
    command = [sys.executable, str(SCRIPT), "--ranks", "3", *SMALL,
               "--drop-acks", "0.1", "--delay-acks", "0.3:0.1"]
    code, lines = run(command)
    check_verified(code, lines, faults=True)


@pytest.mark.parametrize("extra", [[], ["--progress", "thread", "--handlers", "progress"]],
                         ids=["poll", "thread-handlers"])
def test_mpi(extra: list[str]) -> None:
    pytest.importorskip("mpi4py")
    mate_run = Path(sys.executable).with_name("mate-run")
    command = [str(mate_run), "-n", "2", sys.executable, str(SCRIPT), "--transport", "mpi",
               *SMALL, *FAULTS, *extra]
    code, lines = run(command, timeout=180)
    check_verified(code, lines, faults=True)
    # Only rank 0 prints: one summary line, and it is the last.
    assert sum("order manager:" in line for line in lines) == 1


@pytest.mark.parametrize("extra", [[], ["--progress", "thread", "--handlers", "progress"]],
                         ids=["loop", "thread-handlers"])
def test_ibverbs(extra: list[str]) -> None:
    mate_run = Path(sys.executable).with_name("mate-run")
    command = [str(mate_run), "-n", "3", "--transport", "ibverbs", sys.executable, str(SCRIPT),
               "--transport", "ibverbs", *SMALL, *FAULTS, *extra]
    code, lines = run(command, timeout=180)
    check_verified(code, lines, faults=True)


def test_deadline_gives_not_verified() -> None:
    command = [sys.executable, str(SCRIPT), "--prices", "100000", "--deadline", "0.5"]
    code, lines = run(command)
    assert code == 1
    assert "NOT verified" in lines[-1]


# -- the check itself ----------------------------------------------------------------------

Breakage = Callable[[Any, dict[int, Any]], None]


def good_run(om: ModuleType) -> tuple[Any, dict[int, Any]]:
    """A book and ledgers of a run that went right: trader 1, four orders, one dropped."""
    book = om.ExchangeBook()
    states = {0: om.ACKED, 1: om.EXECUTED, 2: om.CANCELLED, 3: om.ACKED}
    book.received[1] = set(states)
    book.ledgers[1] = dict(states)
    book.finals.update({(1, oid): 1 for oid in states})
    book.dropped.add((1, 2))
    report = om.TraderReport(rank=1, ledger=dict(states), sent=4, prices=10, timeouts=1)
    return book, {1: report}


def test_verify_accepts_agreeing_ledgers() -> None:
    book, reports = good_run(om)
    verdict = om.verify(book, reports, [1], 10)
    assert verdict.verified, verdict.problems
    assert (verdict.orders, verdict.acked, verdict.executed, verdict.cancelled) == (4, 2, 1, 1)
    assert verdict.summary().endswith("trader and exchange ledgers agree: verified")


def test_ledger_round_trip() -> None:
    _, reports = good_run(om)
    report = reports[1]
    report.median_latency_ms = 0.25
    assert om.TraderReport.unpack(report.pack()) == report


def breakages(om: ModuleType) -> dict[str, Breakage]:
    """Ways a run can go wrong, each applied to a good run's book and ledgers."""

    def missing(book: Any, reports: dict[int, Any]) -> None:  # the trader lost an order
        del reports[1].ledger[3]

    def disagree(book: Any, reports: dict[int, Any]) -> None:
        reports[1].ledger[0] = om.EXECUTED

    def twice(book: Any, reports: dict[int, Any]) -> None:
        reports[1].second_endings = 1

    def two_finals(book: Any, reports: dict[int, Any]) -> None:
        book.finals[(1, 0)] = 2

    def dropped_not_cancelled(book: Any, reports: dict[int, Any]) -> None:
        book.dropped.add((1, 0))

    def unreceived(book: Any, reports: dict[int, Any]) -> None:
        book.received[1].discard(1)

    def no_ledger(book: Any, reports: dict[int, Any]) -> None:
        del reports[1]

    def lost_price(book: Any, reports: dict[int, Any]) -> None:
        reports[1].prices = 9

    def bad_state(book: Any, reports: dict[int, Any]) -> None:
        reports[1].ledger[0] = book.ledgers[1][0] = om.FAILED

    found: list[Breakage] = [missing, disagree, twice, two_finals, dropped_not_cancelled,
                             unreceived, no_ledger, lost_price, bad_state]
    return {f.__name__: f for f in found}


@pytest.mark.parametrize("breakage", list(breakages(om)))
def test_verify_rejects(breakage: str) -> None:
    book, reports = good_run(om)
    breakages(om)[breakage](book, reports)
    verdict = om.verify(book, reports, [1], 10)
    assert not verdict.verified
    summary = verdict.summary()
    assert "NOT verified" in summary and "agree: verified" not in summary
