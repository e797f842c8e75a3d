"""The conformance suite and the MPI-specific tests on real processes under mpiexec."""

from __future__ import annotations

import pytest
from conftest import LAUNCHED
from launch import run_under_mpiexec

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

# rma="auto" with a threshold low enough that the suites' puts and gets go both ways
AUTO = {"rma": "auto", "rma_threshold": 256}
MODES = [*({"progress": progress, "rma": rma} for progress in ("poll", "thread", "manual")
           for rma in ("native", "emulated")),
         *({"progress": progress, **AUTO} for progress in ("poll", "thread"))]
IDS = [f"{m['progress']}-{m['rma']}" for m in MODES]


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_conformance_under_mpiexec(nranks: int, options: dict[str, object]) -> None:
    run_under_mpiexec("test_conformance.py", nranks, options)


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_conformance_on_uvloop(progress: str) -> None:
    pytest.importorskip("uvloop")
    run_under_mpiexec("test_conformance.py", 2, {"progress": progress}, loop="uvloop")


@pytest.mark.parametrize("progress", ["poll", "thread", "manual"])
def test_mpi_specific_under_mpiexec(progress: str) -> None:
    # After the conformance suite in the same two processes: many worlds, one after
    # another, and a message that one leaves in MPI must not reach a later one's (a
    # nudge sent during shutdown did: test_a_shutting_down_rank_nudges_no_peer).
    run_under_mpiexec("test_conformance.py", 2, {"progress": progress},
                      extra=("tests/test_mpi_specific.py",))


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_large_messages_without_cma_under_mpiexec(progress: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # MPICH then copies a large message through shared memory a fragment per MPI call,
    # as where Yama's ptrace_scope or a container forbids cross-memory attach.
    monkeypatch.setenv("MPIR_CVAR_CH4_CMA_ENABLE", "0")
    run_under_mpiexec("test_mpi_transfers.py", 2, {"progress": progress})


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_faults_under_mpiexec(progress: str) -> None:
    run_under_mpiexec("test_faults.py", 2, {"progress": progress})


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_adversarial_under_mpiexec(nranks: int, options: dict[str, object]) -> None:
    run_under_mpiexec("test_adversarial.py", nranks, options)


@pytest.mark.parametrize("progress", ["poll", "thread", "manual"])
def test_contract_under_mpiexec(progress: str) -> None:
    run_under_mpiexec("test_contract.py", 2, {"progress": progress})
