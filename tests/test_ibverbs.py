"""The conformance suite and the fault tests on the ibverbs transport (soft device),
real processes under ``mate-run --transport ibverbs``, in every progress mode."""

from __future__ import annotations

import sys

import pytest
from conftest import LAUNCHED
from launch import TESTS, run_bounded, run_under_mate_run

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

PROGRESS = ("loop", "poll", "thread")


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("progress", PROGRESS)
def test_conformance_under_mate_run(nranks: int, progress: str) -> None:
    run_under_mate_run("test_conformance.py", nranks, {"progress": progress})


@pytest.mark.parametrize("progress", PROGRESS)
def test_conformance_on_uvloop(progress: str) -> None:
    pytest.importorskip("uvloop")
    run_under_mate_run("test_conformance.py", 2, {"progress": progress}, loop="uvloop")


@pytest.mark.parametrize("progress", PROGRESS)
def test_conformance_over_tcp(progress: str) -> None:
    run_under_mate_run("test_conformance.py", 2, {"progress": progress, "link": "tcp"})


@pytest.mark.parametrize("progress", PROGRESS)
def test_faults_under_mate_run(progress: str) -> None:
    run_under_mate_run("test_faults.py", 2, {"progress": progress})


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("progress", PROGRESS)
def test_adversarial_under_mate_run(nranks: int, progress: str) -> None:
    run_under_mate_run("test_adversarial.py", nranks, {"progress": progress})


@pytest.mark.parametrize("progress", PROGRESS)
def test_contract_under_mate_run(progress: str) -> None:
    run_under_mate_run("test_contract.py", 2, {"progress": progress})


@pytest.mark.parametrize("progress", PROGRESS)
def test_an_unexpose_ends_when_the_peer_closed_without_reading_the_revoke(
        progress: str) -> None:
    """tests/programs/unread_revoke.py: the peer's device took the REVOKE, its engine
    never read it, and it closed; the keepalive probe finds it gone."""
    done = run_bounded(
        [sys.executable, "-m", "mate.run", "-n", "2", "--transport", "ibverbs", "python",
         str(TESTS / "programs" / "unread_revoke.py"), "--progress", progress],
        120, "unread_revoke.py")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "[0] rank 0: closed with 1 frame(s) its engine never read" in done.stdout
    assert "[1] rank 1: unexposed in" in done.stdout
