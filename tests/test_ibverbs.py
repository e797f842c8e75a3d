"""The conformance suite and the fault tests on the ibverbs transport (soft device),
real processes under ``mate-run --transport ibverbs``, in every progress mode."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import LAUNCHED
from launch import TESTS, run_under_mate_run

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

PROGRESS = ("loop", "poll", "thread")


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("progress", PROGRESS)
def test_conformance_under_mate_run(nranks: int, progress: str) -> None:
    run_under_mate_run("test_conformance.py", nranks, {"progress": progress})


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
def test_a_rank_killed_mid_stream(progress: str) -> None:
    """tests/programs/killed_rank.py: the survivors' messages to the dead rank fail
    within 5 s, they go on exchanging, shutdown returns, mate-run reports the dead rank."""
    done = subprocess.run(
        [sys.executable, "-m", "mate.run", "-n", "3", "--transport", "ibverbs", "python",
         str(TESTS / "programs" / "killed_rank.py"), progress],
        capture_output=True, text=True, timeout=120, cwd=TESTS.parent)
    assert done.returncode == 137, f"{done.stdout}\n{done.stderr}"
    assert "mate-run: rank 2 exited with status 137 (killed by SIGKILL)" in done.stderr
    for rank in (0, 1):
        assert f"[{rank}] rank {rank}: survived" in done.stdout, f"{done.stdout}\n{done.stderr}"
    print(done.stdout)
