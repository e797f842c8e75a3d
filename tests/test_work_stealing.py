"""examples/work_stealing.py: the workload, the check, and runs on local and MPI, with faults.

The fault runs are what matters: they must stay exact, and they must really
exercise the paths that keep them exact (grants that fail and are taken back,
grants that time out and are settled by a query, late grants refused). A
variant with the naive rule "a grant that timed out is taken back" must fail
the same check, so the check is known to catch duplicated work.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import LAUNCHED
from launch import load_script, run_bounded

import mate
import mate.spmd
from mate.faults import FaultPlan

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="runs its own ranks")

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "work_stealing.py"


ws = load_script(SCRIPT)


def config(**changes: Any) -> Any:
    base = ws.Config(n=9, split=3, threshold=8, model="progressive", timeout=0.05,
                     grant_wait=0.3, faults=None, seed=1)
    return attrs.evolve(base, **changes)


async def run_local(cfg: Any, ranks: int) -> Any:
    results = await mate.spmd.run(lambda world: ws.program(world, cfg), transport="local",
                                  ranks=ranks)
    (result,) = [r for r in results if r is not None]
    return result


# -- the workload and the check ---------------------------------------------------------------


@pytest.mark.parametrize("n", range(4, 10))
def test_units_hold_every_solution_once(n: int) -> None:
    for split in range(n + 1):
        units = ws.units_of(n, split)
        assert [u[0] for u in units] == list(range(len(units)))
        assert sum(ws.solve(n, split, *u[1:]) for u in units) == ws.KNOWN[n]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_deal_is_an_uneven_partition(size: int) -> None:
    units = ws.units_of(8, 3)
    shares = [ws.deal(units, rank, size) for rank in range(size)]
    assert [u for share in shares for u in share] == units
    assert all(len(a) >= len(b) for a, b in itertools.pairwise(shares))
    assert ws.unpack_units(ws.pack_units(units)) == units


def test_the_check_catches_lost_duplicated_and_wrong_work() -> None:
    units = ws.units_of(8, 2)
    total = len(units)

    def stats(rank: int, numbers: list[int], solutions: int, **extra: int) -> dict[str, Any]:
        s = attrs.asdict(ws.Stats(rank, units=len(numbers), number_sum=sum(numbers),
                                  number_squares=sum(i * i for i in numbers),
                                  solutions=solutions))
        return {**s, **extra}

    def result(*per_rank: dict[str, Any]) -> Any:
        return ws.Result(config(n=8, split=2), len(per_rank), total, 1.0, 1.0, list(per_rank))

    half = total // 2
    good = result(stats(0, list(range(half)), 50), stats(1, list(range(half, total)), 42))
    assert good.problems() == []
    lost = result(stats(0, list(range(half)), 50), stats(1, list(range(half, total - 1)), 42))
    twice = result(stats(0, list(range(half + 1)), 50), stats(1, list(range(half, total)), 42))
    swapped = result(stats(0, [*range(half - 1), half], 50),  # 2 units traded for others
                     stats(1, [half - 1, half - 1, *range(half + 2, total), total - 1], 42))
    wrong = result(stats(0, list(range(half)), 50), stats(1, list(range(half, total)), 41))
    leftover = result(stats(0, list(range(half)), 50),
                      stats(1, list(range(half, total)), 42, leftover=1))
    for bad in (lost, twice, swapped, wrong, leftover):
        assert bad.problems(), bad


def test_speed_up_is_shown_only_where_it_means_something(
        capsys: pytest.CaptureFixture[str]) -> None:
    """On the local transport every rank shares one process, one loop and one core: a
    speed-up over one rank ("0.02x") means nothing there, so it is left out."""
    units = ws.units_of(8, 2)
    stats = [attrs.asdict(ws.Stats(0, units=len(units), number_sum=sum(range(len(units))),
                                   number_squares=sum(i * i for i in range(len(units))),
                                   solutions=92)),
             attrs.asdict(ws.Stats(1))]
    result = ws.Result(config(n=8, split=2), 2, len(units), 0.02, 1.0, stats)
    shown = {}
    for transport in ("local", "mpi"):
        assert ws.show(result, transport) == 0
        shown[transport] = capsys.readouterr().out.strip().splitlines()[-1]
        assert "verified" in shown[transport] and "NOT" not in shown[transport]
        assert ws.as_json(result, transport)["verified"]
    assert "over one rank" not in shown["local"] and "0.02x" not in shown["local"]
    assert ws.as_json(result, "local")["speedup"] is None
    assert "0.02x over one rank" in shown["mpi"]
    assert ws.as_json(result, "mpi")["speedup"] == pytest.approx(0.02)


# -- runs on the local transport ----------------------------------------------------------------


@pytest.mark.parametrize("model", ws.MODELS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
async def test_every_model_counts_exactly(model: str, ranks: int) -> None:
    result = await run_local(config(model=model), ranks)
    assert result.problems() == []
    assert sum(s["units"] for s in result.stats) == result.units
    if ranks > 1:
        assert sum(s["steals"] for s in result.stats) > 0  # the uneven deal forces steals


FAULTS = FaultPlan(drop=0.1, delay=0.15, fail=0.1, delay_seconds=0.1)


async def fault_runs(seeds: range) -> list[Any]:
    results = []
    for seed in seeds:
        for model in ws.MODELS:
            cfg = config(model=model, seed=seed, split=4, threshold=20,
                         faults=attrs.evolve(FAULTS, seed=seed))
            results.append(await run_local(cfg, 2 + seed % 3))
    return results


async def test_faults_leave_the_answer_exact_and_exercise_every_path() -> None:
    results = await fault_runs(range(4))
    for result in results:
        assert result.problems() == [], (result.config, result.problems())

    def total(key: str) -> int:
        return sum(s[key] for r in results for s in r.stats)

    injected = {k: sum(s["injected"][k] for r in results for s in r.stats)
                for k in ("drop", "delay", "fail")}
    assert all(injected.values()), injected
    assert total("retries") > 0  # requests re-sent after failure, timeout or a lost grant
    assert total("queries") > 0  # grants that timed out, settled by asking the thief
    assert total("taken_back") > 0  # failed or unreceived grants, back with the victim
    assert total("refused") > 0  # a grant that arrived after the thief said "no"


def late_grants(seed: int) -> Any:
    """Runs long enough for grants delayed past their timeout to arrive while work remains."""
    return config(n=11, split=4, threshold=20, seed=seed, timeout=0.01,
                  faults=FaultPlan(delay=0.3, delay_seconds=0.03, seed=seed))


async def outcome(cfg: Any) -> list[str]:
    try:
        return list((await run_local(cfg, 3)).problems())
    except Exception as exc:  # e.g. a rank told to stop while it still had work
        return [repr(exc)]


async def test_taking_back_timed_out_grants_breaks_the_count(monkeypatch: Any) -> None:
    """The naive rule duplicates work when a timed-out grant still arrives; ours does not."""
    seeds = range(4)
    for seed in seeds:
        assert await outcome(late_grants(seed)) == []

    def naive(self: Any, gid: int, state: mate.State) -> None:
        if gid in self.lent:
            if state is mate.State.COMPLETED:
                del self.lent[gid]
            else:
                self.take_back(gid)

    monkeypatch.setattr(ws.Stealer, "grant_ended", naive)
    broken = [seed for seed in seeds if await outcome(late_grants(seed))]
    assert broken, "the naive rule never duplicated work: the test lost its teeth"


# -- the script, as users run it ----------------------------------------------------------------


def run_script(*args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(launcher or []), sys.executable, str(SCRIPT), *args]
    return run_bounded(command, 180, "examples/work_stealing.py")


def assert_verified(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert "verified" in last and "NOT" not in last, done.stdout
    return last


def test_script_on_the_local_transport_with_faults() -> None:
    last = assert_verified(run_script("--transport", "local", "--ranks", "3", "-n", "9",
                                      "--faults", "drop=0.05,delay=0.05,fail=0.05"))
    assert "352 solutions of 9-queens" in last and "faults drop=0.05" in last


def test_script_fails_its_check_on_a_deadline() -> None:
    done = run_script("--transport", "local", "-n", "12", "--deadline", "0.05")
    assert done.returncode == 1
    assert "NOT verified" in done.stdout.strip().splitlines()[-1]


def test_script_rejects_bad_options() -> None:
    assert run_script("--queens", "30").returncode == 2
    done = run_script("--transport", "local", "--handlers", "progress")
    assert done.returncode == 2 and "progress thread" in done.stderr


mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
MATE_RUN = [str(Path(sys.executable).with_name("mate-run")), "-n", "2"]


@mpi
@pytest.mark.parametrize("model", ws.MODELS)
def test_script_under_mpi(model: str) -> None:
    last = assert_verified(run_script("--transport", "mpi", "--model", model, "-n", "10",
                                      "--faults", "drop=0.05,delay=0.05,fail=0.05",
                                      launcher=MATE_RUN))
    assert "mpi, 2 ranks" in last


@mpi
def test_script_under_mpi_with_handlers_on_the_progress_thread() -> None:
    assert_verified(run_script("--transport", "mpi", "--progress", "thread", "--handlers",
                               "progress", "-n", "10", launcher=MATE_RUN))


@mpi
@pytest.mark.parametrize("model", ["progressive", "driven"])
def test_script_with_faults_and_handlers_on_the_progress_thread(model: str) -> None:
    """Issue 13, defect 2: the fault layer's relay used to deadlock on the handler lock."""
    assert_verified(run_script("--transport", "mpi", "--progress", "thread", "--handlers",
                               "progress", "--model", model, "-n", "10", "--deadline", "60",
                               "--faults", "drop=0.1,delay=0.1:0.1,fail=0.1",
                               launcher=MATE_RUN))


@pytest.mark.parametrize("extra", [[], ["--progress", "thread", "--handlers", "progress"]],
                         ids=["loop", "thread-handlers"])
def test_script_under_mate_run_on_ibverbs(extra: list[str]) -> None:
    launcher = [str(Path(sys.executable).with_name("mate-run")), "-n", "3", "--transport",
                "ibverbs"]
    last = assert_verified(run_script("--transport", "ibverbs", "-n", "9", *extra,
                                      "--faults", "drop=0.05,delay=0.05,fail=0.05",
                                      launcher=launcher))
    assert "ibverbs, 3 ranks" in last


@pytest.mark.parametrize("transport", [
    "ibverbs", pytest.param("mpi", marks=mpi)])
def test_a_final_that_arrives_after_its_timeout_still_lets_every_rank_leave(
        transport: str) -> None:
    """Nearly every message is delayed past its timeout, the FINALs included, so a rank's
    FINAL reaches rank 0 while the rank is still sending copies. Rank 0 used to leave at
    once, and the rank kept sending to it until the deadline (CI, ibverbs: 1 run in many)."""
    launcher = [str(Path(sys.executable).with_name("mate-run")), "-n", "3", "--transport",
                transport]
    last = assert_verified(run_script("--transport", transport, "-n", "8", "--timeout", "0.05",
                                      "--faults", "delay=0.9:0.1", "--deadline", "30",
                                      launcher=launcher))
    assert "delay=0.9:0.1" in last
