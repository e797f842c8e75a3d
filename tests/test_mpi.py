"""The conformance suite and the MPI-specific tests on real processes under mpiexec."""

from __future__ import annotations

import pytest
from conftest import LAUNCHED
from launch import run_under_mpiexec

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

MODES = [(progress, rma) for progress in ("poll", "thread", "manual")
         for rma in ("native", "emulated")]


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize(("progress", "rma"), MODES)
def test_conformance_under_mpiexec(nranks: int, progress: str, rma: str) -> None:
    run_under_mpiexec("test_conformance.py", nranks, {"progress": progress, "rma": rma})


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_mpi_specific_under_mpiexec(progress: str) -> None:
    run_under_mpiexec("test_mpi_specific.py", 2, {"progress": progress})


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_faults_under_mpiexec(progress: str) -> None:
    run_under_mpiexec("test_faults.py", 2, {"progress": progress})


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize(("progress", "rma"), MODES)
def test_adversarial_under_mpiexec(nranks: int, progress: str, rma: str) -> None:
    run_under_mpiexec("test_adversarial.py", nranks, {"progress": progress, "rma": rma})


@pytest.mark.parametrize("progress", ["poll", "thread", "manual"])
def test_contract_under_mpiexec(progress: str) -> None:
    run_under_mpiexec("test_contract.py", 2, {"progress": progress})
