"""A rank killed mid-stream by the fault layer, on every transport: tests/programs/killed_rank.py.

local (three ranks in one process, the victim dies in place), ibverbs under
``mate-run -n 3 --transport ibverbs`` in every progress mode, and MPI under
``mate-run -n 3`` (MPICH's hydra) in poll and thread progress. The program
checks the survivors itself (see its docstring); here the run's exit status,
mate-run's report of the dead rank and each rank's last words are checked.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import LAUNCHED
from launch import TESTS, run_bounded

from mate.run import find_mpiexec, is_hydra

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

PROGRAM = str(TESTS / "programs" / "killed_rank.py")
DEAD = "mate-run: rank 2 exited with status 137 (killed by SIGKILL)"
BOUND = 120.0  # seconds: no run may hang (each takes 1 to 8 s)


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    done = run_bounded(command, BOUND, str(command))
    print(done.stdout)  # the figures: how long the survivors took to see the death
    return done


def mate_run(*options: str) -> list[str]:
    return [sys.executable, "-m", "mate.run", "-n", "3", *options, "python", PROGRAM]


def survived(done: subprocess.CompletedProcess[str], prefix: bool, how: str) -> None:
    for rank in (0, 1):
        tag = f"[{rank}] " if prefix else ""
        assert f"{tag}rank {rank}: survived" in done.stdout, f"{done.stdout}\n{done.stderr}"
        assert f"to the dead rank {how}" in done.stdout, f"{done.stdout}\n{done.stderr}"


def test_local_rank_killed_in_place() -> None:
    done = run([sys.executable, PROGRAM, "--transport", "local", "--ranks", "3"])
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "rank 2: killed in place after 8 messages" in done.stdout
    survived(done, False, "failed (PEER_UNREACHABLE)")


@pytest.mark.parametrize("progress", ["loop", "poll", "thread"])
def test_ibverbs_rank_killed(progress: str) -> None:
    """The survivors' messages to the dead rank fail within 5 s, they go on exchanging,
    shutdown returns, mate-run reports the dead rank."""
    done = run([*mate_run("--transport", "ibverbs"), "--progress", progress])
    assert done.returncode == 137, f"{done.stdout}\n{done.stderr}"
    assert DEAD in done.stderr
    survived(done, True, "failed (PEER_UNREACHABLE)")


def hydra() -> bool:
    try:
        return is_hydra(find_mpiexec())
    except SystemExit:  # no mpiexec at all
        return False


@pytest.mark.skipif(not hydra(), reason="needs MPICH's mpiexec (hydra)")
@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_mpi_rank_killed(progress: str) -> None:
    """MPI never reports the death: the messages to the dead rank time out, the others
    go on, shutdown gives up on the dead rank after shutdown_timeout, mate-run reports it."""
    pytest.importorskip("mpi4py")
    done = run([*mate_run(), "--progress", progress])
    assert done.returncode == 137, f"{done.stdout}\n{done.stderr}"
    assert done.stderr.splitlines()[-1:] == [DEAD], done.stderr
    assert "not every rank reached shutdown within 1.0 s" in done.stderr
    survived(done, True, "timed out")
