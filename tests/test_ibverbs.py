"""The conformance suite and the fault tests on the ibverbs transport (soft device),
real processes under ``mate-run --transport ibverbs``, in every progress mode."""

from __future__ import annotations

import pytest
from conftest import LAUNCHED
from launch import run_under_mate_run

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
