"""examples/pingpong.py as users run it: one result line per run, from rank 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCHED
from launch import run_bounded

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="runs its own ranks")

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "pingpong.py"
MATE_RUN = [str(Path(sys.executable).with_name("mate-run")), "-n", "2"]


def run_script(*args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(launcher or []), sys.executable, str(SCRIPT), "--sizes", "0,8",
               "--rounds", "20", *args]
    return run_bounded(command, 120, "examples/pingpong.py")


def times_verified(done: subprocess.CompletedProcess[str]) -> int:
    """How often the result line was printed (counted in the text, not by lines: mpiexec
    may join two ranks' lines into one)."""
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.count("verified")


def test_local_prints_one_verified_line() -> None:
    done = run_script("--transport", "local")
    assert times_verified(done) == 1
    assert "verified" in done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
def test_mpi_prints_one_verified_line_from_rank_0() -> None:
    """Every rank used to print the line: twice under mate-run -n 2, with no rank prefix."""
    done = run_script("--transport", "mpi", launcher=MATE_RUN)
    assert times_verified(done) == 1, done.stdout
